"""Pooled non-inferiority of an approximate strategy to a noise floor (an accepted approximation of exact).

The question a user asks of an approximation is whether the model decides what exact decides about as often
as serving with an accepted approximation (a bf16 KV cache) does. Per workload at n = 15-20 the gap is a call or
two and inside the noise, so the criterion pools the edited calls of every workload:

- per call, the *verdict* of a strategy is whether it keeps exact's next action (``next_action``: the first
  tool call, name and arguments, else the text); rows without one (QA edits) use ``exact_continuation``;
- ``b`` counts the calls where the candidate differs from exact and the floor does not, ``c`` the calls where
  the floor differs and the candidate does not; the criterion is ``100 * (b - c) / n <= margin`` (2 per 100
  calls by default), reported with a 95 % interval from a paired bootstrap over calls and the exact McNemar
  p-value;
- a call whose floor verdict changes between two runs of the floor (``floor_repeat``: the same calls at another
  thread count) is a near-tie: it is counted, reported and scored as a tie (neither ``b`` nor ``c``);
- tool-call decisions (the calls whose exact action is a tool call) must be kept at least as often as the
  floor keeps them; where follow rows are present, follow >= 0.95 and stale <= 0.05.

Pure: rows in, a dict / text out (numpy for the bootstrap). Knows the result-row format (docs/TRACES.md), not
models or strategies.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from patchkv_agent.eval.traces import APPEND

MARGIN_PER_100 = 2.0
FOLLOW_MIN = 0.95
STALE_MAX = 0.05
_Key = tuple[str, int]


def _key(r: dict) -> _Key:
    return (str(r.get("id")), int(r.get("version") or 0))


def verdict(row: dict) -> bool | None:
    """Whether a result row keeps exact's decision: ``next_action`` where the row has one, else
    ``exact_continuation`` (QA rows, whose answer is text); None where neither is known."""
    v = row.get("next_action")
    if v is None:
        v = row.get("exact_continuation")
    return None if v is None else bool(v)


def _edited_keys(rows: Sequence[dict]) -> set[_Key]:
    """The calls that edit something: ``call_kind`` where rows carry it, else a retained suffix after the edit
    (``suffix_tokens > 0`` on some row of the call; rows written before ``call_kind`` existed)."""
    edited, seen_kind, append = set(), set(), set()
    for r in rows:
        k = _key(r)
        kind = r.get("call_kind")
        if kind is not None:
            seen_kind.add(k)
            (append if kind == APPEND else edited).add(k)
        elif k not in seen_kind and (r.get("suffix_tokens") or 0) > 0:
            edited.add(k)
    return edited - append


def _verdicts(rows: Iterable[dict], strategy: str) -> dict[_Key, dict]:
    return {_key(r): r for r in rows if r.get("strategy") == strategy and verdict(r) is not None}


def _mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: ``b`` of ``b + c`` discordant calls under Binomial(b + c, 1/2)."""
    m = b + c
    if m == 0:
        return 1.0
    lo = min(b, c)
    tail = sum(math.comb(m, i) for i in range(lo + 1)) / 2.0 ** m
    return min(1.0, 2.0 * tail)


def _bootstrap_ci(d: Sequence[int], n_boot: int, seed: int) -> tuple[float, float]:
    import numpy as np

    arr = np.asarray(d, dtype=np.float64)
    if arr.size == 0:
        return (0.0, 0.0)
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(n_boot, arr.size))].mean(axis=1) * 100.0
    lo, hi = np.percentile(means, [2.5, 97.5])
    return (float(lo), float(hi))


def _rate(rows: Iterable[dict]) -> tuple[float | None, int]:
    vs = [verdict(r) for r in rows]
    vs = [v for v in vs if v is not None]
    return (sum(vs) / len(vs) if vs else None, len(vs))


def _score(keys: list[_Key], cand: dict, floor: dict, ties: set[_Key]) -> dict[str, Any]:
    b = sum(1 for k in keys if k not in ties and not verdict(cand[k]) and verdict(floor[k]))
    c = sum(1 for k in keys if k not in ties and verdict(cand[k]) and not verdict(floor[k]))
    n = len(keys)
    return {"n": n, "b": b, "c": c, "near_ties": sum(1 for k in keys if k in ties),
            "candidate_kept": sum(1 for k in keys if verdict(cand[k])),
            "floor_kept": sum(1 for k in keys if verdict(floor[k])),
            "diff_per_100": 100.0 * (b - c) / n if n else None}


