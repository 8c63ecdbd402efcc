"""The reader stage of calibration: the reader rule's constants chosen per model by whether resumes act on the edit.

Boundary: one opt-in stage of ``patchkv-agent calibrate`` (``--reader-workloads``). It takes edit-following
episodes (:func:`patchkv_agent.eval.follow.build_follow_traces`, split ``calib``: the benchmark reads
``eval``), resumes every edited version from the exact KV of the version before through the engine's public
methods only (``checkpoint``, ``resume`` with ``exact`` and
:class:`~patchkv_agent.strategies.builtin.PatchKVStrategy` with each candidate rule, the rest of the settings
the engine's), scores whether each resume answers the version's gold where ``exact`` does, and chooses a rule
by :func:`choose_rule`. It returns JSON-safe dicts; it writes no file and touches no other part of the profile
(:func:`with_reader_rule` puts the choice into a profile dict, :mod:`.outputs` writes it).

Why a stage of its own: the reader rule (:func:`patchkv_agent.core.plan.plan_repair`: later blocks that
mention what an edit changed are recomputed) has four constants (``min_share``, ``min_blocks``,
``attention_blocks``, ``budget``) that were set by hand on four templates; how much of a later record a model
needs recomputed to act on an edited relation is a property of the model. The main grid only turns the rule
on or off. Candidate rules often plan the same rows on a version: each distinct plan is resumed once and its
answer shared (``shared`` in the rows), which keeps a 25-rule grid near the cost of a few resumes per version.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from typing import Any, Callable, Mapping, Sequence

from patchkv_agent.profiles import READER_RULE_KEYS

__all__ = ["DEFAULT_TARGET", "DEFAULT_N", "DEFAULT_TOKENS", "RULE", "OFF", "BUILTIN", "rule_grid", "rule_name", "choose_rule",
           "follow_traces", "select_reader_rule", "with_reader_rule"]

DEFAULT_TARGET = 0.95
DEFAULT_N = 8
DEFAULT_TOKENS = 12
OFF = "off"
RULE = ("reader rule: the cheapest candidate (mean recomputed tokens over every scored version) whose follow rate "
        "(answers the version's gold among the versions where exact does) is >= target on every workload with such "
        "versions and whose greedy continuation equals exact's, on every workload, on at least as many versions as "
        "the built-in rule's (no worse than running without a profile). When no candidate reaches the target on every "
        "workload, the target is the best worst-workload follow rate any candidate reaches; when none of those meets "
        "the agreement floor, the most agreeing of them, then the cheaper. 'off' is the plan without reader blocks")
BUILTIN = "s0.1-b3-a2-g0.25"
"""The built-in rule's name (:data:`patchkv_agent.core.readers.READER_MIN_SHARE` and the other defaults): the
agreement floor of :func:`choose_rule`. Checked against the defaults in the tests."""
_SETTINGS = READER_RULE_KEYS  # a rule's constants (the profile's reader_rule keys) -> the settings they set
_KEYS = tuple(_SETTINGS)


def rule_grid(min_shares: Sequence[float] = (0.05, 0.1, 0.2), min_blocks: Sequence[int] = (1, 3),
              attention_blocks: Sequence[int] = (0, 2), budgets: Sequence[float] = (0.25, 0.5),
              off: bool = True) -> list[dict[str, Any]]:
    """Candidate rules: the product of the values (and ``{"name": "off"}`` first when ``off``).

    Args:
        min_shares: least lexical score of a reader block, each in ``[0, 1]``.
        min_blocks: the reader budget's floor in blocks, each an int ``>= 0``.
        attention_blocks: top stored-attention blocks an edit with readers adds, each an int ``>= 0``.
        budgets: reader blocks' share of the plan's other recompute, each in ``[0, 1]``.
        off: include the plan without readers.
    Returns:
        Rule dicts ``{"name", "min_share", "min_blocks", "attention_blocks", "budget"}`` (``off``: name only).
    Raises:
        ValueError: a value outside its range, or an empty grid.
    """
    out: list[dict[str, Any]] = [{"name": OFF}] if off else []
    for s, b, a, g in itertools.product(min_shares, min_blocks, attention_blocks, budgets):
        out.append(_check_rule({"min_share": s, "min_blocks": b, "attention_blocks": a, "budget": g}))
    if not out:
        raise ValueError("the reader rule grid is empty; give at least one value of each constant, or off=True")
    return out


def _check_rule(rule: Mapping[str, Any]) -> dict[str, Any]:
    if rule.get("name") == OFF:
        return {"name": OFF}
    r = {}
    for k in _KEYS:
        v = rule.get(k)
        if k in ("min_blocks", "attention_blocks"):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"reader rule {k} must be an int >= 0, got {v!r}")
            r[k] = int(v)
        else:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"reader rule {k} must be a number in [0, 1], got {v!r}")
            r[k] = float(v)
    return {"name": rule_name(r), **r}


def rule_name(rule: Mapping[str, Any]) -> str:
    """A rule's short name, e.g. ``"s0.1-b3-a2-g0.25"`` (``"off"`` for the plan without readers)."""
    if rule.get("name") == OFF:
        return OFF
    return f"s{rule['min_share']:g}-b{rule['min_blocks']}-a{rule['attention_blocks']}-g{rule['budget']:g}"


