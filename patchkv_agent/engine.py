"""PatchKVEngine: the object users hold.

``checkpoint(ids)`` runs the checkpoint-creation pass (prefill + attention statistics) and offloads
the KV to CPU; ``resume(ckpt, new_ids, strategy=...)`` diffs the versions, plans, restores,
recomputes, and decodes greedily. Validates input before any compute; an unsupported case (RoPE
kind, ...) takes the exact path and says so in ``stats["fallback"]``.

Knows models, diff, plan, strategies and recovery; knows nothing about LangGraph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from .core.diff import Edit, diff_versions
from .core.models import DEFAULT_MODEL, ModelSpec, load_model, model_spec
from .core.plan import LengthModel, plan_full
from .core.recovery import (
    FullRecompute,
    check_attn_implementation,
    execute,
    greedy_decode,
    to_dynamic_cache,
)
from .core.precision import PrecisionPolicy
from .core.checkpoint import Checkpoint, CorruptCheckpoint, build_mixed
from .strategies import Strategy, get_strategy

DEFAULT_DIRTY_WINDOW = 32


@dataclass(eq=False)
class ResumeResult:
    """What a resume returns.

    Attributes:
        logits: first-token logits ``[vocab]`` (float32).
        output_ids: greedy continuation (ends with EOS if one was produced).
        cache: a transformers ``DynamicCache`` holding ``C_new``'s KV plus the decoded tokens except
            the last; ``model(input_ids=[[output_ids[-1]]], cache=res.cache)`` continues.
        stats: the per-resume fields of the result format, docs/TRACES.md (``ttft_s``, ``recompute_tokens``, ...), plus
            ``fallback`` (None, or why the exact path was taken).
        context_ids: ``C_new`` token ids.
        keys, values: per layer ``[1, H, len(C_new), D]`` K/V of ``C_new`` (what the next checkpoint holds).
        edit: the diff of the checkpoint's version against ``C_new``.
    """

    logits: torch.Tensor
    output_ids: list[int]
    cache: Any
    stats: dict[str, Any]
    context_ids: np.ndarray
    keys: list[torch.Tensor] = field(repr=False)
    values: list[torch.Tensor] = field(repr=False)
    edit: Edit | None = None


class PatchKVEngine:
    """Selective KV recovery over one Hugging Face causal LM.

    Args:
        model: a loaded transformers causal LM with sdpa or eager attention.
        tokenizer: its tokenizer, or None when callers pass token ids only.
        block_size: suffix block size in tokens (unit of selection, transfer and precision).
        dirty_window: fixed dirty-window length used until a calibrated length model is given.
        kappa: fraction of suffix tokens outside the window recomputed by attention score.
        length_model: a calibrated :class:`~patchkv_agent.core.plan.LengthModel` (overrides ``dirty_window``).
        capture_window: how many final query positions the attention statistics look from.
        mixed_precision: also write mixed-precision runs (FP16/K8V8/K8V4 per block) into checkpoints.
        precision_policy: thresholds of the per-block precision rule.
        profile: ``"auto"`` (default) loads this model's calibration profile from
            ``calibration/profiles/`` by fingerprint (or by the name it was loaded by); a dict applies
            that profile; None uses the built-in defaults. Explicit arguments above override it.

    Raises:
        ValueError: the model's attention implementation cannot take per-token masks.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        block_size: int | None = None,
        dirty_window: int | None = None,
        kappa: float | None = None,
        length_model: LengthModel | None = None,
        capture_window: int = 32,
        mixed_precision: bool = True,
        precision_policy: PrecisionPolicy | None = None,
        profile: dict | str | None = "auto",
    ):
        check_attn_implementation(model)
        if block_size is not None and block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec: ModelSpec = model_spec(model, tokenizer)
        self.block_size, self.kappa = 32, 0.0
        self.length_model = LengthModel.fixed(DEFAULT_DIRTY_WINDOW)
        self.precision_policy = PrecisionPolicy()
        self.profile_path: str | None = None
        self._apply_profile(profile)
        # explicit arguments win over the profile
        if block_size is not None:
            self.block_size = block_size
        if kappa is not None:
            self.kappa = kappa
        if dirty_window is not None:
            self.length_model = LengthModel.fixed(dirty_window)
        if length_model is not None:
            self.length_model = length_model
        if precision_policy is not None:
            self.precision_policy = precision_policy
        self.capture_window = capture_window
        self.mixed_precision = mixed_precision
        self.device = next(model.parameters()).device
        eos = getattr(model.config, "eos_token_id", None)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))

    def _apply_profile(self, profile) -> None:
        if profile is None:
            return
        from .profiles import apply_profile, load_profile

        if profile == "auto":
            profile = load_profile(self.spec.fingerprint, model_name=getattr(self.model, "patchkv_source", None))
            if profile is None:
                return
        elif not isinstance(profile, dict):
            raise ValueError("profile must be 'auto', a profile dict (patchkv_agent.profiles.load_profile) or None")
        apply_profile(self, profile)
        pol = profile.get("precision_policy")
        if isinstance(pol, dict) and pol.get("calibrated", True):  # uncalibrated entries keep the defaults
            self.precision_policy = PrecisionPolicy(**{k: float(pol[k]) for k in ("alpha", "tau_L", "tau_H", "g4")
                                                       if k in pol})

    @classmethod
    def from_pretrained(cls, name_or_path: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", **kwargs) -> "PatchKVEngine":
        """Load a model (HF id, local dir, ``.gguf`` path or ``"smollm2-135m"``) and wrap it.

        Args:
            name_or_path: what to load; see :func:`patchkv_agent.core.models.load_model`.
            dtype: parameter dtype.
            device: where the model runs.
            **kwargs: engine options (``block_size``, ``dirty_window``, ``kappa``, ...).

        Returns:
            The engine.
        """
        model, tok = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tok, **kwargs)

    # ----------------------------------------------------------------- input

    def encode(self, context: str | Sequence[dict] | Sequence[int]) -> list[int]:
        """Token ids of a context: chat messages (chat template, generation prompt added), raw text, or ids.

        Raises:
            ValueError: text or messages without a tokenizer.
        """
        if isinstance(context, str) or (len(context) and isinstance(context[0], dict)):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids, or build it with a tokenizer")
            if isinstance(context, str):
                return list(self.tokenizer(context, add_special_tokens=False)["input_ids"])
            text = self.tokenizer.apply_chat_template(list(context), tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return [int(t) for t in context]

    def _validate_ids(self, token_ids, what: str = "token_ids") -> np.ndarray:
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 1:
                raise ValueError(f"{what} must be a 1-D tensor or a list of ints, got shape {tuple(token_ids.shape)}")
            ids = token_ids.detach().cpu().numpy().astype(np.int64)
        else:
            ids = np.asarray(list(token_ids), dtype=np.int64)
            if ids.ndim != 1:
                raise ValueError(f"{what} must be a flat list of ints")
        if ids.size == 0:
            raise ValueError(f"{what} is empty: a context needs at least one token")
        bad = ids[(ids < 0) | (ids >= self.spec.vocab_size)]
        if bad.size:
            raise ValueError(f"{what} holds ids outside the vocabulary [0, {self.spec.vocab_size}): "
                             f"{bad[:5].tolist()}; tokenize with this model's tokenizer")
        if ids.size > self.spec.max_positions:
            raise ValueError(f"{what} has {ids.size} tokens, more than the model's maximum of "
                             f"{self.spec.max_positions} positions; trim or compact the context")
        return ids

    def _validate_checkpoint(self, ckpt: Checkpoint) -> None:
        if not isinstance(ckpt, Checkpoint):
            raise TypeError(f"expected a Checkpoint from PatchKVEngine.checkpoint, got {type(ckpt).__name__}")
        if ckpt.fingerprint != self.spec.fingerprint:
            raise ValueError(
                f"checkpoint was written by another model or tokenizer ({ckpt.fingerprint[:24]}...) than this "
                f"engine's ({self.spec.fingerprint[:24]}...); re-create it with this engine's checkpoint()")

    # ----------------------------------------------------------- checkpoint

    def _capture(self):
        try:
            from .core.capture import AttentionCapture
        except ImportError:  # statistics are optional for exact strategies
            return None
        return AttentionCapture(self.model, window=self.capture_window)

    def checkpoint(self, token_ids) -> Checkpoint:
        """Checkpoint-creation pass: prefill with attention statistics, offload every layer's KV to CPU.

        Args:
            token_ids: list of ints or 1-D tensor.

        Returns:
            A :class:`Checkpoint` carrying this model's fingerprint.

        Raises:
            ValueError: empty ids, ids outside the vocabulary, or longer than the model's maximum.
        """
        ids = self._validate_ids(token_ids)
        t0 = time.perf_counter()
        cap = self._capture()
        ids_t = torch.from_numpy(ids)
        if cap is None:
            out = execute(self.model, self.spec, ids_t, FullRecompute(new_len=len(ids)))
            scores = None
        else:
            with cap:
                out = execute(self.model, self.spec, ids_t, FullRecompute(new_len=len(ids)))
            scores = cap.scores()
        ckpt = self._offload(ids, out.keys, out.values, scores)
        ckpt.stats.update(offload_s=time.perf_counter() - t0, prefill_s=out.stats["recompute_s"],
                          stats_s=getattr(cap, "elapsed_s", None), source="prefill")
        return ckpt

    def _offload(self, ids, keys, values, scores) -> Checkpoint:
        t0 = time.perf_counter()
        mixed = None
        if self.mixed_precision:
            mixed = build_mixed([k[0] for k in keys], [v[0] for v in values], scores,
                                block_size=self.block_size, policy=self.precision_policy)
            mixed = replace(mixed, payloads=[{t: _host(p) for t, p in layer.items()} for layer in mixed.payloads])
        quantize_s = time.perf_counter() - t0
        return Checkpoint(
            token_ids=np.asarray(ids, dtype=np.int64).copy(),
            keys=[_host(k[0].detach()) for k in keys],
            values=[_host(v[0].detach()) for v in values],
            fingerprint=self.spec.fingerprint,
            scores=scores,
            mixed=mixed,
            stats={"quantize_s": quantize_s},
        )

    @torch.no_grad()
    def checkpoint_from(self, result: ResumeResult) -> Checkpoint:
        """Offload a resumed state as the base version for the next edit of its thread.

        Attention statistics are re-taken by rerunning the last ``capture_window`` positions over the
        resumed KV (the resumed K/V themselves are kept as they were).

        Args:
            result: a :class:`ResumeResult` of this engine.

        Returns:
            A :class:`Checkpoint` of ``result.context_ids``.
        """
        t0 = time.perf_counter()
        ids = result.context_ids
        n = len(ids)
        scores = None
        cap = self._capture()
        if cap is not None:
            w = min(self.capture_window, n)
            plan = _TailPlan(new_len=n, tail=w)
            with cap:  # execute writes into fresh tensors: result's K/V stay as they were
                execute(self.model, self.spec, torch.from_numpy(ids), plan, [k[0] for k in result.keys],
                        [v[0] for v in result.values])
            scores = cap.scores()
        ckpt = self._offload(ids, result.keys, result.values, scores)
        ckpt.stats.update(offload_s=time.perf_counter() - t0, stats_s=getattr(cap, "elapsed_s", None),
                          source="resume")
        return ckpt

    def as_checkpoint(self, result: ResumeResult) -> Checkpoint:
        """A zero-copy checkpoint view of a resident result (no statistics, no mixed-precision runs).

        Resuming from it skips the offload pass entirely (the KV never left the device); ``patchkv``
        then restores at full precision and picks no attention blocks (there are no scores).

        Args:
            result: a :class:`ResumeResult` of this engine.

        Returns:
            A :class:`Checkpoint` sharing ``result``'s K/V tensors; do not mutate them while it is used.
        """
        return Checkpoint(token_ids=np.asarray(result.context_ids, dtype=np.int64),
                          keys=[k[0] for k in result.keys], values=[v[0] for v in result.values],
                          fingerprint=self.spec.fingerprint, scores=None, mixed=None,
                          stats={"offload_s": 0.0, "stats_s": None, "quantize_s": 0.0, "source": "resident"})

    # ---------------------------------------------------------------- resume

    @staticmethod
    def strategy(strategy: str | Strategy = "patchkv", **options) -> Strategy:
        """The :class:`Strategy` that :meth:`resume` would use for ``strategy`` and ``options``.

        Lets callers above the engine (the checkpoint tiers) reject misuse before any I/O without
        importing the strategies themselves.

        Raises:
            ValueError: an unknown strategy name or option.
        """
        return get_strategy(strategy, **options)

    def resume(self, ckpt: Checkpoint | None, new_token_ids, strategy: str | Strategy = "patchkv",
               max_new_tokens: int = 16, **options) -> ResumeResult:
        """Recover the KV of an edited context from a checkpoint and decode greedily.

        Args:
            ckpt: the checkpoint of the previous version (may be None for ``exact``), or a resident
                :class:`ResumeResult` of this engine (resumed from without an offload pass).
            new_token_ids: ids of ``C_new`` (list of ints or 1-D tensor).
            strategy: ``exact``, ``prefix``, ``direct``, ``patchkv`` (or a :class:`Strategy`).
            max_new_tokens: greedy tokens to decode (0: only the first-token logits).
            **options: strategy options, e.g. ``dirty_window=`` or ``kappa=`` for ``patchkv``.

        Returns:
            A :class:`ResumeResult`.

        Raises:
            ValueError: bad ids, a checkpoint of another model, or an unknown strategy.
        """
        new = self._validate_ids(new_token_ids, "new_token_ids")
        strat = get_strategy(strategy, **options)
        if isinstance(ckpt, ResumeResult):
            ckpt = self.as_checkpoint(ckpt)
        if ckpt is None and strat.uses_checkpoint:
            raise ValueError(f"strategy {strat.name!r} needs a checkpoint; pass one from engine.checkpoint()")
        if ckpt is not None:
            self._validate_checkpoint(ckpt)
        t0 = time.perf_counter()
        old = ckpt.token_ids if ckpt is not None else np.zeros(0, dtype=np.int64)
        edit = diff_versions(old, new)
        plan = strat.plan(self, ckpt, edit)
        fallback = None
        restore_new = np.asarray(plan.restore_new_positions)
        if len(restore_new) and not self.spec.rope_supported:
            shifted = np.any(restore_new != np.asarray(plan.restore_old_positions))
            if shifted:
                fallback = f"exact recompute: {self.spec.rope_unsupported_reason}"
                plan = plan_full(edit, block_size=self.block_size)
        plan_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        out = None
        if fallback is None:
            try:
                out = strat.execute(self, ckpt, edit, plan, torch.from_numpy(new))
            except CorruptCheckpoint as e:  # never serve corrupted state: recompute exactly, say why
                fallback = f"exact recompute: {e}"
                plan = plan_full(edit, block_size=self.block_size)
        if out is None:
            out = execute(self.model, self.spec, torch.from_numpy(new), plan, ckpt.keys, ckpt.values)
        first = int(out.logits.argmax())
        ttft = time.perf_counter() - t1
        cache = to_dynamic_cache(self.model, out.keys, out.values)
        output_ids = greedy_decode(self.model, cache, out.logits, len(new), max_new_tokens, self.eos_ids)
        assert not output_ids or output_ids[0] == first
        n_restore = len(plan.restore_new_positions)
        prefix_tokens = min(edit.prefix_len, len(new))
        denom = max(1, len(new) - min(plan.prefix_len, prefix_tokens))
        stats: dict[str, Any] = {
            "strategy": strat.name,
            "prompt_tokens": len(new),
            "prefix_tokens": prefix_tokens,
            "new_tokens": int(edit.new_token_count),
            "suffix_tokens": int(edit.suffix_len),
            "recompute_tokens": int(out.stats["recompute_tokens"]),
            "recompute_ratio": out.stats["recompute_tokens"] / denom,
            "restore_tokens": int(n_restore),
            "payload_bytes": int(out.stats.get("payload_bytes", 0)),
            "ttft_s": ttft,
            "plan_s": plan_s,
            "restore_s": out.stats["restore_s"],
            "recompute_s": out.stats["recompute_s"],
            "offload_s": ckpt.stats.get("offload_s") if ckpt is not None else None,
            "stats_s": ckpt.stats.get("stats_s") if ckpt is not None else None,
            "quantize_s": ckpt.stats.get("quantize_s") if ckpt is not None else None,
            "fallback": fallback,
        }
        stats.update({k: v for k, v in out.stats.items() if k not in stats})  # strategy-specific extras
        return ResumeResult(logits=out.logits, output_ids=output_ids, cache=cache, stats=stats,
                            context_ids=new, keys=out.keys, values=out.values, edit=edit)


def _host(x):
    """A CPU copy of a tensor or RunPayload, pinned when CUDA is present (for non-blocking restores)."""
    x = x.to("cpu") if not isinstance(x, torch.Tensor) else x.to("cpu", copy=True)
    return x.pin_memory() if torch.cuda.is_available() else x


@dataclass(frozen=True, kw_only=True)
class _TailPlan:
    """Recompute only the last ``tail`` positions, keep every other row as it is (for statistics)."""

    new_len: int
    tail: int

    @property
    def prefix_len(self) -> int:
        return self.new_len - self.tail

    @property
    def restore_old_positions(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    restore_new_positions = restore_old_positions

    @property
    def recompute_positions(self) -> np.ndarray:
        return np.arange(self.new_len - self.tail, self.new_len, dtype=np.int64)
