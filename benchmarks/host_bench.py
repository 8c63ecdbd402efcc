"""Host-side cost of a resume, stage by stage, with a forward of negligible cost (``patchkv-agent bench-host``).

On an accelerator a selective resume of a few hundred tokens takes tens of milliseconds, so what the host
does around the forward must be far below that. This benchmark runs the resume path's host stages exactly
as :meth:`PatchKVEngine.resume <patchkv_agent.engine.PatchKVEngine.resume>` calls them, on synthetic
checkpoints of 2k to 128k tokens with 1 / 4 / 16 edits, and times each stage:

- ``validate``: :meth:`PatchKVEngine.validate_ids` of ``C_new`` as an int64 array (what the engine's
  encoder and the chat model hand the resume) and, separately, as a Python list (``validate_list``: what a
  tokenizer's ``input_ids`` are; converting 128k Python ints costs milliseconds whatever is checked);
- ``diff``: :func:`~patchkv_agent.core.diff.diff_versions` of the checkpoint's ids and ``C_new``;
- ``words``: :meth:`Edit.new_words <patchkv_agent.core.diff.Edit.new_words>`, the new version's word ids
  from the checkpoint's carried ones (only the edited words are read);
- ``plan``: the ``patchkv`` strategy's plan (lexical readers on, stored attention);
- ``bookkeeping``: :class:`~patchkv_agent.core.recovery.RecoveryBuffers` (plan checks, destination K/V);
- ``kv_copy``: its ``restore`` from the mixed-precision runs (the ``patchkv`` path: prefix rows copied,
  suffix rows dequantized and RoPE-shifted), and ``kv_copy_fp`` from the full-precision rows, both into the
  freshly allocated destination a resume writes (its first touch pays the page faults); ``kv_copy_fp_warm``
  is the same restore again into that destination (the copy itself, as into a reused buffer);
- ``cache``: :meth:`~patchkv_agent.core.runner.ModelRunner.dynamic_cache` of the recovered K/V.

With a tokenizer (``--tokenizer``, or a ``--model`` that has one), the text side too: a synthetic
conversation of each length rendered through the chat template (``template``), then tokenized whole
(``tokenize_whole``: what a prefix cache's caller pays) and through the engine's
:class:`~patchkv_agent.core.encoding.SegmentEncoder` after the previous version was encoded
(``tokenize_memo``: one tool result cleared and one appended, the ClearToolUsesEdit shape).

``host_ms`` is the sum of every stage but the forward and the KV copy (validation of the array form). Beside
it, the KV copy's bandwidth (destination bytes written per second) against a plain ``copy_`` of the same
bytes on the same device: the physical limit. The model is a one-layer llama built from a config (random
weights, no forward is run) unless ``--model`` names a real one, whose shapes are then used.

Boundary: knows the engine, diff, plan, strategies and recovery through their public functions; writes
JSON and a PNG. Timings are medians over ``--repeats``; nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from patchkv_agent.loading import is_random

__all__ = ["run_host_bench", "run_tokenize_bench", "host_engine", "plot_host", "bench_plan", "add_cli", "main"]

STAGES = ("validate", "diff", "words", "plan", "bookkeeping", "cache")  # host_ms sums these
DEFAULT_LENGTHS = (2048, 8192, 32768, 131072)
DEFAULT_EDITS = (1, 4, 16)
TARGETS_MS = {8192: 1.0, 32768: 3.0, 131072: 10.0}  # host-time targets: one edit, time outside forward and KV copy

_WORDS = ["the", "result", "Sofia", "tool", "call", "json", "value", "id", "name", "error", "ok", "city",
          "of", "in", "to", "data", "query", "page", "x", "42"]


def _piece(i: int) -> str:
    """A deterministic stand-in vocabulary: words with and without a leading space, digits, punctuation."""
    w = _WORDS[i % len(_WORDS)]
    kind = (i // len(_WORDS)) % 5
    return ("Ġ" + w, w, w.upper(), "Ġ" + w[:2], ".,:{}()\"Ċ"[i % 9])[kind]


def host_engine(*, layers: int = 1, kv_heads: int = 2, head_dim: int = 64, max_positions: int = 140_000,
                device: str = "cpu"):
    """A :class:`PatchKVEngine` over a one-layer llama from :func:`.tiny.tiny_engine` (random weights, plain
    init, vocabulary 4096), with a word index.

    Args:
        layers, kv_heads, head_dim: the KV shapes.
        max_positions: the model's maximum positions.
        device: where the (never run) model and the destination K/V live.

    Returns:
        The engine (``profile=None``: built-in settings, block 32).
    """
    from patchkv_agent.core.lexicon import WordIndex
    from .tiny import tiny_engine

    eng = tiny_engine(seed=0, scale=1.0, layers=layers, heads=kv_heads, kv_heads=kv_heads, head_dim=head_dim,
                      max_positions=max_positions, device=device,
                      config={"vocab_size": 4096, "hidden_size": kv_heads * head_dim, "intermediate_size": 64,
                              "pad_token_id": None},
                      block_size=None, dirty_window=None, profile=None)
    eng.words = WordIndex(_piece)
    return eng


def _versions(n: int, n_edits: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, vocab, n).astype(np.int64)
    parts, cut = [], 0
    for k in range(n_edits):  # each edit replaces 10 tokens by 20, spread evenly
        s = (k + 1) * n // (n_edits + 1)
        parts += [old[cut:s], rng.integers(0, vocab, 20)]
        cut = s + 10
    parts.append(old[cut:])
    return old, np.concatenate(parts).astype(np.int64)


def _checkpoint(eng, old: np.ndarray, seed: int):
    """A checkpoint of ``old`` with random K/V of the engine's shapes and dtype, mixed runs and carried words."""
    from patchkv_agent.core.checkpoint import Checkpoint, build_mixed

    spec = eng.spec
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_kv_heads, len(old), spec.head_dim)
    dtype = next(eng.model.parameters()).dtype  # what a checkpoint of this model holds (bf16 for a bf16 model)
    keys = [torch.randn(shape, generator=g).to(dtype) for _ in range(spec.num_layers)]
    values = [torch.randn(shape, generator=g).to(dtype) for _ in range(spec.num_layers)]
    scores = np.random.default_rng(seed).random(len(old)).astype(np.float32)
    mixed = build_mixed(keys, values, scores, block_size=eng.settings.block_size, policy=eng.settings.precision_policy)
    if torch.cuda.is_available():
        keys, values = [k.pin_memory() for k in keys], [v.pin_memory() for v in values]
    return Checkpoint(token_ids=old, keys=keys, values=values, fingerprint=spec.fingerprint, scores=scores,
                      mixed=mixed, words=eng.words(old) if eng.words is not None else None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def _memcpy_s(nbytes: int, device: torch.device, repeats: int, *, fresh: bool = False) -> float:
    """Median seconds of a plain ``copy_`` of ``nbytes`` (fp32) on ``device`` (host to device on CUDA), into
    one warm destination, or (``fresh``) into a newly allocated one each time as a restore writes."""
    n = max(1, nbytes // 4)
    dst = torch.empty(n, dtype=torch.float32, device=device)
    src = torch.ones(n, dtype=torch.float32)
    src = src.pin_memory() if device.type == "cuda" else src
    ts = []
    for _ in range(repeats + 1):
        if fresh:
            ts.append(_timed(lambda: torch.empty(n, dtype=torch.float32, device=device).copy_(src, non_blocking=True),
                             device)[0])
        else:
            ts.append(_timed(lambda: dst.copy_(src, non_blocking=True), device)[0])
    return statistics.median(ts[1:])


def run_host_bench(eng, *, lengths=DEFAULT_LENGTHS, edits=DEFAULT_EDITS, repeats: int = 5, seed: int = 0,
                   progress: bool = True) -> dict[str, Any]:
    """Time the resume path's host stages per (context length, edit count).

    Args:
        eng: a :class:`PatchKVEngine` (its model's shapes, device and word index are used; no forward runs).
        lengths: context lengths in tokens (each below the model's maximum positions).
        edits: edit counts (each replaces 10 tokens by 20).
        repeats: timed repetitions per configuration (medians are reported), ``>= 1``.
        seed: RNG seed of ids, K/V and scores.
        progress: show a progress bar.

    Returns:
        ``{"device", "model", "rows": [...], "targets_ms", "notes"}``; each row has the configuration,
        ``<stage>_ms`` medians, ``host_ms``, ``kv_copy_ms`` / ``kv_copy_fp_ms``, ``kv_bytes``, the copy
        bandwidths and ``memcpy_gbps`` of the same bytes, ``restore_kernel`` and ``reader_scan`` (the plan's
        reader scan: ``native`` or ``numpy``).

    Raises:
        ValueError: ``repeats < 1``, or a length beyond the model's maximum positions.
    """
    from patchkv_agent.core.recovery import RecoveryBuffers
    from patchkv_agent.kernels import native
    from patchkv_agent.strategies import get_strategy

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    maxpos = eng.spec.max_positions
    for n in lengths:
        if maxpos is not None and n + 20 * max(edits) > maxpos:
            raise ValueError(f"length {n} (plus edits) exceeds the model's {maxpos} positions")
    device = eng.device
    strat = get_strategy("patchkv", {"readers": "lexical"})
    vocab = int(eng.spec.vocab_size or 4096)
    rows = []
    bar = tqdm(total=len(lengths) * len(edits), desc="bench-host", disable=not progress, file=sys.stderr)
    for n in lengths:
        for n_edits in edits:
            old, new = _versions(n, n_edits, vocab, seed + n + n_edits)
            ckpt = _checkpoint(eng, old, seed)
            new_list = new.tolist()
            times: dict[str, list[float]] = {k: [] for k in (*STAGES, "validate_list", "kv_copy", "kv_copy_fp",
                                                                 "kv_copy_fp_warm")}
            info: dict[str, Any] = {}
            for _ in range(repeats):
                from patchkv_agent.core.diff import diff_versions

                t, ids = _timed(lambda: eng.validate_ids(new, "new_token_ids"), device)
                times["validate"].append(t)
                times["validate_list"].append(_timed(lambda: eng.validate_ids(new_list, "new_token_ids"), device)[0])
                t, edit = _timed(lambda: diff_versions(ckpt.token_ids, ids, words=eng.words, old_words=ckpt.words),
                                 device)
                times["diff"].append(t)
                times["words"].append(_timed(edit.new_words, device)[0])
                t, plan = _timed(lambda: strat.plan(eng.settings, ckpt, edit), device)
                times["plan"].append(t)
                ids_t = torch.from_numpy(ids)
                t, buf = _timed(lambda: RecoveryBuffers(eng.runner, eng.spec, ids_t, plan), device)
                times["bookkeeping"].append(t)
                times["kv_copy"].append(_timed(lambda: buf.restore(ckpt.keys, ckpt.values, ckpt.mixed), device)[0])
                buf_fp = RecoveryBuffers(eng.runner, eng.spec, ids_t, plan)
                times["kv_copy_fp"].append(_timed(lambda: buf_fp.restore(ckpt.keys, ckpt.values, None), device)[0])
                times["kv_copy_fp_warm"].append(
                    _timed(lambda: buf_fp.restore(ckpt.keys, ckpt.values, None), device)[0])
                times["cache"].append(_timed(lambda: eng.runner.dynamic_cache(buf.keys, buf.values), device)[0])
                info = {"restore_tokens": int(plan.n_restore), "recompute_tokens": int(plan.n_recompute),
                        "prefix_tokens": int(plan.prefix_len), "restore_kernel": buf.kernel,
                        "reader_scan": "native" if native.ready() else "numpy",
                        "payload_bytes": int(buf.payload_bytes)}
            med = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}
            spec = eng.spec
            row_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * buf.keys[0].element_size()
            kv_bytes = (info["prefix_tokens"] + info["restore_tokens"]) * row_bytes  # destination bytes written
            mem_s = _memcpy_s(kv_bytes, device, repeats)
            fresh_s = _memcpy_s(kv_bytes, device, repeats, fresh=True)
            row = {"tokens": int(len(new)), "edits": n_edits, **info, **med,
                   "host_ms": sum(med[f"{k}_ms"] for k in STAGES),
                   "kv_bytes": int(kv_bytes), "memcpy_ms": mem_s * 1e3,
                   "kv_copy_gbps": kv_bytes / max(med["kv_copy_ms"] / 1e3, 1e-12) / 1e9,
                   "kv_copy_fp_gbps": kv_bytes / max(med["kv_copy_fp_ms"] / 1e3, 1e-12) / 1e9,
                   "memcpy_gbps": kv_bytes / max(mem_s, 1e-12) / 1e9,
                   "memcpy_fresh_ms": fresh_s * 1e3, "memcpy_fresh_gbps": kv_bytes / max(fresh_s, 1e-12) / 1e9}
            row["kv_copy_fp_vs_memcpy"] = row["kv_copy_fp_gbps"] / max(row["memcpy_gbps"], 1e-12)
            row["kv_copy_fp_warm_gbps"] = kv_bytes / max(med["kv_copy_fp_warm_ms"] / 1e3, 1e-12) / 1e9
            row["kv_copy_fp_warm_vs_memcpy"] = row["kv_copy_fp_warm_gbps"] / max(row["memcpy_gbps"], 1e-12)
            row["kv_copy_vs_memcpy"] = row["kv_copy_gbps"] / max(row["memcpy_gbps"], 1e-12)
            row["kv_copy_fp_vs_fresh_memcpy"] = row["kv_copy_fp_gbps"] / max(row["memcpy_fresh_gbps"], 1e-12)
            rows.append(row)
            bar.update(1)
    bar.close()
    spec = eng.spec
    return {"device": str(device), "model": eng.source or "tiny-llama-1layer",
            "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "dtype": str(next(eng.model.parameters()).dtype).removeprefix("torch."),
            "random_weights": is_random(eng.source),
            "torch_threads": torch.get_num_threads(), "repeats": repeats, "rows": rows,
            "targets_ms": {str(k): v for k, v in TARGETS_MS.items()},
            "notes": "host_ms = validate (int64 array input) + diff + words + plan + bookkeeping + cache; the forward "
                     "and the KV copy are outside it. kv_copy: restore from the mixed-precision runs "
                     "(dequantize + RoPE shift); kv_copy_fp: from the full-precision rows; memcpy: a plain "
                     "copy_ of the same destination bytes into a warm buffer (memcpy) and into a newly allocated one "
                     "(memcpy_fresh: page faults included, as the restore's fresh destination pays them)."}


_TEXT_WORDS = ("the", "agent", "called", "search", "with", "query", "and", "got", "results", "for", "Sofia",
               "Bulgaria", "population", "1,236,047", "in", "2021", "def", "return", "x", "+", "1", "{", "}",
               "\"id\":", "\"name\":", "error:", "FileNotFoundError", "/src/app/main.py", "line", "42", "ok.",
               "Then", "it", "read", "the", "file", "naïve", "café", "—", "tests", "passed", "\n", "\t")


def _conversation(tokenizer, n_tokens: int, seed: int) -> list[dict]:
    """A deterministic agent conversation of about ``n_tokens`` tokens: a task, then assistant / tool turns."""
    rng = np.random.default_rng(seed)
    msgs = [{"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Fix the failing test in the repository."}]
    total = 0
    while total < n_tokens:
        k = len(msgs)
        words = rng.choice(_TEXT_WORDS, size=40 if k % 2 == 0 else 160)
        content = " ".join(words)
        msgs.append({"role": "assistant" if k % 2 == 0 else "user", "content": content})
        total += len(tokenizer(content, add_special_tokens=False)["input_ids"]) + 5
    return msgs


def run_tokenize_bench(tokenizer, *, lengths=DEFAULT_LENGTHS, repeats: int = 5, seed: int = 0,
                       progress: bool = True) -> list[dict[str, Any]]:
    """Text-side host time of a resume: chat-template rendering and tokenization, whole and memoized.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        lengths: context lengths in tokens (approximate: whole messages).
        repeats: timed repetitions (medians), ``>= 1``.
        seed: the conversation's seed.
        progress: show a progress bar.

    Returns:
        One row per length: ``tokens``, ``template_ms``, ``tokenize_whole_ms``, ``tokenize_memo_ms``, the
        memo's ``memo`` (``reason`` it is off, or None) and ``same_ids`` (the memo's ids equal the whole
        text's).

    Raises:
        ValueError: ``repeats < 1``.
    """
    from patchkv_agent.core.encoding import SegmentEncoder

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rows = []
    for n in tqdm(lengths, desc="bench-host tokenize", disable=not progress, file=sys.stderr):
        old = _conversation(tokenizer, n, seed)
        new = [dict(m) for m in old]
        new[2 * len(new) // 3 | 1]["content"] = "[cleared]"  # one tool result cleared, one appended
        new.append({"role": "user", "content": " ".join(_TEXT_WORDS[:30])})

        def render(msgs):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

        t_old, t_new = render(old), render(new)
        whole = tokenizer(t_new, add_special_tokens=False)["input_ids"]
        times: dict[str, list[float]] = {"template": [], "tokenize_whole": [], "tokenize_memo": []}
        same, reason = True, None
        for _ in range(repeats):
            times["template"].append(_timed(lambda: render(new), torch.device("cpu"))[0])
            times["tokenize_whole"].append(
                _timed(lambda: tokenizer(t_new, add_special_tokens=False), torch.device("cpu"))[0])
            enc = SegmentEncoder(tokenizer)
            reason = enc.reason
            enc.encode(t_old)  # the previous call's version
            t, got = _timed(lambda: enc.encode(t_new), torch.device("cpu"))
            times["tokenize_memo"].append(t)
            same = same and got.tolist() == whole
        rows.append({"tokens": len(whole), **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
                     "memo": reason, "same_ids": bool(same)})
    return rows


def format_tokenize(rows: list[dict[str, Any]]) -> str:
    """The tokenization rows as an aligned text table."""
    lines = [["tokens", "template", "tokenize_whole", "tokenize_memo", "whole/memo", "same_ids"]]
    for r in rows:
        lines.append([str(r["tokens"]), f"{r['template_ms']:.2f}", f"{r['tokenize_whole_ms']:.2f}",
                      f"{r['tokenize_memo_ms']:.2f}", f"{r['tokenize_whole_ms'] / max(r['tokenize_memo_ms'], 1e-9):.0f}x",
                      str(r["same_ids"])])
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines)


def format_host(summary: dict[str, Any]) -> str:
    """The rows as an aligned text table."""
    head = ["tokens", "edits", "validate", "val_list", "diff", "words", "plan", "bookkeep", "cache", "host_ms",
            "kv_copy", "kv_fp", "kv_fp_warm", "memcpy", "fresh", "fp/memcpy", "fp/fresh", "warm/memcpy"]
    lines = [head]
    for r in summary["rows"]:
        lines.append([str(r["tokens"]), str(r["edits"])] + [f"{r[k]:.2f}" for k in (
            "validate_ms", "validate_list_ms", "diff_ms", "words_ms", "plan_ms", "bookkeeping_ms", "cache_ms",
            "host_ms", "kv_copy_ms", "kv_copy_fp_ms", "kv_copy_fp_warm_ms", "memcpy_ms", "memcpy_fresh_ms")] + [
            f"{r['kv_copy_fp_vs_memcpy']:.2f}", f"{r['kv_copy_fp_vs_fresh_memcpy']:.2f}",
            f"{r['kv_copy_fp_warm_vs_memcpy']:.2f}"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines)


def plot_host(summary: dict[str, Any], path: str | Path) -> None:
    """Host time (outside forward and KV copy) against context length, one line per edit count, with the
    targets (``TARGETS_MS``); and the KV copy's bandwidth against memcpy's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for e in sorted({r["edits"] for r in summary["rows"]}):
        rs = [r for r in summary["rows"] if r["edits"] == e]
        ax.plot([r["tokens"] for r in rs], [r["host_ms"] for r in rs], "o-", label=f"{e} edit(s)")
    tg = sorted((int(k), v) for k, v in summary["targets_ms"].items())
    ax.plot([k for k, _ in tg], [v for _, v in tg], "k--", label="target (1 edit)")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="host ms (outside forward, KV copy)",
           title=f"host time per resume ({summary['device']})")
    ax.legend()
    rs = [r for r in summary["rows"] if r["edits"] == min(r["edits"] for r in summary["rows"])]
    x = [r["tokens"] for r in rs]
    bx.plot(x, [r["memcpy_gbps"] for r in rs], "k--", label="memcpy, same bytes")
    bx.plot(x, [r["memcpy_fresh_gbps"] for r in rs], "k:", label="memcpy into a fresh buffer")
    bx.plot(x, [r["kv_copy_fp_gbps"] for r in rs], "o-", label="KV restore, full precision")
    bx.plot(x, [r["kv_copy_fp_warm_gbps"] for r in rs], "^-", label="KV restore, full precision, warm destination")
    bx.plot(x, [r["kv_copy_gbps"] for r in rs], "s-", label="KV restore, mixed runs")
    bx.set(xscale="log", xlabel="context tokens", ylabel="GB/s (destination bytes)", title="KV copy bandwidth")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers >= 1, got {text!r}")
    return vals


def add_cli(sub) -> None:
    """Register ``bench-host`` on the ``patchkv-agent`` subcommands (argument errors exit 2)."""
    p = sub.add_parser("bench-host", help="host time of the resume path per stage (validate, diff, words, plan, "
                                          "bookkeeping, cache, KV copy) at 2k-128k tokens; JSON + plot")
    p.add_argument("--lengths", type=lambda t: _int_list(t, "--lengths"), default=DEFAULT_LENGTHS,
                   help="context lengths (default 2048,8192,32768,131072)")
    p.add_argument("--edits", type=lambda t: _int_list(t, "--edits"), default=DEFAULT_EDITS,
                   help="edit counts (default 1,4,16)")
    p.add_argument("--repeats", type=int, default=5)  # --repeats / --threads >= 1: usage.RANGES
    p.add_argument("--model", default=None,
                   help="use this model's KV shapes and dtype (HF id, dir, .gguf, 'smollm2-135m' or random:SHAPE[@DTYPE]; "
                        "default: a one-layer llama from a config)")
    p.add_argument("--tokenizer", default=None,
                   help="also time chat-template rendering and tokenization (whole vs the engine's memo) with this "
                        "model's tokenizer (HF id, dir, .gguf or 'smollm2-135m'; default: --model's, if given)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_host_out")
    p.set_defaults(func=main)


def bench_plan(n_tokens: int = 10000, repeats: int = 50, *, n_spans: int = 3, seed: int = 0) -> dict[str, float]:
    """Median wall time of :func:`plan_repair` (the diff is not timed) on a synthetic context.

    Args:
        n_tokens: context length.
        repeats: timed calls.
        n_spans: edited spans (each replaces 64 tokens by 96).
        seed: RNG seed for scores.
    Returns:
        ``{"n_tokens", "n_spans", "median_ms", "min_ms", "n_recompute"}``.
    """
    from patchkv_agent.core.diff import diff_versions
    from patchkv_agent.core.plan import DEFAULT_BLOCK_SIZE, LengthModel, plan_repair
    from patchkv_agent.core.settings import RecoverySettings

    rng = np.random.default_rng(seed)
    old = np.arange(n_tokens, dtype=np.int64) + 1000
    new, cut, marker = [], 0, 10 * n_tokens
    for k in range(n_spans):
        start = (k + 1) * n_tokens // (n_spans + 1)
        new.append(old[cut:start])
        new.append(np.arange(marker, marker + 96, dtype=np.int64))
        marker += 96
        cut = start + 64
    new.append(old[cut:])
    edit = diff_versions(old, np.concatenate(new))
    scores = rng.random(n_tokens).astype(np.float32)
    model = LengthModel(weights=(1.0, 0.1, 0.2, 0.1, 0.0, 0.0, 0.0), d_min=16)
    settings = RecoverySettings(length_model=model, kappa=0.05, block_size=DEFAULT_BLOCK_SIZE, readers="none")
    times = []
    plan = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_repair(edit, scores, settings)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"n_tokens": float(n_tokens), "n_spans": float(n_spans), "median_ms": float(np.median(times)),
            "min_ms": float(np.min(times)), "n_recompute": float(plan.n_recompute if plan else 0)}


def main(args) -> int:
    """Run ``bench-host`` from parsed arguments; writes ``host.json`` and ``host.png`` under ``--out-dir``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        print(f"patchkv-agent bench-host: error: --device {device!r}: expected 'cpu' or 'cuda' (with a GPU)",
              file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"patchkv-agent bench-host: error: cannot create {out}: {e}", file=sys.stderr)
        return 2
    if args.model:
        from patchkv_agent.core.lexicon import WordIndex
        from patchkv_agent.engine import PatchKVEngine

        eng = PatchKVEngine.from_pretrained(args.model, device=device, profile=None)
        if eng.words is None:
            eng.words = WordIndex(_piece)
    else:
        eng = host_engine(device=device, max_positions=max(args.lengths) + 20 * max(args.edits) + 1024)
    summary = run_host_bench(eng, lengths=args.lengths, edits=args.edits, repeats=args.repeats, seed=args.seed)
    tokenizer = eng.tokenizer
    if args.tokenizer:
        from patchkv_agent.loading import load_model

        tokenizer = load_model(args.tokenizer)[1]
    if tokenizer is not None:
        summary["tokenize"] = run_tokenize_bench(tokenizer, lengths=args.lengths, repeats=args.repeats,
                                                 seed=args.seed)
    (out / "host.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_host(summary, out / "host.png")
    print(format_host(summary))
    if summary.get("tokenize"):
        print(format_tokenize(summary["tokenize"]))
    print(f"wrote {out / 'host.json'}, {out / 'host.png'}", file=sys.stderr)
    return 0