def _strategy(rule: Mapping[str, Any], recent_window: int | None = None):
    from patchkv_agent.strategies.builtin import PatchKVStrategy

    if rule.get("name") == OFF:
        return PatchKVStrategy(readers="none", recent_window=recent_window)
    return PatchKVStrategy(readers="lexical", recent_window=recent_window, **{_SETTINGS[k]: rule[k] for k in _KEYS})


def _check_target(target: float) -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 <= target <= 1.0:
        raise ValueError(f"target must be a number in [0, 1] (a follow rate), got {target!r}")
    return float(target)


def follow_traces(workloads: Sequence[str], *, n: int = DEFAULT_N, seed: int = 0,
                  count_tokens: Callable | None = None) -> list[dict]:
    """The stage's episodes: ``n`` of each edit-following workload from the ``calib`` split (the benchmark's
    ``bench --workloads follow-...`` reads ``eval``: disjoint episodes).

    Args:
        workloads: names from :data:`~patchkv_agent.eval.follow.FOLLOW_WORKLOADS` or
            :data:`~patchkv_agent.eval.follow.HELDOUT_WORKLOADS`.
        n: episodes per workload, ``>= 1``.
        seed: the builder's seed.
        count_tokens: passed to :func:`~patchkv_agent.eval.follow.build_follow_traces`.
    Returns:
        Trace dicts (``docs/TRACES.md``; each version carries its ``answers``).
    Raises:
        ValueError: an unknown workload or ``n < 1``.
    """
    from patchkv_agent.eval.follow import build_follow_traces, is_follow_workload

    bad = [w for w in workloads if not is_follow_workload(w)]
    if bad:
        raise ValueError(f"not edit-following workloads: {bad}")
    if n < 1:
        raise ValueError(f"n must be >= 1 (episodes per workload), got {n}")
    out: list[dict] = []
    for w in workloads:
        out += build_follow_traces(w, n=n, split="calib", seed=seed, count_tokens=count_tokens)
    return out


def _judge(engine) -> Callable[[Sequence[int], Any], bool | None]:
    """``(output ids, gold answers) -> answers it`` through :func:`~patchkv_agent.eval.metrics.answer_match`
    (None without a tokenizer or gold)."""
    from patchkv_agent.eval.metrics import answer_match

    tok = getattr(engine, "tokenizer", None)

    def judge(out: Sequence[int], gold: Any) -> bool | None:
        if tok is None or not gold:
            return None
        return bool(answer_match(tok.decode(list(out), skip_special_tokens=True), list(gold)))

    return judge


def select_reader_rule(engine, traces: Sequence[dict], rules: Sequence[Mapping[str, Any]] | None = None,
                       target: float = DEFAULT_TARGET, max_new_tokens: int = DEFAULT_TOKENS,
                       judge: Callable[[Sequence[int], Any], bool | None] | None = None,
                       recent_window: int | None = 0, progress: bool = True,
                       rows: list | None = None) -> dict[str, Any]:
    """Measure each candidate reader rule's follow rate and cost on edit-following traces and choose one.

    For every version ``k >= 1`` of each trace the base is ``engine.checkpoint(ids[k-1])`` (the exact KV of
    the version before); ``ids[k]`` is resumed with ``exact`` and with
    ``PatchKVStrategy(readers=..., reader_min_share=..., ...)`` per rule (the engine's other settings),
    ``max_new_tokens`` greedy tokens each, and each output is judged against the version's ``answers``
    (``follows``) and the previous version's (``stale``). Rules whose plans recompute the same rows share one
    resume.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine` (its ``settings`` apply, but for the reader
            rule).
        traces: trace dicts with two or more versions each, versions carrying ``answers``.
        rules: candidates (:func:`rule_grid`; default: its default grid).
        target: the least follow rate for :func:`choose_rule`.
        max_new_tokens: greedy tokens per resume (enough to read the answer).
        judge: ``(output ids, answers) -> bool`` (default: decoded text through ``answer_match``; None
            results are not scored).
        recent_window: the recency window the rules plan with (default 0: off, so that the readers are
            measured on their own: a window at least as long as these short episodes would recompute them
            whole and every rule would tie; in a long context the readers are what reaches the mentions
            beyond the window); None: the engine's.
        progress: a tqdm bar on stderr.
        rows: if given, one dict per scored version is appended (id, version, per-rule results).
    Returns:
        ``{"rule", "chosen", "chosen_rule", "target", "target_met", "grid": {name: {"follows", "n",
        "rate", "stale", "agree", "recompute_tokens_mean", ...}}, "grid_by_workload", "rules",
        "prefix_recompute_tokens_mean", "n_versions", "n_scored", "n_exact_follows", "resumes",
        "workloads", "episodes", "settings", "max_new_tokens"}`` (JSON-safe).
    Raises:
        ValueError: bad rules, target or ``max_new_tokens``; no traces; or no version where ``exact``
            answers its gold (nothing to choose by).
    """
    from tqdm import tqdm

    from patchkv_agent.core.diff import diff_versions
    from patchkv_agent.eval.traces import version_ids

    cands = [_check_rule(r) for r in (rule_grid() if rules is None else rules)]
    names = [r["name"] for r in cands]
    if not cands or len(set(names)) != len(names):
        raise ValueError(f"need one or more distinct reader rules, got {names}")
    target = _check_target(target)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if recent_window is not None and (isinstance(recent_window, bool) or not isinstance(recent_window, int)
                                      or recent_window < 0):
        raise ValueError(f"recent_window must be an int >= 0 or None, got {recent_window!r}")
    traces = list(traces)
    if not traces:
        raise ValueError("no edit-following traces to calibrate the reader rule on")
    judge = _judge(engine) if judge is None else judge
    strategies = {r["name"]: _strategy(r, recent_window) for r in cands}
    scored: list[dict] = []
    n_versions = sum(max(0, len(tr["versions"]) - 1) for tr in traces)
    resumes = 0
    with tqdm(total=n_versions, desc="reader rule", unit="version", file=sys.stderr, disable=not progress) as bar:
        for tr in traces:
            ids = [version_ids(engine, v) for v in tr["versions"]]
            for k in range(1, len(ids)):
                bar.update(1)
                gold = _answers(tr, k)
                ref = list(engine.resume(None, ids[k], strategy="exact", max_new_tokens=max_new_tokens).output_ids)
                exact_follows = judge(ref, gold)
                ckpt = engine.checkpoint(ids[k - 1])
                edit = diff_versions(ckpt.token_ids, ids[k], words=engine.words, old_words=ckpt.words)
                by_plan: dict[bytes, dict] = {}
                results: dict[str, dict] = {}
                for name, strat in strategies.items():
                    plan = strat.plan(engine.settings, ckpt, edit)
                    key = plan.recompute_positions.tobytes()
                    hit = by_plan.get(key)
                    if hit is None:
                        out = list(engine.resume(ckpt, ids[k], strategy=strat, max_new_tokens=max_new_tokens).output_ids)
                        resumes += 1
                        hit = by_plan[key] = {"out": out, "first": name}
                    out = hit["out"]
                    results[name] = {"follows": judge(out, gold), "stale": judge(out, _answers(tr, k - 1)),
                                     "agree": out == ref, "recompute_tokens": int(plan.n_recompute),
                                     "n_readers": int(getattr(plan, "n_readers", 0)),
                                     "shared": None if hit["first"] == name else hit["first"]}
                del ckpt
                row = {"id": str(tr.get("id")), "workload": str(tr.get("workload", "")), "version": k,
                       "new_tokens": len(ids[k]), "prefix_recompute_tokens": len(ids[k]) - int(edit.prefix_len),
                       "exact_follows": exact_follows, "results": results}
                scored.append(row)
                if rows is not None:
                    rows.append(row)
    if not any(r["exact_follows"] for r in scored):
        raise ValueError(f"exact answers the gold in none of the {len(scored)} versions of {len(traces)} traces: "
                         "nothing to choose the reader rule by; use more episodes (--reader-n) or a model that "
                         "answers these workloads")
    grid = _grid(scored, names)
    workloads = sorted({r["workload"] for r in scored})
    by_workload = {wl: _grid([r for r in scored if r["workload"] == wl], names) for wl in workloads}
    floor = {wl: g[BUILTIN]["agree"] for wl, g in by_workload.items()} if BUILTIN in grid else None
    chosen = choose_rule(by_workload, grid, target, agree_floor=floor)
    rule_of = {r["name"]: r for r in cands}
    return {
        "rule": RULE, "chosen": chosen, "chosen_rule": rule_of[chosen], "target": target,
        "target_met": _all_meet(by_workload, chosen, target), "agree_floor": floor,
        "by": (f"answers the version's gold in the first words of {max_new_tokens} greedy tokens (answer_match), "
               "among the versions where exact does; each version resumed from the exact KV of the version before"),
        "grid": grid, "grid_by_workload": by_workload, "rules": cands,
        "prefix_recompute_tokens_mean": statistics.fmean(r["prefix_recompute_tokens"] for r in scored),
        "n_versions": n_versions, "n_scored": len(scored),
        "n_exact_follows": sum(1 for r in scored if r["exact_follows"]), "resumes": resumes,
        "workloads": workloads, "episodes": [str(tr.get("id")) for tr in traces],
        "settings": {**_settings_record(engine),
                     "recent_window": int(engine.settings.recent_window if recent_window is None else recent_window)},
        "max_new_tokens": max_new_tokens,
    }