def non_inferiority(rows: Sequence[dict], candidate: str, floor: str = "kv-bf16", *,
                    floor_repeat: Sequence[dict] = (), margin: float = MARGIN_PER_100, edited_only: bool = True,
                    n_boot: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Score ``candidate`` against ``floor`` on the calls both ran (pooled, and per workload).

    Args:
        rows: result rows of one model (exact, the candidate and the floor on the same calls).
        candidate: the strategy name to judge (e.g. ``patchkv:tail_threshold=0.02``).
        floor: the noise floor's strategy name (default ``kv-bf16``).
        floor_repeat: rows of a second run of the floor on the same calls (another thread count); a call whose
            floor verdict differs between the runs is a near-tie, scored as a tie.
        margin: the largest admissible ``100 * (b - c) / n`` (calls per 100).
        edited_only: score only the calls that edit something (append-only calls are alike under every
            strategy).
        n_boot: bootstrap resamples for the 95 % interval.
        seed: the bootstrap's seed (the interval is reproducible).

    Returns:
        ``{"candidate", "floor", "margin_per_100", "n", "b", "c", "near_ties", "candidate_kept", "floor_kept",
        "diff_per_100", "ci95_per_100", "mcnemar_p", "meets_next_action", "tool_calls": {"n", "candidate",
        "floor", "floor_ties_scored", "near_ties", "meets"}, "follow": {...} or None, "by_workload": {workload: {"n", "b", "c", "near_ties",
        "diff_per_100", ...}}, "meets"}``.

    Raises:
        ValueError: no call has a verdict from both the candidate and the floor (nothing to score), naming the
            strategies the rows hold.
    """
    rows = list(rows)
    cand, flo = _verdicts(rows, candidate), _verdicts(rows, floor)
    keys = sorted(set(cand) & set(flo))
    if edited_only:
        edited = _edited_keys(rows)
        keys = [k for k in keys if k in edited]
    if not keys:
        held = sorted({str(r.get("strategy")) for r in rows})
        raise ValueError(f"no edited call has a verdict from both {candidate!r} and {floor!r}; the rows hold {held}: "
                         "run the candidate beside the floor (`bench --strategies exact,CANDIDATE --noise-floor "
                         "FLOOR`)")
    rep = _verdicts(floor_repeat, floor)
    ties = {k for k in keys if k in rep and verdict(rep[k]) != verdict(flo[k])}
    out: dict[str, Any] = {"candidate": candidate, "floor": floor, "margin_per_100": margin}
    out.update(_score(keys, cand, flo, ties))
    d = [0 if k in ties else int(not verdict(cand[k]) and verdict(flo[k])) - int(verdict(cand[k]) and not verdict(flo[k]))
         for k in keys]
    out["ci95_per_100"] = list(_bootstrap_ci(d, n_boot, seed))
    out["mcnemar_p"] = _mcnemar_p(out["b"], out["c"])
    out["floor_repeated"] = bool(rep)
    out["meets_next_action"] = out["diff_per_100"] <= margin
    calls = [k for k in keys if cand[k].get("action_kind") == "call"]
    c_rate, n_calls = _rate(cand[k] for k in calls)
    f_rate, _ = _rate(flo[k] for k in calls)
    # a near-tie is a tie here too: the floor's verdict on it is taken as the candidate's
    f_tied = (sum(verdict(cand[k]) if k in ties else verdict(flo[k]) for k in calls) / n_calls) if n_calls else None
    out["tool_calls"] = {"n": n_calls, "candidate": c_rate, "floor": f_rate, "floor_ties_scored": f_tied,
                         "near_ties": sum(1 for k in calls if k in ties),
                         "meets": True if not n_calls else (c_rate or 0.0) >= (f_tied or 0.0)}
    out["follow"] = _follow(rows, candidate)
    workloads = sorted({str(cand[k].get("workload")) for k in keys})
    out["by_workload"] = {w: _score([k for k in keys if str(cand[k].get("workload")) == w], cand, flo, ties)
                          for w in workloads}
    follow_ok = out["follow"] is None or out["follow"]["meets"]
    out["meets"] = bool(out["meets_next_action"] and out["tool_calls"]["meets"] and follow_ok)
    return out


def follow_rates(rows: list[dict], exact: dict[tuple, dict]) -> tuple[float | None, float | None, int, int]:
    """Edit-following rates of ``rows`` against the exact rows of the same (id, version).

    follow rate: among rows whose exact row follows (answers the version's gold), the share that follows;
    stale rate: among rows whose exact row is not stale (does not answer the previous version's gold),
    the share that answers the previous gold. Rows without the fields (no per-version gold) are ignored.
    """
    fol, sta = [], []
    for r in rows:
        ref = exact.get((r.get("id"), r.get("version")))
        if ref is None or r.get("follows") is None or ref.get("follows") is None:
            continue
        if ref["follows"]:
            fol.append(bool(r["follows"]))
        if not ref["stale"]:
            sta.append(bool(r["stale"]))
    return (sum(fol) / len(fol) if fol else None, sum(sta) / len(sta) if sta else None, len(fol), len(sta))


def _follow(rows: list[dict], candidate: str) -> dict[str, Any] | None:
    """Follow / stale rates of the candidate on edit-following rows (the summary's own rates,
    :func:`follow_rates`); None without such rows."""
    exact = {(r.get("id"), r.get("version")): r for r in rows if r.get("strategy") == "exact"}
    f, s, n_f, n_s = follow_rates([r for r in rows if r.get("strategy") == candidate], exact)
    if not n_f and not n_s:
        return None
    return {"follow": f, "follow_n": n_f, "stale": s, "stale_n": n_s,
            "meets": (f is None or f >= FOLLOW_MIN) and (s is None or s <= STALE_MAX)}


def markdown(result: dict[str, Any]) -> str:
    """The scored criterion as Markdown: the pooled line, then one row per workload.

    Args:
        result: the output of :func:`non_inferiority`.

    Returns:
        The text, ending with a newline.
    """
    r = result
    lo, hi = r["ci95_per_100"]
    verdict_s = "meets" if r["meets"] else "does not meet"
    tc = r["tool_calls"]
    lines = [f"Non-inferiority of `{r['candidate']}` to `{r['floor']}` ({verdict_s} the criterion): "
             f"{r['n']} edited calls; {r['candidate']} keeps {r['candidate_kept']}, the floor {r['floor_kept']}; "
             f"b = {r['b']} (only the candidate differs), c = {r['c']} (only the floor differs), "
             f"near ties {r['near_ties']}{'' if r['floor_repeated'] else ' (floor run once)'}; "
             f"(b - c) per 100 calls {r['diff_per_100']:+.1f} (95 % bootstrap interval {lo:+.1f} to {hi:+.1f}; "
             f"margin {r['margin_per_100']:g}; exact McNemar p = {r['mcnemar_p']:.2f})."]
    if tc["n"]:
        ties = (f", {tc['floor_ties_scored']:.3f} with its {tc['near_ties']} near tie(s) scored as ties"
                if tc.get("near_ties") else "")
        lines.append(f"Tool-call decisions ({tc['n']} calls): candidate {tc['candidate']:.3f}, floor "
                     f"{tc['floor']:.3f}{ties} ({'meets' if tc['meets'] else 'below the floor'}).")
    if r["follow"]:
        f = r["follow"]
        lines.append(f"Edit following: follow {f['follow']} (n {f['follow_n']}), stale {f['stale']} "
                     f"(n {f['stale_n']}) ({'meets' if f['meets'] else 'does not meet'} >= {FOLLOW_MIN} / <= {STALE_MAX}).")
    lines += ["", "| workload | edited calls | candidate kept | floor kept | b | c | near ties | (b - c) per 100 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w, g in r["by_workload"].items():
        lines.append(f"| {w} | {g['n']} | {g['candidate_kept']} | {g['floor_kept']} | {g['b']} | {g['c']} | "
                     f"{g['near_ties']} | {g['diff_per_100']:+.1f} |")
    return "\n".join(lines) + "\n"
