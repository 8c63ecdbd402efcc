"""The mechanisms of selective recovery, each usable alone; no engine, runtime or evaluation here.

- :mod:`.models`: load a model (HF id, local dir, GGUF, the embedded default); :class:`ModelSpec` (RoPE
  kind and layout probed against the model's own rotary code) and the weights+tokenizer fingerprint.
- :mod:`.diff`: two token versions -> :class:`~.diff.Edit` (prefix, edited spans, aligned suffix).
- :mod:`.capture`: attention statistics taken during the checkpoint pass.
- :mod:`.plan`: dirty window + attention blocks + BlockRound -> :class:`~.plan.RepairPlan`.
- :mod:`.precision`: per-block FP16 / K8V8 / K8V4 / K4V4 tags.
- :mod:`.checkpoint`: :class:`~.checkpoint.Checkpoint` (full-precision rows + checksummed mixed runs).
- :mod:`.recovery`: restore (dequantize + RoPE delta + scatter) and recompute in one forward.
- :mod:`.runner`: :class:`~.runner.ModelRunner`, what the package keeps per model instance (forward lock,
  attention capture, weight watch, cache layout, device), beside the model, never on it; the K/V layout.
- :mod:`.settings`: :class:`~.settings.RecoverySettings`, the frozen settings strategies and the
  checkpoint pass read (block size, length model, kappa, precision, capture window).
- :mod:`.fallback`: :class:`~.fallback.Fallback` ``(kind, detail)``: why a resume was recomputed exactly.

``diff``, ``plan``, ``settings`` and ``fallback`` import without torch.
"""
