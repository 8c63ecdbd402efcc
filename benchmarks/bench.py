"""Benchmark: replay the workloads' evaluation episodes under every strategy, then summarize.

:func:`run_bench` replays traces (``docs/TRACES.md``) with :func:`patchkv_agent.eval.replay.replay_episode`
and appends each finished episode's result rows to ``results.jsonl`` as it goes, so an interrupted run
keeps what it finished and ``resume=True`` runs only the (episode, strategy) pairs still missing.
:func:`write_summary` turns result rows into ``summary.json``, ``summary.md`` and one
``frontier_<workload>.png`` per workload.

The summary functions (:func:`summarize`, :func:`markdown_table`, :func:`plot_frontier`) are pure: rows
in, dict / text / figure out; they import neither torch nor the engine, so notebooks and tests reuse
them on any results file. Knows the result format and the replay function; nothing about models,
strategies' internals or LangGraph. Times are compared only within one run (docs/TRACES.md).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from patchkv_agent.eval.episodes import agent_loop_episodes, build_workload_traces  # noqa: F401  (re-exported)

from .noninferiority import follow_rates as _follow_rates
from patchkv_agent.eval.traces import APPEND, ResultsFile, read_results  # noqa: F401  (read_results: re-exported for callers of the summary)

DEFAULT_WORKLOADS = ("hotpotqa-e", "2wikimqa-e", "nq-e")
DEFAULT_STRATEGIES = ("exact", "prefix", "direct", "cacheblend", "patchkv")
NOREADERS = "patchkv-noreaders"
NORECENT = "patchkv-norecent"
FOLLOW_STRATEGIES = ("exact", "prefix", "direct", "cacheblend", NOREADERS, "patchkv")
"""``bench --follow``'s strategies (on the edit-following workloads): the default ones and
``patchkv-noreaders`` (:func:`register_noreaders`), so that one run measures what the reader blocks buy."""
RESULTS_FILE = "results.jsonl"
ALL = "all"  # the pooled group in a summary with several workloads
EDITED = "edited"  # the call kind of every row that is not append-only (summary["by_call"])

_COLUMNS = (  # (summary key, Markdown header, format)
    ("n", "n", "d"),
    ("ttft_ms_median", "TTFT ms (median)", ".1f"),
    ("speedup_vs_prefix", "speedup vs prefix", ".2f"),
    ("recompute_ratio_mean", "recompute ratio", ".3f"),
    ("payload_mib_mean", "payload MiB", ".2f"),
    ("f1_mean", "F1", ".3f"),
    ("follow_rate", "follow", ".3f"),
    ("stale_rate", "stale", ".3f"),
    ("top1_agree", "top-1 agree", ".3f"),
    ("tf_agree", "TF agree", ".3f"),
    ("exact_continuation", "exact cont.", ".3f"),
    ("next_action", "next action", ".3f"),
    ("next_action_call", "tool-call decisions", ".3f"),
    ("next_action_text", "text actions", ".3f"),
    ("next_action_restore", "next action (restored)", ".3f"),
    ("next_action_after", "next action (after)", ".3f"),
    ("vs_floor", "TTFT / no-edit floor", ".2f"),
)
# agent columns: shown when some group has a value (agent workloads; next action needs a tokenizer)
_AGENT_COLUMNS = frozenset({"next_action", "next_action_call", "next_action_text", "next_action_restore",
                            "next_action_after", "vs_floor"})


def _register_variant(name: str, doc: str, **fixed) -> str:
    from patchkv_agent.strategies.base import register_variant

    return register_variant(name, "patchkv", fixed, doc=doc)


def register_noreaders() -> str:
    """Register ``patchkv-noreaders``: ``patchkv`` with the reader-block signal off (``readers="none"``, the
    plan before edit-following: window + last block only); idempotent.

    Returns:
        The name, :data:`NOREADERS`.
    """
    return _register_variant(NOREADERS, "patchkv with the reader blocks off", readers="none")


def register_norecent() -> str:
    """Register ``patchkv-norecent``: ``patchkv`` with the recency window off (``recent_window=0``: the plan
    before the recency rule), so one run measures what the window buys and costs; idempotent.

    Returns:
        The name, :data:`NORECENT`.
    """
    return _register_variant(NORECENT, "patchkv with the recency window off", recent_window=0)


# --------------------------------------------------------------------------- running

def run_bench(engine, traces: Sequence[dict], strategies: Sequence[str], out_dir: str | Path, *,
              max_new_tokens: int = 16, model_name: str = "", resume: bool = False, warmup: bool = True,
              progress: bool = True, heal: Sequence[str] = ("patchkv",), floors: Sequence[str] = ()) -> dict[str, Any]:
    """Replay traces under strategies, append rows to ``out_dir/results.jsonl``, write the summary.

    Each episode's rows are appended (and flushed) when the episode finishes, so the file only ever
    holds whole episodes plus, after a kill, at most one cut-off line (dropped on resume).

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine`.
        traces: trace-format episodes (``messages``, ``text`` or ``token_ids`` versions).
        strategies: strategy names; ``exact`` always runs as the reference.
        out_dir: output directory (created).
        max_new_tokens: greedy tokens per resume.
        model_name: the rows' ``model`` field.
        resume: keep an existing results file and skip (episode id, strategy) pairs it already holds;
            otherwise the file is started afresh.
        warmup: replay the first pending episode once (1 token, rows discarded) before timing, so first
            calls do not pay one-off allocation costs.
        progress: show a tqdm progress bar.
        heal: strategies healed between versions, as the thread registry does while a tool runs (see
            :func:`~patchkv_agent.eval.replay.replay_episode`); ``()`` carries every approximation forward.
        floors: noise floors run on the same calls as exact (:mod:`~patchkv_agent.eval.noise_floor`; CPU
            emulations, no TTFT): their agreement is the bar the strategies' is read against.

    Returns:
        The summary (see :func:`summarize`) of every row in the results file, with ``files`` and
        ``errors`` (episodes refused with a ``ValueError``, e.g. longer than the model's context).

    Raises:
        ValueError: unknown strategy or a malformed results file when resuming.
        OSError: the results file cannot be written.
    """
    from tqdm import tqdm

    from patchkv_agent.eval.replay import replay_episode
    from patchkv_agent.strategies import STRATEGIES, register_spec

    strategies = [register_spec(s) for s in strategies]  # name:key=value... specs: strategies with options
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {sorted(STRATEGIES)}")
    out = Path(out_dir)
    path = out / RESULTS_FILE
    results = ResultsFile(path, resume=resume)  # checks the file can be written before any model work
    done = {(r.get("id"), r.get("strategy")) for r in results.rows}
    floors = tuple(floors)
    pending = [(tr, [s for s in strategies if (tr.get("id"), s) not in done],
                [f for f in floors if (tr.get("id"), f) not in done]) for tr in traces]
    pending = [(tr, todo, fl) for tr, todo, fl in pending if todo or fl]
    errors: list[dict] = []
    if warmup and pending:
        try:
            first = pending[0][0]
            list(replay_episode(engine, dict(first, versions=first["versions"][:2]), list(strategies),
                                max_new_tokens=1))
        except ValueError:
            pass  # reported when the episode itself runs
    bar = tqdm(pending, desc="bench", unit="episode", disable=not progress, file=sys.stderr)
    with results:
        for tr, todo, fl in bar:
            bar.set_postfix_str(str(tr.get("id")))
            try:
                rows = list(replay_episode(engine, tr, todo, max_new_tokens=max_new_tokens, model_name=model_name,
                                           heal=heal, floors=fl))
            except ValueError as e:
                errors.append({"id": tr.get("id"), "error": str(e)})
                bar.write(f"skipped {tr.get('id')}: {e}")
                continue
            results.write_many(rows)  # one write per episode: the file holds whole episodes
    summary = write_summary(read_results(path), out)
    summary["errors"] = errors
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --------------------------------------------------------------------------- summary

def _mean(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _order(names: Iterable[str], canonical: Sequence[str]) -> list[str]:
    seen = list(dict.fromkeys(names))
    return [s for s in canonical if s in seen] + [s for s in seen if s not in canonical]


def _group(rows: list[dict], prefix_ttft: float | None, exact: dict[tuple, dict] | None = None) -> dict[str, Any]:
    times = [float(r["ttft_s"]) for r in rows if r["ttft_s"] is not None]  # noise floors have none
    ttft = statistics.median(times) if times else None
    calls = [r.get("next_action") for r in rows if r.get("action_kind") == "call"]
    texts = [r.get("next_action") for r in rows if r.get("action_kind") == "text"]
    follow, stale, n_follow, n_stale = _follow_rates(rows, exact or {})
    payload = _mean(r.get("payload_bytes") for r in rows)
    return {
        "n": len(rows),
        "episodes": len({r.get("id") for r in rows}),
        "floor": bool(rows and rows[0].get("floor")),
        "ttft_s_median": ttft,
        "ttft_ms_median": None if ttft is None else ttft * 1e3,
        "speedup_vs_prefix": (prefix_ttft / ttft) if prefix_ttft is not None and ttft else None,
        "recompute_ratio_mean": _mean(r.get("recompute_ratio") for r in rows),
        "payload_mib_mean": None if payload is None else payload / 2**20,
        "f1_mean": _mean(r.get("f1") for r in rows),
        "follow_rate": follow,
        "stale_rate": stale,
        "follow_n": n_follow,
        "stale_n": n_stale,
        "recompute_tokens_mean": _mean(r.get("recompute_tokens") for r in rows),
        "first_token_kl_mean": _mean(r.get("first_token_kl") for r in rows),
        "top1_agree": _mean(r.get("top1_agree") for r in rows),
        "tf_agree": _mean(r.get("tf_agree") for r in rows),
        "exact_continuation": _mean(r.get("exact_continuation") for r in rows),
        "next_action": _mean(r.get("next_action") for r in rows),
        "next_action_call": _mean(calls), "next_action_call_n": sum(1 for c in calls if c is not None),
        "next_action_text": _mean(texts), "next_action_text_n": sum(1 for t in texts if t is not None),
        "next_action_restore": _mean(r.get("next_action") for r in rows if r.get("restore_tokens")),
        "next_action_restore_n": sum(1 for r in rows if r.get("restore_tokens") and r.get("next_action") is not None),
        "next_action_after": _mean(r.get("next_action") for r in rows if r.get("after_restore")),
        "next_action_after_n": sum(1 for r in rows if r.get("after_restore") and r.get("next_action") is not None),
        "vs_floor": _floor_ratio(rows),
        "heal_s_mean": _mean(r.get("heal_s") for r in rows),
        "fallbacks": sum(1 for r in rows if r.get("fallback")),
    }


def _floor_ratio(rows: list[dict]) -> float | None:
    """Median TTFT over the median no-edit floor (``floor_ttft_s``) of the same rows; None without floors."""
    pairs = [(float(r["ttft_s"]), float(r["floor_ttft_s"])) for r in rows if r.get("floor_ttft_s")]
    if not pairs:
        return None
    return statistics.median(t for t, _ in pairs) / max(1e-9, statistics.median(f for _, f in pairs))


def _by_strategy(rows: list[dict], strategies: list[str]) -> dict[str, dict]:
    groups = {s: [r for r in rows if r["strategy"] == s] for s in strategies}
    prefix = groups.get("prefix")
    prefix_ttft = statistics.median(float(r["ttft_s"]) for r in prefix if r["ttft_s"] is not None) if prefix else None
    exact = {(r.get("id"), r.get("version")): r for r in groups.get("exact", [])}
    return {s: _group(rs, prefix_ttft, exact) for s, rs in groups.items() if rs}


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """Per workload x strategy aggregates of result rows (``docs/TRACES.md`` fields).

    Medians for ``ttft_s``; ``speedup_vs_prefix`` = median TTFT of ``prefix`` over the strategy's
    (a ratio of medians, within the workload); means over non-null values for ``recompute_ratio``,
    ``payload_bytes`` (as MiB), ``f1``, ``first_token_kl``; rates for ``top1_agree``, ``tf_agree``,
    ``exact_continuation`` (None for ``exact``, whose fidelity fields are null). With several
    workloads a pooled group ``"all"`` is added.

    Args:
        rows: result rows (any order; rows of several models are pooled, so pass one model's rows).

    Returns:
        ``{"n_rows", "models", "workloads", "strategies", "by_workload": {workload: {strategy: {...}}}}``;
        each group holds ``n``, ``episodes``, ``ttft_s_median``, ``ttft_ms_median``,
        ``speedup_vs_prefix``, ``recompute_ratio_mean``, ``payload_mib_mean``, ``f1_mean``,
        ``first_token_kl_mean``, ``top1_agree``, ``tf_agree``, ``exact_continuation``, ``fallbacks``,
        ``recompute_tokens_mean`` and, for edit-following rows (``follows`` / ``stale`` fields), ``follow_rate``
        (answers the new gold, among the (episode, version) pairs where ``exact`` does), ``stale_rate``
        (answers the previous version's gold, among the pairs where ``exact`` does not) and their
        denominators ``follow_n`` / ``stale_n`` (None / 0 without such rows).
        Where rows carry ``call_kind`` (replay rows do), ``by_call`` holds the same groups for edited and
        append-only calls apart: ``{workload: {"edited" | "append": {strategy: {...}}}}``.

    Raises:
        KeyError: a row without ``strategy`` or ``ttft_s``.
    """
    rows = list(rows)
    strategies = _order((r["strategy"] for r in rows), DEFAULT_STRATEGIES)
    workloads = _order((str(r.get("workload")) for r in rows), DEFAULT_WORKLOADS)
    by = {w: _by_strategy([r for r in rows if str(r.get("workload")) == w], strategies) for w in workloads}
    if len(workloads) > 1:
        by[ALL] = _by_strategy(rows, strategies)
    out = {
        "n_rows": len(rows),
        "models": sorted({str(r.get("model")) for r in rows}),
        "workloads": workloads,
        "strategies": strategies,
        "by_workload": by,
    }
    if any(r.get("call_kind") for r in rows):
        out["by_call"] = _by_call(rows, workloads, strategies)
    return out


def _by_call(rows: list[dict], workloads: list[str], strategies: list[str]) -> dict[str, dict[str, dict]]:
    """``{workload: {"edited" | "append": {strategy: group}}}``: edited calls and append-only calls apart (on
    an append-only call every strategy computes the same new tokens; the edited ones are where they differ).
    Rows without ``call_kind`` count as edited; each workload's prefix median is that call kind's own."""
    out: dict[str, dict[str, dict]] = {}
    for w in workloads + ([ALL] if len(workloads) > 1 else []):
        ws = [r for r in rows if w == ALL or str(r.get("workload")) == w]
        kinds = {EDITED: [r for r in ws if r.get("call_kind") != APPEND],
                 APPEND: [r for r in ws if r.get("call_kind") == APPEND]}
        out[w] = {k: _by_strategy(rs, strategies) for k, rs in kinds.items() if rs}
    return out


def markdown_table(summary: dict[str, Any]) -> str:
    """One Markdown table, a row per workload x strategy (see :func:`summarize` for the columns; the agent
    columns, next-action agreement and TTFT over the no-edit floor, only when some row has them).

    Args:
        summary: the output of :func:`summarize`.

    Returns:
        The table (``-`` for null values), ending with a newline.
    """
    groups_all = [g for groups in summary["by_workload"].values() for g in groups.values()]
    cols = [c for c in _COLUMNS if c[0] not in _AGENT_COLUMNS or any(g.get(c[0]) is not None for g in groups_all)]
    head = ["workload", "strategy"] + [h for _, h, _ in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * len(cols)]
    for w, groups in summary["by_workload"].items():
        for s, g in groups.items():
            cells = [w, s]
            for key, _, spec in cols:
                v = g.get(key)
                cells.append("-" if v is None else format(v, spec) + ("x" if key == "speedup_vs_prefix" else ""))
            lines.append("| " + " | ".join(cells) + " |")
    if summary.get("by_call"):
        lines += ["", "Edited and append-only calls apart:", "",
                  "| workload | calls | strategy | n | TTFT ms (median) | speedup vs prefix | next action |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for w, kinds in summary["by_call"].items():
            for kind, groups in kinds.items():
                for s, g in groups.items():
                    cells = [w, kind, s, str(g["n"])]
                    for key, spec in (("ttft_ms_median", ".1f"), ("speedup_vs_prefix", ".2f"), ("next_action", ".3f")):
                        v = g.get(key)
                        cells.append("-" if v is None else format(v, spec) + ("x" if key == "speedup_vs_prefix" else ""))
                    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_frontier(rows: Sequence[dict], path: str | Path | None = None, *, title: str | None = None):
    """TTFT-vs-quality frontier: mean F1 and mean teacher-forced agreement against median TTFT.

    One point per strategy, labelled; ``exact`` is drawn at ``tf_agree = 1`` (it is the reference).
    Pass one workload's rows for a per-workload plot.

    Args:
        rows: result rows.
        path: if given, the PNG is written there (parent directories created).
        title: figure title (default: the workloads in ``rows``).

    Returns:
        The :class:`matplotlib.figure.Figure` (built without pyplot: no global backend state).
    """
    from matplotlib.figure import Figure

    summary = summarize(rows)
    groups = summary["by_workload"].get(ALL) or next(iter(summary["by_workload"].values()), {})
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    markers = "osD^vP*Xh"
    for ax, key, label in ((axes[0], "f1_mean", "mean F1 vs gold answers"),
                           (axes[1], "tf_agree", "teacher-forced agreement with exact")):
        plotted = 0
        for j, (s, g) in enumerate(groups.items()):
            y = 1.0 if key == "tf_agree" and s == "exact" else g.get(key)
            if y is None:
                continue
            ax.scatter(g["ttft_ms_median"], y, s=45, zorder=3, color=f"C{j}", marker=markers[j % len(markers)],
                       label=s)
            # labels alternate above/below so points at the same place stay readable
            ax.annotate(s, (g["ttft_ms_median"], y), textcoords="offset points", xytext=(5, 5 if j % 2 else -11),
                        fontsize=8, color=f"C{j}")
            plotted += 1
        if not plotted:
            ax.text(0.5, 0.5, "no values (no gold answers?)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlim(left=0)
        ax.set_ylim(-0.05, 1.08)
        ax.set_xlabel("median TTFT (ms)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles = max((ax.get_legend_handles_labels() for ax in axes), key=lambda hl: len(hl[0]))
    if handles[0]:
        fig.legend(*handles, loc="outside right upper", fontsize=8)
    fig.suptitle(title or ", ".join(summary["workloads"]) + f"  ({', '.join(summary['models'])})")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def write_summary(rows: Sequence[dict], out_dir: str | Path, *, floor_repeat: Sequence[dict] = ()) -> dict[str, Any]:
    """Write ``summary.json``, ``summary.md`` and ``frontier_<workload>.png`` (one per workload).

    Where the rows hold a noise floor, every approximate strategy is also scored against it by the pooled
    non-inferiority criterion (:mod:`~benchmarks.noninferiority`): ``summary["non_inferiority"]``
    ``{floor: {strategy: result}}`` and a section of ``summary.md``.

    Args:
        rows: result rows.
        out_dir: output directory (created).
        floor_repeat: rows of a second run of the floors on the same calls (another thread count): calls whose
            floor verdict differs between the runs are near-ties.

    Returns:
        The summary with ``files``: the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    summary = summarize(rows)
    scored = non_inferiority_all(rows, floor_repeat=floor_repeat)
    if scored:
        summary["non_inferiority"] = scored
    files = []
    for w in summary["workloads"]:
        png = out / f"frontier_{_safe(w)}.png"
        plot_frontier([r for r in rows if str(r.get("workload")) == w and not r.get("floor")], png, title=w)
        files.append(str(png))
        if any(r.get("floor") for r in rows if str(r.get("workload")) == w):
            png = out / f"agreement_{_safe(w)}.png"
            plot_agreement(summary["by_workload"][w], png, title=w)
            files.append(str(png))
    md = out / "summary.md"
    from .noninferiority import markdown as ni_markdown

    ni = "".join("\n" + ni_markdown(r) for by in scored.values() for r in by.values())
    md.write_text(f"# Benchmark summary ({', '.join(summary['models'])}; {summary['n_rows']} rows)\n\n"
                  + markdown_table(summary) + ni)
    js = out / "summary.json"
    summary["files"] = [str(js), str(md)] + files
    js.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def non_inferiority_all(rows: Sequence[dict], *, floor_repeat: Sequence[dict] = ()) -> dict[str, dict[str, dict]]:
    """Every approximate strategy of ``rows`` (not exact, not a floor, with fidelity verdicts) scored against every
    noise floor of ``rows`` (:func:`~benchmarks.noninferiority.non_inferiority`, edited calls only).

    Args:
        rows: result rows.
        floor_repeat: a second run of the floors on the same calls (near-ties).

    Returns:
        ``{floor: {strategy: result}}``; empty without floor rows, and a pair with no edited call in common is
        left out.
    """
    from .noninferiority import non_inferiority

    floors = _order((r["strategy"] for r in rows if r.get("floor")), ())
    cands = _order((r["strategy"] for r in rows if not r.get("floor") and r["strategy"] not in ("exact", "prefix")),
                   DEFAULT_STRATEGIES)  # exact and prefix compute exact's context: nothing to judge
    out: dict[str, dict[str, dict]] = {}
    for f in floors:
        for c in cands:
            try:
                out.setdefault(f, {})[c] = non_inferiority(rows, c, f, floor_repeat=floor_repeat)
            except ValueError:  # no edited call in common (a strategy run on other calls than the floor)
                continue
    return {f: by for f, by in out.items() if by}


def plot_agreement(groups: dict[str, dict], path: str | Path | None = None, *, title: str | None = None):
    """Agreement with exact against recomputed share, one point per strategy, noise floors as lines.

    The y value is the next-action agreement where the rows have one (agent workloads), else the
    teacher-forced top-1 agreement; the floors (bf16 / int8 / fp8 KV cache, bf16 weights) are horizontal
    lines: a strategy above a floor keeps exact's decisions as often as serving in that format does.

    Args:
        groups: one workload's ``{strategy: group}`` of :func:`summarize`.
        path: where to save the PNG (None: not saved).
        title: the figure's title.

    Returns:
        The matplotlib figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "next_action" if any(g.get("next_action") is not None for g in groups.values()) else "tf_agree"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, g) in enumerate(groups.items()):
        y = g.get(key)
        if y is None:
            continue
        if g.get("floor"):
            ax.axhline(y, ls="--", lw=1, color=f"C{i % 10}", label=f"{name} (floor) {y:.2f}")
        elif name != "exact":
            ax.scatter([g.get("recompute_ratio_mean") or 0.0], [y], s=70 - 12 * i, color=f"C{i % 10}",
                       label=f"{name} {y:.2f}", zorder=3)  # shrinking markers: coinciding points stay visible
    ax.set_xlabel("recomputed share of the suffix (mean)")
    ax.set_ylabel("next action = exact's" if key == "next_action" else "teacher-forced top-1 agreement")
    ax.set_xlim(-0.02, 1.05)  # the whole range: a strategy is placed by what it recomputes, prefix at 1.0
    ax.set_ylim(0, 1.05)
    ax.set_title(title or "agreement with exact vs recompute")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
