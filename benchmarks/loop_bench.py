"""The agent-loop benchmark: what the caller waits for on each model call, tool latency included.

``bench`` times ``resume`` alone; an agent feels the loop *model call -> tool -> model call*. This module
drives a :class:`~patchkv_agent.runtime.threads.ThreadRegistry` as an agent does: ``generate`` the first
version (exact prefill), start the background offload (what ``PatchKVMiddleware`` does when the model asks
for tools), sleep for the tool's latency ``L``, then ``generate`` each edited version with the strategy
under test. For every model call after the first it records the *end-to-end TTFT*: wall time from the
call until its first token's logits exist (any offload wait, the base lookup, diff, plan, restore and
recompute), beside the resume-only ``ttft_s`` the engine reports and the offload wait.

:func:`run_loop_bench` runs every (strategy, L) over the episodes, one thread at a time, and optionally a
concurrent phase (``threads`` agent threads looping at once at one ``L``: throughput in model calls per
minute and p50 / p95 end-to-end TTFT). :func:`plot_loop` draws end-to-end TTFT against tool latency.

Knows the registry's public methods and the trace format; nothing about LangGraph.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from patchkv_agent.runtime.threads import ThreadRegistry, thread_key
from patchkv_agent.eval.traces import version_ids

__all__ = ["DEFAULT_TOOL_LATENCIES", "loop_episode", "run_loop_bench", "plot_loop", "format_loop"]

DEFAULT_TOOL_LATENCIES = (0.0, 0.1, 0.5, 1.5)


def loop_episode(registry: ThreadRegistry, key, versions: Sequence[np.ndarray], *, strategy: str, tool_s: float,
                 max_new_tokens: int = 8) -> list[dict[str, Any]]:
    """One agent thread through ``versions``: call, offload + tool sleep, call on the edited version, ...

    Args:
        registry: the registry (shared by concurrent threads, each with its own ``key``).
        key: the thread key.
        versions: token ids of each context version (the first is prefilled exactly).
        strategy: the strategy of the calls after the first.
        tool_s: seconds each tool call takes (the sleep between a call and the next version).
        max_new_tokens: tokens decoded per call.

    Returns:
        One row per call after the first: ``version``, ``e2e_ttft_s`` (the caller's wait for the first
        token), ``ttft_s`` (the engine's resume TTFT: restore + recompute), ``plan_s`` (its diff and plan),
        ``offload_wait_s``, ``base``, ``strategy`` (taken),
        ``recompute_tokens``, ``prompt_tokens``, ``fallback``.
    """
    rows = []
    registry.generate(key, versions[0], strategy="exact", max_new_tokens=max_new_tokens)
    for k in range(1, len(versions)):
        registry.offload_async(key)  # the model asked for a tool: offload while it runs
        if tool_s > 0:
            time.sleep(tool_s)
        t0 = time.perf_counter()
        stream = registry.stream(key, versions[k], strategy=strategy, max_new_tokens=max_new_tokens)
        e2e = time.perf_counter() - t0  # stream() returns once the first token's logits exist
        for _ in stream:
            pass
        st = stream.stats.to_json(arrays=False)
        fields = ("ttft_s", "plan_s", "offload_wait_s", "base", "strategy", "recompute_tokens", "prompt_tokens",
                  "fallback")
        rows.append({"version": k, "e2e_ttft_s": e2e, **{f: st.get(f) for f in fields}})
    return rows


def _median(xs):
    xs = [float(x) for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _pct(xs, q):
    xs = [float(x) for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def run_loop_bench(engine, traces: Sequence[dict], *, strategies: Sequence[str] = ("patchkv", "prefix"),
                   tool_latencies: Sequence[float] = DEFAULT_TOOL_LATENCIES, max_new_tokens: int = 8,
                   threads: int = 0, threads_tool_s: float = 0.1, progress: bool = True) -> dict[str, Any]:
    """The loop benchmark over ``traces`` (see the module docstring).

    Every (strategy, L) pass uses a fresh registry; strategies alternate within each L so that both see
    the same machine state. The first pass is repeated once untimed (warm-up).

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine`.
        traces: trace-format episodes (two or more versions each).
        strategies: strategies of the calls after the first.
        tool_latencies: tool seconds ``L`` to sweep, each ``>= 0``.
        max_new_tokens: tokens decoded per call.
        threads: agent threads of the concurrent phase (0: none).
        threads_tool_s: the tool latency of the concurrent phase.
        progress: show a tqdm bar.

    Returns:
        ``{"strategies", "tool_latencies", "rows": [...], "by": {strategy: {L: {"n", "e2e_ttft_s_median",
        "ttft_s_median", "resume_call_s_median" (plan + restore + recompute), "offload_wait_s_median",
        "e2e_over_resume", "e2e_over_resume_call", "speedup_vs_prefix"}}},
        "concurrent": {strategy: {"threads", "calls", "wall_s", "calls_per_min", "e2e_p50_s",
        "e2e_p95_s"}} | None}``.

    Raises:
        ValueError: no traces, a trace with fewer than two versions, a negative latency, or ``threads < 0``.
    """
    from tqdm import tqdm

    if not traces:
        raise ValueError("the loop benchmark needs at least one episode")
    if any(float(x) < 0 for x in tool_latencies) or threads < 0 or threads_tool_s < 0:
        raise ValueError("tool latencies and threads must be >= 0")
    episodes = []
    for tr in traces:
        vs = [np.asarray(version_ids(engine, v), dtype=np.int64) for v in tr.get("versions") or []]
        if len(vs) < 2:
            raise ValueError(f"episode {tr.get('id')!r} needs at least two versions")
        episodes.append((str(tr.get("id")), vs))
    # warm-up: first calls pay one-off allocation and compilation costs
    warm = ThreadRegistry(engine)
    loop_episode(warm, thread_key("warmup"), episodes[0][1][:2], strategy=strategies[0], tool_s=0.0,
                 max_new_tokens=1)
    warm.close()
    rows: list[dict[str, Any]] = []
    total = len(tool_latencies) * len(strategies) * len(episodes)
    bar = tqdm(total=total, desc="bench-loop", unit="episode", disable=not progress)
    for lat in tool_latencies:
        for ep_id, vs in episodes:
            for strat in strategies:
                reg = ThreadRegistry(engine)
                try:
                    for r in loop_episode(reg, thread_key(ep_id), vs, strategy=strat, tool_s=float(lat),
                                          max_new_tokens=max_new_tokens):
                        rows.append({"id": ep_id, "requested": strat, "tool_s": float(lat), **r})
                finally:
                    reg.close()
                bar.update(1)
    bar.close()
    by: dict[str, dict[str, Any]] = {}
    for strat in strategies:
        by[strat] = {}
        for lat in tool_latencies:
            sel = [r for r in rows if r["requested"] == strat and r["tool_s"] == float(lat)]
            e2e, res = _median(r["e2e_ttft_s"] for r in sel), _median(r["ttft_s"] for r in sel)
            call = _median(r["ttft_s"] + r["plan_s"] for r in sel
                           if r["ttft_s"] is not None and r.get("plan_s") is not None)
            by[strat][str(float(lat))] = {
                "n": len(sel), "e2e_ttft_s_median": e2e, "ttft_s_median": res, "resume_call_s_median": call,
                "offload_wait_s_median": _median(r["offload_wait_s"] for r in sel),
                "e2e_over_resume": (e2e / res) if e2e and res else None,
                "e2e_over_resume_call": (e2e / call) if e2e and call else None,
                "bases": sorted({str(r["base"]) for r in sel}),
            }
    if "prefix" in by:
        for strat in strategies:
            for lat, g in by[strat].items():
                p = by["prefix"][lat]["e2e_ttft_s_median"]
                g["speedup_vs_prefix"] = (p / g["e2e_ttft_s_median"]) if p and g["e2e_ttft_s_median"] else None
    concurrent = None
    if threads:
        concurrent = {strat: _concurrent(engine, episodes, strat, threads, threads_tool_s, max_new_tokens)
                      for strat in strategies}
    return {"strategies": list(strategies), "tool_latencies": [float(x) for x in tool_latencies],
            "episodes": [e for e, _ in episodes], "max_new_tokens": max_new_tokens, "rows": rows, "by": by,
            "concurrent": concurrent}


def _concurrent(engine, episodes, strategy: str, threads: int, tool_s: float, max_new_tokens: int) -> dict:
    """``threads`` agent threads looping at once over the episodes (round-robin) on one registry."""
    reg = ThreadRegistry(engine)
    out: list[dict] = []
    lock = threading.Lock()

    def run(i):
        ep_id, vs = episodes[i % len(episodes)]
        got = loop_episode(reg, thread_key(f"{ep_id}#{i}"), vs, strategy=strategy, tool_s=tool_s,
                           max_new_tokens=max_new_tokens)
        with lock:
            out.extend(got)
        return len(vs)  # model calls of this thread, the first (exact) one included

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            calls = sum(pool.map(run, range(threads)))
    finally:
        reg.close()
    wall = time.perf_counter() - t0
    e2e = [r["e2e_ttft_s"] for r in out]
    return {"threads": threads, "tool_s": tool_s, "calls": calls, "wall_s": wall,
            "calls_per_min": calls / wall * 60.0 if wall > 0 else None,
            "e2e_p50_s": _pct(e2e, 50), "e2e_p95_s": _pct(e2e, 95),
            "bases": sorted({str(r["base"]) for r in out})}


def format_loop(summary: dict[str, Any]) -> str:
    """A text table of :func:`run_loop_bench`'s summary (medians in ms)."""
    lines = ["| strategy | tool s | n | e2e TTFT ms | resume TTFT ms | plan + resume ms | offload wait ms | e2e / resume | "
             "e2e / (plan + resume) | speedup vs prefix (e2e) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"

    for strat, per in summary["by"].items():
        for lat, g in per.items():
            sp = g.get("speedup_vs_prefix")
            ratio, rc = g.get("e2e_over_resume"), g.get("e2e_over_resume_call")
            lines.append(f"| {strat} | {float(lat):g} | {g['n']} | {ms(g['e2e_ttft_s_median'])} | "
                         f"{ms(g['ttft_s_median'])} | {ms(g.get('resume_call_s_median'))} | "
                         f"{ms(g['offload_wait_s_median'])} | {'-' if ratio is None else f'{ratio:.2f}'} | "
                         f"{'-' if rc is None else f'{rc:.2f}'} | {'-' if sp is None else f'{sp:.2f}x'} |")
    if summary.get("concurrent"):
        lines += ["", "| strategy | threads | tool s | calls | calls/min | e2e p50 ms | e2e p95 ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for strat, c in summary["concurrent"].items():
            lines.append(f"| {strat} | {c['threads']} | {c['tool_s']:g} | {c['calls']} | {c['calls_per_min']:.1f} | "
                         f"{ms(c['e2e_p50_s'])} | {ms(c['e2e_p95_s'])} |")
    return "\n".join(lines) + "\n"


def plot_loop(summary: dict[str, Any], path: str | Path | None = None):
    """End-to-end TTFT (solid) and resume-only TTFT (dashed) against tool latency, one colour per strategy.

    Args:
        summary: the output of :func:`run_loop_bench`.
        path: write the PNG there when given.

    Returns:
        The matplotlib ``Figure`` (built without pyplot).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for j, (strat, per) in enumerate(summary["by"].items()):
        lats = [float(x) for x in per]
        e2e = [per[x]["e2e_ttft_s_median"] for x in per]
        res = [per[x]["ttft_s_median"] for x in per]
        ax.plot(lats, e2e, marker="o", color=f"C{j}", label=f"{strat}: end-to-end (caller waits)")
        ax.plot(lats, res, marker="x", ls="--", color=f"C{j}", label=f"{strat}: resume only")
    ax.set_xlabel("tool latency L (s)")
    ax.set_ylabel("median TTFT of the next model call (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"agent loop: call -> tool (L) -> edited call  ({len(summary['episodes'])} episodes)")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig
