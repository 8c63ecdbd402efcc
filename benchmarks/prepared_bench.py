"""The agent loop with the tool-wait preparation: what each model call waits for when the next call's
context is prepared while the tools run, against today's resume, a prefix cache and the no-edit floor.

For every agent episode (:class:`~patchkv_agent.eval.agent_workloads.AgentLoopEpisode`) one
:class:`~patchkv_agent.runtime.threads.ThreadRegistry` runs the episode's calls in four threads forked from
one exact prefill of the first version; per call ``k >= 1`` (the call's tools take ``L`` seconds, from a
:class:`ToolLatency` model over the tools the previous response called):

- ``prepared``: the registry's ``prepare_async`` with a predictor that runs the workload's own LangChain
  middleware on the state, the response and placeholder tool results (:meth:`ToolWait.predict
  <patchkv_agent.eval.agent_workloads.ToolWait.predict>`; it never reads version ``k``), then
  ``offload_async`` (what ``PatchKVMiddleware`` does), the tool sleep, and the call resumed with ``patchkv``;
- ``patchkv``: today's loop: ``offload_async``, the tool sleep, the call resumed with ``patchkv``;
- ``prefix``: the call resumed with ``prefix`` from the previous context (a prefix cache; exact, so its
  greedy continuation is the reference of the next action unless ``exact_reference``);
- ``floor``: the no-edit floor: the version's ``unedited`` twin (the same call had the context not been
  edited) resumed with ``prefix`` from a fork of the ``prefix`` thread's previous context.

Each row records the caller's wait for the first token (``e2e_*_s``, :meth:`ThreadRegistry.stream` until
the first logits exist) and the engine's resume TTFT (``ttft_*_s``) of every thread, the next action of
``prepared`` and ``patchkv`` against the reference (:func:`~patchkv_agent.eval.metrics.next_action_agree`:
the greedy continuation up to its first tool call, or ``max_new_tokens``), and the preparation's outcome
from the registry's stats (``prepared``: hit / partial / miss / unfinished / failed, ``prepared_reason``,
``prepared_tokens``, ``prepared_wasted``, ``prepared_hidden_share``) with whether the prediction itself
was right (``prediction_correct``: the call's ids start with the predicted ones) and how long it took.
With ``cover=True`` a tool lasts at least until its thread's background work (preparation, offload) is
over: the figures of a tool slow enough to hide the preparation, whatever the machine.

:func:`summarize_prepared`, :func:`markdown_prepared` and :func:`plot_prepared` are pure (rows in).

Boundary: the registry's public methods, the agent loop episodes and the metrics; LangChain only through
:class:`~patchkv_agent.eval.agent_workloads.ToolWait`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from patchkv_agent.runtime.threads import ThreadRegistry, thread_key
from .bench import _mean  # the summaries' shared aggregates (None-skipping)
from .loop_bench import _median
from patchkv_agent.eval.metrics import NEXT_ACTION_TOKENS, next_action_agree
from patchkv_agent.eval.traces import call_kind, plain_messages, version_ids

__all__ = ["ToolLatency", "prepared_loop_episode", "run_prepared_bench", "summarize_prepared", "markdown_prepared",
           "plot_prepared", "write_prepared", "TARGETS", "call_kind"]

TARGETS = {  # targets of the tool-wait preparation (reported beside the figures, never asserted)
    "hit_vs_floor": 1.15,     # median e2e TTFT of a hit over the no-edit floor's, at most
    "hit_rate": 0.95,         # hits among the calls of ClearToolUsesEdit / SummarizationMiddleware workloads
    "miss_vs_patchkv": 1.05,  # a call that is not a hit over today's resume of the same call, at most
    "prefix_over_hit": 3.0,   # prefix's e2e TTFT over a hit's, at least (at 8k tokens)
    "outcome_vs_prefix": 1.0,  # any outcome's worst call over prefix's, at most (plus one preparation chunk)
}
_FILES = ("loop_prepared.json", "loop_prepared.md", "loop_prepared.png")


# ------------------------------------------------------------------------------------------ tool latency

@dataclass(frozen=True)
class ToolLatency:
    """How long a call's tools run: a fixed number of seconds, or seconds per tool name.

    Tools called together run in parallel: the wait is the longest of theirs. A tool not named takes
    ``default`` seconds.

    Attributes:
        default: seconds of a tool not named in ``per_tool`` (and of a step without tool calls).
        per_tool: ``(name, seconds)`` pairs.
    """

    default: float = 0.0
    per_tool: tuple[tuple[str, float], ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, spec: str) -> "ToolLatency":
        """``"2"`` (every tool 2 s), ``"search=1.5,bash=4"`` (per tool; others 0 s) or
        ``"search=1.5,*=2"`` (others 2 s).

        Args:
            spec: the text of ``--tool-latency``.

        Returns:
            The model.

        Raises:
            ValueError: an empty or malformed spec, a duplicate name, or seconds that are negative or not
                finite.
        """
        parts = [p.strip() for p in str(spec).split(",") if p.strip()]
        if not parts:
            raise ValueError(f"a tool latency is seconds or name=seconds pairs, got {spec!r}")
        default, per, seen = 0.0, [], set()
        for p in parts:
            name, eq, val = p.rpartition("=")
            name = name.strip() if eq else "*"
            try:
                sec = float(val)
            except ValueError:
                raise ValueError(f"tool latency {p!r}: expected seconds (e.g. 2 or search=1.5)") from None
            if not math.isfinite(sec) or sec < 0:
                raise ValueError(f"tool latency {p!r}: seconds must be finite and >= 0")
            if not name or name in seen:
                raise ValueError(f"tool latency {p!r}: " + ("an empty tool name" if not name else f"{name} given twice"))
            seen.add(name)
            if name == "*":
                default = sec
            else:
                per.append((name, sec))
        return cls(default=default, per_tool=tuple(per))

    def seconds(self, tools: Sequence[str]) -> float:
        """The wait for ``tools`` called together (the longest; ``default`` for none)."""
        per = dict(self.per_tool)
        return max((per.get(t, self.default) for t in tools), default=self.default)

    def __str__(self) -> str:
        items = [f"{n}={s:g}" for n, s in self.per_tool]
        if self.default or not items:
            items.append(f"{self.default:g}" if not items else f"*={self.default:g}")
        return ",".join(items)


# ------------------------------------------------------------------------------------------ running

def _decode(engine, stream, max_new_tokens: int) -> tuple[list[int], str]:
    """Drain ``stream`` greedily up to the end of its first tool call (the next action is decided there)
    or ``max_new_tokens``; returns its ids and text."""
    from patchkv_agent.langgraph.tools import TOOL_CALL_CLOSE
    from patchkv_agent.runtime.stream import run_stream

    tok = getattr(engine, "tokenizer", None)

    def done(_t: int) -> bool:
        if tok is None:
            return False
        return TOOL_CALL_CLOSE in tok.decode(stream.result.output_ids, skip_special_tokens=True)

    res = run_stream(stream, done)
    out = list(res.output_ids)[:max_new_tokens]
    text = tok.decode(out, skip_special_tokens=True) if tok is not None else ""
    return out, text


def _call(reg: ThreadRegistry, key, ids, strategy: str, max_new_tokens: int, engine) -> dict[str, Any]:
    t0 = time.perf_counter()
    stream = reg.stream(key, ids, strategy=strategy, max_new_tokens=max_new_tokens)
    e2e = time.perf_counter() - t0  # stream() returns once the first token's logits exist
    out, text = _decode(engine, stream, max_new_tokens) if max_new_tokens else ([], "")
    if not max_new_tokens:
        stream.close()
    return {"e2e": e2e, "stats": stream.stats.to_json(arrays=False), "logits": stream.result.logits, "out": out,
            "text": text}


def _agree(a: dict, ref: dict, engine) -> bool:
    if getattr(engine, "tokenizer", None) is None:
        return a["out"] == ref["out"]
    return bool(next_action_agree(a["text"], ref["text"]))


def _diff(a, b) -> float | None:
    if a is None or b is None:
        return None
    return float((a.float() - b.float()).abs().max())


def _last_event(reg: ThreadRegistry, event: str, thread_id: str) -> dict | None:
    for e in reversed(list(reg.events)):
        if e.get("event") == event and tuple(e.get("key") or ())[:1] == (thread_id,):
            return e
    return None


def prepared_loop_episode(engine, episode, latency: ToolLatency, *, cover: bool = False,
                          max_new_tokens: int = NEXT_ACTION_TOKENS, chunk_tokens: int | None = None,
                          exact_reference: bool = False, model_name: str = "",
                          on_call: Callable[[dict], None] | None = None) -> list[dict[str, Any]]:
    """One agent episode through the four threads of the module docstring.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine` with a tokenizer (the versions are messages).
        episode: an :class:`~patchkv_agent.eval.agent_workloads.AgentLoopEpisode`.
        latency: the tools' latency model.
        cover: each tool lasts at least until its thread's background work is over
            (:meth:`~ThreadRegistry.wait_prepared`, :meth:`~ThreadRegistry.wait`).
        max_new_tokens: greedy tokens per call at most (decoding stops after the first tool call).
        chunk_tokens: rows per background forward of a preparation (None: the registry's default).
        exact_reference: the next action's reference is a full prefill of each version (else the ``prefix``
            thread's continuation, which is exact).
        model_name: the rows' ``model`` field.
        on_call: called with each row as it is finished.

    Returns:
        One row per call after the first (see the module docstring for the fields).

    Raises:
        ValueError: an episode with fewer than two versions or without a wait per call, or a version the
            engine refuses (e.g. longer than the model's window).
    """
    trace = episode.trace
    versions = trace.get("versions") or []
    if len(versions) < 2 or len(episode.waits) != len(versions) - 1:
        raise ValueError(f"episode {trace.get('id')!r} needs two or more versions and a tool wait per call")

    def render(msgs):
        return engine.encode_array(plain_messages(msgs))

    ids = [np.asarray(version_ids(engine, v), dtype=np.int64) for v in versions]
    unedited = [np.asarray(version_ids(engine, v["unedited"]), dtype=np.int64)
                if isinstance(v.get("unedited"), dict) else None for v in versions]
    for a in ids + [u for u in unedited if u is not None]:
        engine.validate_ids(a)  # a version longer than the window is refused before any work
    ep = str(trace.get("id"))
    reg = ThreadRegistry(engine, resident_budget_bytes=1 << 40, **({"prepare_chunk_tokens": chunk_tokens}
                                                                  if chunk_tokens else {}))
    keys = {name: thread_key(f"{ep}#{name}") for name in ("seed", "prepared", "patchkv", "prefix", "floor")}
    rows: list[dict[str, Any]] = []
    try:
        reg.generate(keys["seed"], ids[0], strategy="exact", max_new_tokens=0)
        for name in ("prepared", "patchkv", "prefix"):
            reg.fork(keys["seed"], keys[name])
        reg.forget(keys["seed"][0])
        for k in range(1, len(ids)):
            wait = episode.waits[k - 1]
            lat = latency.seconds(wait.tools)
            row = _one_call(engine, reg, keys, wait, render, ids[k], unedited[k], lat, cover=cover,
                            max_new_tokens=max_new_tokens, exact_reference=exact_reference)
            row.update(id=ep, workload=trace.get("workload"), model=model_name, version=k,
                       edit=versions[k].get("edit"), kind=call_kind(versions[k].get("edit")),
                       depth=((trace.get("meta") or {}).get("depths") or [None] * len(ids))[k])
            rows.append(row)
            if on_call is not None:
                on_call(row)
    finally:
        reg.close()
    return rows


def _one_call(engine, reg, keys, wait, render, ids, unedited, lat, *, cover, max_new_tokens, exact_reference):
    held: dict[str, Any] = {}

    def predict():
        t = time.perf_counter()
        p = wait.predict(render)
        held["prediction"], held["predict_s"] = p, time.perf_counter() - t
        return p

    # prepared: predict + prepare, offload, the tool, the call
    t_tool = time.perf_counter()
    reg.prepare_async(keys["prepared"], predict)
    reg.offload_async(keys["prepared"])
    time.sleep(lat)
    if cover:
        reg.wait_prepared(keys["prepared"])
        reg.wait(keys["prepared"])
    tool_s = time.perf_counter() - t_tool
    phase = reg.phase(keys["prepared"]).value
    a = _call(reg, keys["prepared"], ids, "patchkv", max_new_tokens, engine)
    ev = _last_event(reg, "prepared", keys["prepared"][0])
    # patchkv without preparation (today's loop)
    reg.offload_async(keys["patchkv"])
    time.sleep(lat)
    if cover:
        reg.wait(keys["patchkv"])
    b = _call(reg, keys["patchkv"], ids, "patchkv", max_new_tokens, engine)
    # the no-edit floor from a fork of the prefix thread's previous context, then prefix itself
    floor = None
    if unedited is not None:
        reg.fork(reg.active(keys["prefix"]), keys["floor"])
        floor = _call(reg, keys["floor"], unedited, "prefix", 0, engine)
        reg.forget(keys["floor"][0])
    c = _call(reg, keys["prefix"], ids, "prefix", max_new_tokens, engine)
    ref = c
    if exact_reference:
        res = engine.resume(None, ids, strategy="exact", max_new_tokens=max_new_tokens)
        tok = getattr(engine, "tokenizer", None)
        out = list(res.output_ids)
        ref = {"logits": res.logits, "out": out, "text": tok.decode(out, skip_special_tokens=True) if tok else ""}
        ref = _cut_at_call(ref, engine)
    st = a["stats"]
    pred = held.get("prediction")
    pids = getattr(pred, "token_ids", None)
    correct = None if pids is None else bool(len(pids) <= len(ids) and np.array_equal(ids[: len(pids)], pids))
    e2e_floor = floor["e2e"] if floor else None
    row: dict[str, Any] = {
        "tools": list(wait.tools), "tool_latency_s": lat, "tool_s": tool_s, "prompt_tokens": int(len(ids)),
        "phase_at_call": phase, "prepared": st.get("prepared"), "prepared_reason": st.get("prepared_reason"),
        "prepared_tokens": st.get("prepared_tokens"), "prepared_wasted": st.get("prepared_wasted"),
        "prepared_hidden_share": st.get("prepared_hidden_share"), "prepared_info": st.get("prepared_info"),
        "predicted_tokens": None if pids is None else int(len(pids)), "prediction_correct": correct,
        "prediction_reason": getattr(pred, "reason", None), "predict_s": held.get("predict_s"),
        "prepare_s": ev.get("prepare_s") if ev else None,
        "e2e_prepared_s": a["e2e"], "ttft_prepared_s": st.get("ttft_s"), "base_prepared": st.get("base"),
        "recompute_prepared": st.get("recompute_tokens"),
        "e2e_patchkv_s": b["e2e"], "ttft_patchkv_s": b["stats"].get("ttft_s"), "base_patchkv": b["stats"].get("base"),
        "recompute_patchkv": b["stats"].get("recompute_tokens"), "restore_patchkv": b["stats"].get("restore_tokens"),
        "e2e_prefix_s": c["e2e"], "ttft_prefix_s": c["stats"].get("ttft_s"), "recompute_prefix":
            c["stats"].get("recompute_tokens"),
        "e2e_floor_s": e2e_floor, "ttft_floor_s": floor["stats"].get("ttft_s") if floor else None,
        "reference": "exact" if exact_reference else "prefix",
        "next_action_prepared": _agree(a, ref, engine), "next_action_patchkv": _agree(b, ref, engine),
        "first_token_diff_prepared": _diff(a["logits"], ref["logits"]),
        "first_token_diff_patchkv": _diff(b["logits"], ref["logits"]),
        "output_prepared": a["text"], "output_patchkv": b["text"], "output_reference": ref["text"],
        "vs_floor": a["e2e"] / e2e_floor if e2e_floor else None,
        "vs_prefix": a["e2e"] / c["e2e"] if c["e2e"] else None,
        "vs_patchkv": a["e2e"] / b["e2e"] if b["e2e"] else None,
        "patchkv_vs_floor": b["e2e"] / e2e_floor if e2e_floor else None,
        "prefix_vs_floor": c["e2e"] / e2e_floor if e2e_floor else None,
    }
    return row


def _cut_at_call(ref: dict, engine) -> dict:
    """An exact reference decoded to ``max_new_tokens``, cut as :func:`_decode` cuts (after the first call)."""
    from patchkv_agent.langgraph.tools import TOOL_CALL_CLOSE

    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        return ref
    for n in range(1, len(ref["out"]) + 1):
        text = tok.decode(ref["out"][:n], skip_special_tokens=True)
        if TOOL_CALL_CLOSE in text:
            return dict(ref, out=ref["out"][:n], text=text)
    return ref


def _warm_up(engine, episode, chunk_tokens: int | None) -> None:
    """One short loop (a few hundred tokens of the first version) so first calls do not pay one-off costs."""
    ids = np.asarray(version_ids(engine, episode.trace["versions"][0]), dtype=np.int64)
    n = min(len(ids), 256)
    if n < 8:
        return
    reg = ThreadRegistry(engine, **({"prepare_chunk_tokens": chunk_tokens} if chunk_tokens else {}))
    try:
        key = thread_key("warm-up")
        reg.generate(key, ids[: n // 2], strategy="exact", max_new_tokens=1)
        reg.prepare_async(key, lambda: ids[: 3 * n // 4])
        reg.wait_prepared(key)
        reg.generate(key, ids[:n], strategy="patchkv", max_new_tokens=2)
        reg.generate(key, np.concatenate([ids[: n // 4], ids[n // 4 + 2: n]]), strategy="patchkv", max_new_tokens=1)
    finally:
        reg.close()


def run_prepared_bench(engine, episodes: Sequence, latency: ToolLatency, *, cover: bool = False,
                       max_new_tokens: int = NEXT_ACTION_TOKENS, chunk_tokens: int | None = None,
                       exact_reference: bool = False, model_name: str = "", progress: bool = True,
                       warmup: bool = True) -> dict[str, Any]:
    """:func:`prepared_loop_episode` over ``episodes``, then :func:`summarize_prepared`.

    Args:
        engine: the engine.
        episodes: :class:`~patchkv_agent.eval.agent_workloads.AgentLoopEpisode` objects.
        latency: the tools' latency model.
        cover, max_new_tokens, chunk_tokens, exact_reference, model_name: see :func:`prepared_loop_episode`.
        progress: a tqdm bar over the calls.
        warmup: run a short untimed loop first.

    Returns:
        The summary (:func:`summarize_prepared`) with ``rows``, ``errors`` (episodes refused with a
        ``ValueError``: ``{"id", "error"}``) and ``settings``.

    Raises:
        ValueError: no episodes.
    """
    from tqdm import tqdm

    if not episodes:
        raise ValueError("the prepared-loop benchmark needs at least one agent episode")
    if warmup:
        _warm_up(engine, episodes[0], chunk_tokens)
    rows: list[dict] = []
    errors: list[dict] = []
    total = sum(len(e.trace["versions"]) - 1 for e in episodes)
    bar = tqdm(total=total, desc="bench-loop (prepared)", unit="call", disable=not progress, file=sys.stderr)
    for e in episodes:
        bar.set_postfix_str(str(e.trace.get("id"))[:60])
        try:
            rows += prepared_loop_episode(engine, e, latency, cover=cover, max_new_tokens=max_new_tokens,
                                          chunk_tokens=chunk_tokens, exact_reference=exact_reference,
                                          model_name=model_name, on_call=lambda r: bar.update(1))
        except ValueError as err:
            errors.append({"id": e.trace.get("id"), "error": str(err)})
            bar.write(f"skipped {e.trace.get('id')}: {err}")
    bar.close()
    summary = summarize_prepared(rows)
    summary.update(rows=rows, errors=errors, settings={
        "tool_latency": str(latency), "cover": cover, "max_new_tokens": max_new_tokens,
        "chunk_tokens": chunk_tokens, "reference": "exact" if exact_reference else "prefix", "model": model_name})
    return summary


# ------------------------------------------------------------------------------------------ summary

def _group(rows: list[dict]) -> dict[str, Any]:
    hits = [r for r in rows if r.get("prepared") == "hit"]
    rest = [r for r in rows if r.get("prepared") != "hit"]
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[str(r.get("prepared"))] = outcomes.get(str(r.get("prepared")), 0) + 1
    correct = [r["prediction_correct"] for r in rows if r.get("prediction_correct") is not None]
    return {
        "calls": len(rows), "episodes": len({r.get("id") for r in rows}), "outcomes": outcomes,
        "hit_rate": len(hits) / len(rows) if rows else None,
        "prediction_correct_rate": (sum(correct) / len(rows)) if rows else None,
        "ttft_hit_s_median": _median(r["e2e_prepared_s"] for r in hits),
        "ttft_prepared_s_median": _median(r["e2e_prepared_s"] for r in rows),
        "ttft_not_hit_s_median": _median(r["e2e_prepared_s"] for r in rest),
        "ttft_floor_s_median": _median(r.get("e2e_floor_s") for r in rows),
        "ttft_prefix_s_median": _median(r["e2e_prefix_s"] for r in rows),
        "ttft_patchkv_s_median": _median(r["e2e_patchkv_s"] for r in rows),
        "hit_vs_floor": _median(r.get("vs_floor") for r in hits),
        "hit_vs_prefix": _median(r.get("vs_prefix") for r in hits),
        "prefix_over_hit": _median(1.0 / r["vs_prefix"] for r in hits if r.get("vs_prefix")),
        "prepared_vs_floor": _median(r.get("vs_floor") for r in rows),
        "prepared_vs_prefix": _median(r.get("vs_prefix") for r in rows),
        "patchkv_vs_floor": _median(r.get("patchkv_vs_floor") for r in rows),
        "prefix_vs_floor": _median(r.get("prefix_vs_floor") for r in rows),
        "miss_vs_patchkv": _median(r.get("vs_patchkv") for r in rest),
        "miss_vs_patchkv_max": max((r["vs_patchkv"] for r in rest if r.get("vs_patchkv")), default=None),
        "misses": len(rest),
        "next_action_prepared": _mean(r.get("next_action_prepared") for r in rows),
        "next_action_patchkv": _mean(r.get("next_action_patchkv") for r in rows),
        "hidden_share_mean": _mean(r.get("prepared_hidden_share") for r in rows),
        "prepared_tokens_mean": _mean(r.get("prepared_tokens") for r in rows),
        "prepared_wasted_mean": _mean(r.get("prepared_wasted") for r in rows),
        "prepare_s_median": _median(r.get("prepare_s") for r in rows),
        "tool_s_median": _median(r.get("tool_s") for r in rows),
        "prompt_tokens_median": _median(r.get("prompt_tokens") for r in rows),
        "by_outcome": {o: {"calls": len(rs), "vs_prefix_median": _median(r.get("vs_prefix") for r in rs),
                           "vs_prefix_max": max((r["vs_prefix"] for r in rs if r.get("vs_prefix")), default=None)}
                       for o in outcomes for rs in [[r for r in rows if str(r.get("prepared")) == o]]},
    }


def summarize_prepared(rows: Sequence[dict]) -> dict[str, Any]:
    """Per workload (and pooled, ``"all"``, with several) and per workload x call kind aggregates.

    Hit rate, the rate of correct predictions, medians of the e2e TTFT of hits, of the floor, prefix and
    ``patchkv`` threads, medians of the per-call ratios (a hit over the floor / prefix, a call that is not
    a hit over ``patchkv``'s resume of it), next-action agreement of ``prepared`` and ``patchkv``, the mean
    share of the recompute hidden in the tool wait, rows prepared and wasted.

    Args:
        rows: rows of :func:`prepared_loop_episode`.

    Returns:
        ``{"n_calls", "workloads", "by_workload": {w: group}, "by_kind": {w: {kind: group}}, "targets"}``.
    """
    rows = list(rows)
    workloads = list(dict.fromkeys(str(r.get("workload")) for r in rows))
    by = {w: _group([r for r in rows if str(r.get("workload")) == w]) for w in workloads}
    if len(workloads) > 1:
        by["all"] = _group(rows)
    kinds = {w: {k: _group([r for r in rows if str(r.get("workload")) == w and r.get("kind") == k])
                 for k in dict.fromkeys(r.get("kind") for r in rows if str(r.get("workload")) == w)}
             for w in workloads}
    return {"n_calls": len(rows), "workloads": workloads, "by_workload": by, "by_kind": kinds, "targets": dict(TARGETS)}


def _f(v, spec=".2f", unit="") -> str:
    return "-" if v is None else format(v, spec) + unit


def markdown_prepared(summary: dict[str, Any], command: str | None = None) -> str:
    """The Markdown summary: the command, one row per workload (and per call kind), the targets.

    Args:
        summary: :func:`run_prepared_bench`'s or :func:`summarize_prepared`'s output.
        command: the command line that produced it (shown first when given).

    Returns:
        Markdown text ending with a newline.
    """
    out = ["# Agent loop with the tool-wait preparation", ""]
    st = summary.get("settings") or {}
    if command:
        out += ["Command:", "", "```", command, "```", ""]
    if st:
        out += [f"Model {st.get('model') or '-'}; tool latency {st.get('tool_latency')}"
                + (" (each tool lasts until its thread's background work is over)" if st.get("cover") else "")
                + f"; next action against {st.get('reference')}; {summary.get('n_calls')} calls.", ""]
    head = ("| workload | kind | calls | hit rate | prediction right | TTFT hit ms | not hit ms | floor ms | prefix ms | "
            "patchkv ms | hit / floor | prefix / hit | not hit / patchkv | next action (prepared) | "
            "next action (patchkv) | hidden share | prepared rows | wasted rows | prepare s | tokens |")
    out += [head, "|---|---|" + "---:|" * 18]

    def line(w, k, g):
        return (f"| {w} | {k} | {g['calls']} | {_f(g['hit_rate'])} | {_f(g['prediction_correct_rate'])} | "
                f"{_f(_ms(g['ttft_hit_s_median']), '.0f')} | {_f(_ms(g['ttft_not_hit_s_median']), '.0f')} | "
                f"{_f(_ms(g['ttft_floor_s_median']), '.0f')} | "
                f"{_f(_ms(g['ttft_prefix_s_median']), '.0f')} | {_f(_ms(g['ttft_patchkv_s_median']), '.0f')} | "
                f"{_f(g['hit_vs_floor'])} | {_f(g['prefix_over_hit'], '.2f', 'x')} | "
                f"{_f(g['miss_vs_patchkv'])} ({g['misses']}) | {_f(g['next_action_prepared'])} | "
                f"{_f(g['next_action_patchkv'])} | {_f(g['hidden_share_mean'])} | {_f(g['prepared_tokens_mean'], '.0f')} | "
                f"{_f(g['prepared_wasted_mean'], '.0f')} | {_f(g['prepare_s_median'], '.1f')} | "
                f"{_f(g['prompt_tokens_median'], '.0f')} |")

    for w, g in summary["by_workload"].items():
        out.append(line(w, "all", g))
        for k, gk in (summary.get("by_kind") or {}).get(w, {}).items():
            out.append(line(w, k, gk))
    out += ["", "Outcomes: " + "; ".join(f"{w}: " + ", ".join(f"{k} {n}" for k, n in g["outcomes"].items())
                                        for w, g in summary["by_workload"].items()), ""]
    out += ["Every prepared outcome against prefix (a call that is not a hit costs at most prefix's time plus one "
            "chunk): per outcome, calls, median and worst e2e TTFT over prefix's:", "",
            "| workload | outcome | calls | / prefix (median) | / prefix (worst) |", "|---|---|---:|---:|---:|"]
    for w, g in summary["by_workload"].items():
        for o, go in g.get("by_outcome", {}).items():
            out.append(f"| {w} | {o} | {go['calls']} | {_f(go['vs_prefix_median'])} | {_f(go['vs_prefix_max'])} |")
    out.append("")
    t = summary.get("targets") or TARGETS
    out += ["Targets of the tool-wait preparation, medians per workload:", "",
            "| workload | hit / floor <= %.2f | hit rate >= %.2f | not hit / patchkv <= %.2f | prefix / hit >= %.1fx |"
            % (t["hit_vs_floor"], t["hit_rate"], t["miss_vs_patchkv"], t["prefix_over_hit"]), "|---|---:|---:|---:|---:|"]
    for w, g in summary["by_workload"].items():
        out.append(f"| {w} | {_mark(g['hit_vs_floor'], t['hit_vs_floor'], le=True)} | "
                   f"{_mark(g['hit_rate'], t['hit_rate'], le=False)} | "
                   f"{_mark(g['miss_vs_patchkv'], t['miss_vs_patchkv'], le=True)} | "
                   f"{_mark(g['prefix_over_hit'], t['prefix_over_hit'], le=False)} |")
    return "\n".join(out) + "\n"


def _ms(v):
    return None if v is None else v * 1e3


def _mark(v, target, le: bool) -> str:
    if v is None:
        return "-"
    ok = v <= target if le else v >= target
    return f"{v:.2f} ({'met' if ok else 'not met'})"


def plot_prepared(summary: dict[str, Any], path: str | Path | None = None):
    """Median e2e TTFT per call kind: a prepared hit, a prepared call that was not a hit, the no-edit floor,
    prefix, ``patchkv`` without the preparation (grouped bars, one group per workload x call kind; log scale).

    Args:
        summary: :func:`summarize_prepared`'s output.
        path: write the PNG there when given.

    Returns:
        The matplotlib ``Figure`` (built without pyplot).
    """
    from matplotlib.figure import Figure

    groups = [(w, k, g) for w, kinds in (summary.get("by_kind") or {}).items() for k, g in kinds.items()]
    fig = Figure(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.4), layout="constrained")
    ax = fig.subplots()
    series = (("prepared: hit", "ttft_hit_s_median", "C0", None),
              ("prepared: not a hit", "ttft_not_hit_s_median", "C0", "//"),
              ("no-edit floor", "ttft_floor_s_median", "C1", None), ("prefix", "ttft_prefix_s_median", "C2", None),
              ("patchkv without preparation", "ttft_patchkv_s_median", "C3", None))
    width = 0.8 / len(series)
    for j, (label, key, color, hatch) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [g.get(key) or 0.0 for _, _, g in groups]
        ax.bar(xs, ys, width=width, color="white" if hatch else color, edgecolor=color, hatch=hatch, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{w}\n{k} ({g['calls']} calls, hits {g['outcomes'].get('hit', 0)})" for w, k, g in groups],
                       fontsize=8)
    if any(g.get(key) for _, _, g in groups for _, key, _, _ in series):
        ax.set_yscale("log")
    ax.set_ylabel("median TTFT the caller waits (s)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    st = summary.get("settings") or {}
    cover = " (each tool lasting until its preparation is over)" if st.get("cover") else ""
    fig.suptitle(f"agent loop, tool latency {st.get('tool_latency', '?')}{cover}: TTFT per call kind")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def write_prepared(summary: dict[str, Any], out_dir: str | Path, command: str | None = None) -> list[str]:
    """Write ``loop_prepared.json`` (summary and rows), ``loop_prepared.md`` and ``loop_prepared.png``.

    Args:
        summary: :func:`run_prepared_bench`'s output.
        out_dir: the directory (created).
        command: the command line, recorded in both files.

    Returns:
        The paths written.

    Raises:
        OSError: a file cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md, png = (out / f for f in _FILES)
    js.write_text(json.dumps(dict(summary, command=command), indent=2, default=str) + "\n")
    md.write_text(markdown_prepared(summary, command))
    plot_prepared(summary, png)
    return [str(js), str(md), str(png)]