def _answers(tr: dict, k: int):
    v = tr["versions"][k]
    return v.get("answers") if isinstance(v, dict) else None


def _settings_record(engine) -> dict[str, Any]:
    """The engine's plan settings the stage ran under (all but the reader rule, which it varies)."""
    s = engine.settings
    return {"length_model": s.length_model.to_dict(), "kappa": float(s.kappa), "block_size": int(s.block_size),
            "rewrite_share": float(s.rewrite_share), "recent_window": int(s.recent_window),
            "min_restore_share": float(s.min_restore_share), "mixed_precision": bool(s.mixed_precision)}


def _grid(scored: Sequence[dict], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        rs = [r["results"][name] for r in scored]
        fol = [x["follows"] for r, x in zip(scored, rs) if r["exact_follows"] and x["follows"] is not None]
        out[name] = {"follows": sum(fol), "n": len(fol), "rate": sum(fol) / len(fol) if fol else None,
                     "stale": sum(1 for x in rs if x["stale"]), "agree": sum(1 for x in rs if x["agree"]),
                     "versions": len(rs), "recompute_tokens_mean": statistics.fmean(x["recompute_tokens"] for x in rs)}
    return out


def _all_meet(by_workload: Mapping[str, Mapping[str, Mapping[str, Any]]], name: str, target: float) -> bool:
    return all(g[name]["follows"] + 1e-9 >= target * g[name]["n"] for g in by_workload.values() if g[name]["n"])


def choose_rule(by_workload: Mapping[str, Mapping[str, Mapping[str, Any]]], grid: Mapping[str, Mapping[str, Any]],
                target: float, agree_floor: Mapping[str, int] | None = None) -> str:
    """The selection rule (:data:`RULE`): the cheapest rule meeting ``target`` on every workload with scored
    versions and agreeing with exact on at least ``agree_floor[workload]`` versions of every workload (ties: the
    earlier rule). When no rule reaches ``target`` on every workload (a version no candidate follows fails
    them all alike), the target is the best worst-workload follow rate any rule reaches; when no rule that
    reaches it meets the floor, the most agreeing of them (then the cheaper) is chosen.

    Args:
        by_workload: workload -> rule name -> ``{"follows", "n", ...}`` (workloads with ``n == 0`` for every
            rule are ignored).
        grid: rule name -> ``{"recompute_tokens_mean", "agree", ...}`` over all workloads (the cost, and the
            versions whose greedy continuation equals exact's).
        target: the least follow rate, in ``[0, 1]``.
        agree_floor: workload -> the least ``agree`` count there (the stage passes the built-in rule's: a
            follow rate that cannot tell rules apart on few episodes must not switch off what exact's
            continuation needs on some shape), or None (no condition).
    Returns:
        The chosen rule's name.
    Raises:
        ValueError: an empty grid, workloads over other rules than the grid's, counts out of range, or a bad
            target.
    """
    target = _check_target(target)
    names = list(grid)
    if not names:
        raise ValueError("the reader rule grid is empty: nothing to choose from")
    for wl, g in by_workload.items():
        if set(g) != set(names):
            raise ValueError(f"workload {wl!r} holds other rules than the grid: {sorted(g)} vs {sorted(names)}")
        for name, row in g.items():
            if not 0 <= row["follows"] <= row["n"]:
                raise ValueError(f"{wl} / {name}: need 0 <= follows <= n, got {row['follows']!r} of {row['n']!r}")
    order = {n: i for i, n in enumerate(names)}
    cost = {n: float(grid[n]["recompute_tokens_mean"]) for n in names}
    agree = {n: int(grid[n].get("agree", 0)) for n in names}

    def agrees(n: str) -> bool:
        return agree_floor is None or all(by_workload[wl][n].get("agree", 0) >= f for wl, f in agree_floor.items())

    def worst(n: str) -> float:
        rates = [g[n]["follows"] / g[n]["n"] for g in by_workload.values() if g[n]["n"]]
        return min(rates) if rates else 1.0

    # a version that no candidate follows fails every rule alike: the target is at most what some rule reaches
    reach = min(target, max(worst(n) for n in names))
    follow = [n for n in names if _all_meet(by_workload, n, reach)]
    meets = [n for n in follow if agrees(n)]
    if meets:
        return min(meets, key=lambda n: (cost[n], order[n]))
    return min(follow, key=lambda n: (-agree[n], cost[n], order[n]))


def with_reader_rule(profile: Mapping[str, Any], selection: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a profile dict with the chosen rule: ``readers`` (``"none"`` for ``off``, else
    ``"lexical"``), ``reader_rule`` (the constants; absent for ``off``) and ``reader_rule_selection``, placed
    after ``readers`` (else ``block_size``). A selection without a choice (a skipped stage) only adds its record.

    Args:
        profile: a profile dict.
        selection: from :func:`select_reader_rule` (plus provenance), or a record of a skipped stage.
    Returns:
        The new dict (``profile`` is left as it was).
    """
    rule = selection.get("chosen_rule") if selection.get("chosen") is not None else None
    extra: dict[str, Any] = {}
    if rule is not None:
        extra["readers"] = "none" if rule["name"] == OFF else "lexical"
        if rule["name"] != OFF:
            extra["reader_rule"] = {k: rule[k] for k in _KEYS}
    extra["reader_rule_selection"] = dict(selection)
    anchor = "readers" if "readers" in profile else "block_size"
    out: dict[str, Any] = {}
    for key, value in profile.items():
        if key in ("reader_rule", "reader_rule_selection") or (key == "readers" and "readers" in extra):
            if key == "readers":
                out.update(extra)
            continue
        out[key] = value
        if key == anchor and anchor != "readers":
            out.update(extra)
    if "reader_rule_selection" not in out:
        out.update(extra)
    return out
