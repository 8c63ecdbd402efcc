"""The agent stage of calibration: the recency window ``recent_window`` (``W``) chosen by next-action agreement.

Boundary: one opt-in stage of ``patchkv-agent calibrate`` (``--agent-workloads``). It builds agent-workload
episodes (:func:`agent_traces`: LangChain's middlewares editing agent histories,
:func:`patchkv_agent.eval.episodes.build_workload_traces`), resumes every edited version from the exact KV of
the call before it through the engine's public methods only (``checkpoint``, ``resume`` with ``exact`` and
:class:`~patchkv_agent.strategies.builtin.PatchKVStrategy` ``(recent_window=w)``, the rest of the settings
the engine's), scores each resume's next action against the exact one
(:func:`patchkv_agent.eval.metrics.next_action_agree`) and picks ``W`` by :func:`choose_window_every` (the target
on every workload). It returns
JSON-safe dicts; it writes no file and touches no other part of the profile (:func:`with_recent_window` puts
the choice into a profile dict, :mod:`.outputs` writes it).

Why a stage of its own: ``W`` recomputes the restored rows nearest the generation point, which an agent's
next tool call reads most; the QA pairs of the main stages (answers 8 tokens after a short question) do not
measure that, and 48-token greedy continuations of ~4k-token agent contexts are what makes this stage slow
(tens of minutes on a CPU for the default size), hence opt-in.

Episodes: :func:`agent_traces` builds ``skip + n`` episodes per workload and keeps the last ``n``, so they
are disjoint from a benchmark run's (``patchkv-agent bench`` takes the first ``--n`` episodes of each agent
workload) when its ``--n`` is at most ``skip`` at the same target tokens and seed.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable, Mapping, Sequence

__all__ = ["DEFAULT_WINDOWS", "DEFAULT_TARGET", "DEFAULT_SKIP", "DEFAULT_N", "DEFAULT_TARGET_TOKENS", "RULE",
           "FLOOR_RULE", "PLAN_RULE", "VARIANT_OPTIONS", "candidate_keys", "parse_target", "parse_variant",
           "choose_window", "choose_plan_every", "choose_window_every", "agent_traces", "select_recent_window", "with_recent_window"]

DEFAULT_WINDOWS: tuple[int, ...] = (0, 256, 512, 1024)
DEFAULT_TARGET = 0.95
DEFAULT_SKIP = 20
DEFAULT_N = 6
DEFAULT_TARGET_TOKENS = 4000
RULE = ("recency window W: the last recent_window tokens a plan would restore are recomputed; chosen: the smallest "
        "window whose next-action agreement with exact is >= target on every agent workload, else (none reaches it) "
        "the window of the highest worst-workload agreement, ties to the smaller window")


def _check_windows(windows: Sequence[int]) -> tuple[int, ...]:
    ws = tuple(windows)
    if not ws:
        raise ValueError("windows is empty; give one or more recency windows in tokens, e.g. (0, 256, 512)")
    for w in ws:
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"every window must be an int >= 0 (tokens), got {w!r}")
    return tuple(sorted(set(ws)))


def _check_target(target: float) -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 <= target <= 1.0:
        raise ValueError(f"target must be a number in [0, 1] (a share of agreeing resumes), got {target!r}")
    return float(target)


def _meets(agree: int, n: int, target: float) -> bool:
    """``agree / n >= target``, compared on counts so that 19 / 20 meets 0.95 whatever the float rounding."""
    return agree + 1e-9 >= target * n


def choose_window(grid: Mapping[Any, Mapping[str, Any]], target: float) -> int:
    """The selection rule: the smallest window whose agreement ``agree / n`` is at least ``target``; when
    none reaches it, the window with the highest agreement (ties: the smaller window).

    Args:
        grid: window (an int, or its ``str`` as in a JSON grid) -> ``{"agree": count, "n": resumes}``.
        target: the least agreement share, in ``[0, 1]``.
    Returns:
        The chosen window (tokens).
    Raises:
        ValueError: an empty grid, a key that is not a window, a row without resumes (``n < 1``) or with
            ``agree`` outside ``[0, n]``, or a target outside ``[0, 1]``.
    """
    target = _check_target(target)
    if not grid:
        raise ValueError("the window grid is empty: nothing to choose from")
    rows = []
    for key, row in grid.items():
        try:
            w = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"grid key {key!r} is not a window in tokens") from None
        if isinstance(key, bool) or w < 0 or str(w) != str(key).strip():
            raise ValueError(f"grid key {key!r} is not a window in tokens (an int >= 0)")
        a, n = row["agree"], row["n"]
        if n < 1 or not 0 <= a <= n:
            raise ValueError(f"window {w}: need n >= 1 and 0 <= agree <= n, got agree={a!r}, n={n!r}")
        rows.append((w, a, n))
    rows.sort()
    meets = [w for w, a, n in rows if _meets(a, n, target)]
    if meets:
        return meets[0]
    return min(rows, key=lambda r: (-(r[1] / r[2]), r[0]))[0]


def agent_traces(workload: str, *, n: int = DEFAULT_N, skip: int = DEFAULT_SKIP,
                 target_tokens: int = DEFAULT_TARGET_TOKENS, count_tokens: Callable | None = None,
                 seed: int = 0) -> list[dict]:
    """Calibration episodes of one agent workload: the last ``n`` of its first ``skip + n`` (the benchmark
    takes the first ``--n``, so these are disjoint from a run with ``--n <= skip`` at the same
    ``target_tokens`` and seed).

    Args:
        workload: one of :data:`patchkv_agent.eval.agent_workloads.AGENT_WORKLOADS`.
        n: episodes wanted (fewer when the histories run out).
        skip: leading episodes left to the benchmark.
        target_tokens: the largest version's tokens (at least 2,000; see ``build_workload_traces``).
        count_tokens: ``trace messages -> token count`` (the model's chat-template count), or None
            (LangChain's approximate count).
        seed: the builder's seed.
    Returns:
        Trace dicts (``docs/TRACES.md``), at most ``n``.
    Raises:
        ValueError: not an agent workload, ``n < 1`` or ``skip < 0``.
    """
    from patchkv_agent.eval.agent_workloads import AGENT_WORKLOADS
    from patchkv_agent.eval.episodes import build_workload_traces

    if workload not in AGENT_WORKLOADS:
        raise ValueError(f"unknown agent workload {workload!r}; choose from {list(AGENT_WORKLOADS)}")
    if n < 1 or skip < 0:
        raise ValueError(f"need n >= 1 and skip >= 0, got n={n}, skip={skip}")
    return build_workload_traces(workload, n=skip + n, target_tokens=target_tokens, count_tokens=count_tokens,
                                 seed=seed)[skip:]


def _scorer(engine) -> Callable[[Sequence[int], Sequence[int]], bool]:
    """``(output ids, exact output ids) -> same next action``: decoded text through
    :func:`~patchkv_agent.eval.metrics.next_action_agree`, or equal ids without a tokenizer."""
    from patchkv_agent.eval.metrics import next_action_agree

    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        return lambda out, ref: list(out) == list(ref)
    return lambda out, ref: next_action_agree(tok.decode(list(out), skip_special_tokens=True),
                                              tok.decode(list(ref), skip_special_tokens=True))


VARIANT_OPTIONS: tuple[str, ...] = ("kappa", "rewrite_share", "readers", "reader_min_share", "reader_min_blocks",
                                    "reader_attention_blocks", "reader_budget", "tail_check_layer", "tail_threshold",
                                    "head_tokens")
"""The plan options a variant candidate may set (:func:`parse_variant`): the head-rewrite rule (its share and its
near-head window ``head_tokens``), kappa, the reader rule and the measured tail rule's check layer with its threshold
(a deviation's scale grows with depth, so a deeper layer needs its own threshold), which a profile records (the window
and the small-restore share have candidates of their own)."""


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """A plan variant candidate ``key=value[:key=value...]`` (e.g. ``rewrite_share=0.5``, ``kappa=0.02``,
    ``readers=none``, ``reader_budget=0.1:reader_min_blocks=2``): its canonical spec (keys sorted) and options.

    Args:
        spec: the variant, in the bench's strategy-option syntax (``patchkv:<spec>`` is the same strategy).

    Returns:
        ``(canonical spec, {option: value})``; values read as an int, else a float, else a string.

    Raises:
        ValueError: an empty spec, a pair that is not ``key=value``, a repeated key, a key outside
            :data:`VARIANT_OPTIONS`, or a value :class:`~patchkv_agent.strategies.builtin.PatchKVStrategy` refuses.
    """
    from patchkv_agent.strategies.base import _option_value
    from patchkv_agent.strategies.builtin import PatchKVStrategy

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a variant is key=value[:key=value...] with keys from {list(VARIANT_OPTIONS)}, got {spec!r}")
    opts: dict[str, Any] = {}
    for pair in spec.strip().split(":"):
        key, eq, value = (x.strip() for x in pair.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"variant {spec!r}: {pair!r} is not key=value")
        if key not in VARIANT_OPTIONS:
            raise ValueError(f"variant {spec!r}: {key!r} is not a variant option; choose from {list(VARIANT_OPTIONS)} "
                             "(windows and small-restore shares have candidates of their own)")
        if key in opts:
            raise ValueError(f"variant {spec!r}: {key!r} is given twice")
        opts[key] = _option_value(value)
    try:
        PatchKVStrategy(**opts)  # the strategy's own type and range checks
    except (TypeError, ValueError) as e:
        raise ValueError(f"variant {spec!r}: {e}") from None
    return ":".join(f"{k}={opts[k]}" for k in sorted(opts)), {k: opts[k] for k in sorted(opts)}


def _check_variants(variants: Sequence[str]) -> tuple[tuple[str, dict[str, Any]], ...]:
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        name, opts = parse_variant(v)
        out.setdefault(name, opts)
    return tuple(out.items())


def _settings_record(engine) -> dict[str, Any]:
    """The engine's plan settings the stage ran under. It varies ``recent_window`` and ``tail_threshold`` (window
    candidates run with 0, tail candidates with theirs) and, when given share candidates, ``min_restore_share``:
    their entries here are the engine's own."""
    s = engine.settings
    return {"length_model": s.length_model.to_dict(), "kappa": float(s.kappa), "block_size": int(s.block_size),
            "readers": str(s.readers), "reader_budget": float(s.reader_budget),
            "rewrite_share": float(s.rewrite_share), "min_restore_share": float(s.min_restore_share),
            "tail_threshold": float(s.tail_threshold), "tail_check_layer": int(s.tail_check_layer),
            "mixed_precision": bool(s.mixed_precision)}


FLOOR_RULE = ("recency window W: the smallest window whose next-action agreement with exact is at least the "
              "noise floor's (an accepted approximation of exact, e.g. a bf16 KV cache, run on the same calls) on "
              "every agent workload, else the window closest to it on the worst workload, ties to the smaller")


def parse_target(target: "float | str") -> "tuple[float | None, str | None]":
    """``--agent-target``: a share in [0, 1] (``(share, None)``) or ``floor:<name>`` (``(None, name)``: the
    agreement of that noise floor on the same calls, :mod:`patchkv_agent.eval.noise_floor`).

    Raises:
        ValueError: neither.
    """
    if isinstance(target, str) and target.startswith("floor:"):
        from patchkv_agent.eval.noise_floor import parse_floors

        (name,) = parse_floors(target[len("floor:"):]) or (None,)
        if name is None:
            raise ValueError("floor: needs a noise floor's name, e.g. floor:kv-bf16")
        return None, name
    try:
        return _check_target(float(target) if isinstance(target, str) else target), None
    except (TypeError, ValueError):
        raise ValueError(f"target must be a share in [0, 1] or floor:<name> (e.g. floor:kv-bf16), got {target!r}") from None


def select_recent_window(engine, traces: Sequence[dict], windows: Sequence[int] = DEFAULT_WINDOWS,
                         target: "float | str" = DEFAULT_TARGET, max_new_tokens: int = 48, progress: bool = True,
                         rows: list | None = None, thresholds: Sequence[float] = (),
                         min_restore_shares: Sequence[float] = (), variants: Sequence[str] = (),
                         tail_windows: Sequence[int] = (), variant_base: str | None = None) -> dict[str, Any]:
    """Measure next-action agreement with exact per recency window on agent traces and choose ``W``.

    For every version ``k >= 1`` of each trace, the base is ``engine.checkpoint(ids[k-1])`` (the exact KV
    of the call before); ``ids[k]`` is resumed with ``PatchKVStrategy(recent_window=w)`` for each window
    (the engine's other settings) and with ``exact`` (the reference), ``max_new_tokens`` greedy tokens
    each. Only versions whose plan at ``w=0`` restores rows are scored: the others are exact at every
    window (append-only calls, head rewrites). Once a window's plan restores nothing, every larger window
    plans the same full recompute; its resume is reused (``reused`` in the rows), not rerun.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine` (its ``settings`` apply, but for
            ``recent_window``).
        traces: trace dicts with two or more versions each (``token_ids``, ``messages`` or ``text``).
        windows: recency windows in tokens (ints >= 0; sorted, duplicates dropped).
        target: the least agreement share for the rule of :func:`choose_window`, or ``"floor:<name>"``: per
            workload, the agreement of that noise floor (``kv-bf16``: a bf16 KV cache) on the same scored
            versions (:data:`FLOOR_RULE`; the result records ``floor`` and ``floor_by_workload``).
        max_new_tokens: greedy tokens per resume (48: an agent's next tool call).
        progress: a tqdm bar on stderr.
        rows: if given, one dict per scored version is appended (id, version, sizes, per-window results).
        thresholds: measured tail rule candidates (``tail_threshold`` values > 0): each also runs at the largest
            window, or at each of ``tail_windows`` (key ``"<window>@<threshold>"`` in the grids). With any, the
            choice is the candidate of least cost (pooled mean of ``cost_rows``: recomputed rows plus each probed
            row at its share of the layers, ``(tail_check_layer + 1) / num_layers``) that meets the target on every
            workload (:func:`choose_plan_every`), and ``chosen_tail_threshold`` says its threshold (0.0: a fixed
            window).
        min_restore_shares: small-restore rule candidates (``min_restore_share`` values in ``[0, 1]``): with any,
            every threshold candidate runs at each of them (key ``"<window>@<threshold>/r<share>"``) instead of
            at the engine's setting, and ``chosen_min_restore_share`` says the chosen one (None: the engine's).
        variants: plan variant candidates (:func:`parse_variant`: the head-rewrite share, kappa, the reader rule,
            the tail rule's check layer and threshold): each runs at the plan of ``variant_base`` (by default the
            engine's own: the largest window with the engine's tail rule and small-restore share), the rest of the
            engine's settings overridden by its options (key ``"<base>|<spec>"``, where ``<base>`` is that plan's
            own key, which runs too); ``chosen_variant`` and ``chosen_variant_options`` say the chosen one (None:
            a candidate without variant options), and a chosen variant's ``tail_threshold`` is the
            ``chosen_tail_threshold``. With a ``rewrite_share`` variant, the versions scored are those
            whose plan at ``recent_window=0`` restores rows with the head-rewrite rule off (a head rewrite under the
            engine's share is scored too: as exact, at prefix's rows, for the candidates that keep that share).
        tail_windows: the windows the threshold candidates probe (ints > 0; empty: the largest of ``windows``). A
            window at least as long as the context probes every restored row of the suffix, so the blocks the
            probe recomputes may lie anywhere after the edit, not only in the last ``window`` tokens.
        variant_base: the candidate key the variants run at, one of the window and threshold candidates' keys (e.g.
            ``"1024@0.02/r0.5"``), so that variants of a probed plan can be tried while the engine's profile ships a
            fixed window; None: the engine's own plan.
    Returns:
        ``{"rule", "chosen", "chosen_tail_threshold", "tail_windows", "target", "target_met", "by",
        "grid": {key: {"agree", "n", "share", "recompute_tokens_mean", "cost_rows_mean"}}, "grid_by_workload",
        "prefix_recompute_tokens_mean", "n_versions", "n_scored", "workloads", "episodes", "settings",
        "max_new_tokens"}`` (JSON-safe); a row's candidate results hold ``probe_tokens`` and ``cost_rows`` too.
    Raises:
        ValueError: bad windows, target or ``max_new_tokens``; no traces; a ``variant_base`` without variants or
            that is not a candidate key; or no version whose plan at ``recent_window=0`` restores rows (nothing to
            choose by).
    """
    from tqdm import tqdm

    from patchkv_agent.eval.traces import version_ids
    from patchkv_agent.strategies.builtin import PatchKVStrategy

    ws = _check_windows(windows)
    taus = _check_thresholds(thresholds)
    tws = _check_tail_windows(tail_windows, ws, taus)
    shares = _check_shares(min_restore_shares)
    if shares and not taus:
        raise ValueError("min_restore_shares are candidates of the measured tail rule: give thresholds too")
    vs = _check_variants(variants)
    keys = _candidate_keys(ws, taus, shares, tws)
    base = None
    if variant_base is not None and (not vs or str(variant_base) not in keys):
        raise ValueError(f"variant_base {variant_base!r} must be one of this stage's candidate keys {keys} and needs "
                         "variants to run at it")
    if vs:  # the base plan (variant_base, else the engine's own at the largest window), and each variant of it
        if variant_base is not None:
            base = str(variant_base)
        else:
            t0, m0 = float(engine.settings.tail_threshold), float(engine.settings.min_restore_share)
            base = str(ws[-1]) if t0 == 0 else _key(ws[-1], t0, m0 if shares else None)
        keys += [base] * (base not in keys) + [f"{base}|{name}" for name, _ in vs]
    target, floor = parse_target(target)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    traces = list(traces)
    if not traces:
        raise ValueError("no agent traces to calibrate the recency window on")
    agree_fn = _scorer(engine)
    scored: list[dict] = []
    n_versions = sum(max(0, len(tr["versions"]) - 1) for tr in traces)
    with tqdm(total=n_versions, desc="recent_window", unit="version", file=sys.stderr, disable=not progress) as bar:
        for tr in traces:
            ids = [version_ids(engine, v) for v in tr["versions"]]
            for k in range(1, len(ids)):
                row = _score_version(engine, PatchKVStrategy, agree_fn, tr, k, ids, ws, max_new_tokens, floor, taus,
                                     shares, base, vs, tws)
                bar.update(1)
                if row is None:
                    continue
                scored.append(row)
                if rows is not None:
                    rows.append(row)
                bar.set_postfix_str(" ".join(f"{c}:{sum(r['results'][c]['agree'] for r in scored)}"
                                             f"/{len(scored)}" for c in keys))
    if not scored:
        raise ValueError(f"none of the {n_versions} versions of {len(traces)} agent traces restores rows at "
                         "recent_window=0 (each resume is exact at every window): nothing to choose the window "
                         "by; use more or longer episodes")
    grid = _grid(scored, keys)
    workloads = sorted({str(tr.get("workload", "")) for tr in traces})
    by_workload = {wl: _grid([r for r in scored if r["workload"] == wl], keys) for wl in workloads
                   if any(r["workload"] == wl for r in scored)}
    floor_by: dict[str, dict[str, Any]] = {}
    if floor is not None:
        for wl in by_workload:
            rs = [r for r in scored if r["workload"] == wl]
            a = sum(1 for r in rs if r["floor_agree"])
            floor_by[wl] = {"agree": a, "n": len(rs), "share": a / len(rs)}
        targets: Any = {wl: g["share"] for wl, g in floor_by.items()}
    else:
        targets = target
    share = None
    if taus or vs:
        key = choose_plan_every(by_workload, targets, grid)
        chosen, tau, share = _parse_key(key)
        tau = float(dict(vs).get(_variant_of(key) or "", {}).get("tail_threshold", tau))
    else:
        chosen, tau = choose_window_every(by_workload, targets), 0.0
        key = str(chosen)
    tgt = targets if isinstance(targets, dict) else dict.fromkeys(by_workload, targets)
    return {
        "rule": (PLAN_RULE if taus or vs else "") + (FLOOR_RULE if floor is not None else RULE), "chosen": chosen,
        "chosen_tail_threshold": tau, "thresholds": list(taus), "tail_windows": list(tws),
        "chosen_min_restore_share": share, "min_restore_shares": list(shares),
        "chosen_variant": _variant_of(key) if vs else None,
        "chosen_variant_options": dict(vs)[_variant_of(key)] if vs and _variant_of(key) else None,
        "variants": [name for name, _ in vs],
        "target": f"floor:{floor}" if floor is not None else target,
        "floor": floor, "floor_by_workload": floor_by or None,
        "target_met": all(_meets(g[key]["agree"], g[key]["n"], tgt[wl]) for wl, g in by_workload.items()),
        "by": (f"next-action agreement with exact (the first tool call, else the text, of {max_new_tokens} greedy "
               "tokens) on the agent versions whose patchkv plan at recent_window=0 restores rows, each resumed "
               "from the exact KV of the call before it"),
        "grid": grid,
        "grid_by_workload": by_workload,
        "prefix_recompute_tokens_mean": statistics.fmean(r["prefix_recompute_tokens"] for r in scored),
        "n_versions": n_versions, "n_scored": len(scored), "workloads": workloads,
        "episodes": [str(tr.get("id")) for tr in traces], "settings": _settings_record(engine),
        "max_new_tokens": max_new_tokens,
    }


def _score_version(engine, strategy_cls, agree_fn, tr: dict, k: int, ids: list, ws: tuple[int, ...],
                   max_new_tokens: int, floor: str | None = None, taus: tuple[float, ...] = (),
                   shares: tuple[float, ...] = (), base: str | None = None,
                   variants: tuple[tuple[str, dict], ...] = (), tail_windows: tuple[int, ...] = ()) -> dict | None:
    """One version's row, or None when its plan at ``recent_window=0`` restores nothing."""
    new = ids[k]
    ckpt = engine.checkpoint(ids[k - 1])
    # the window candidates are fixed windows (tail_threshold 0), whatever the engine's profile sets. With a variant
    # of the head-rewrite share, whether a version is scored is asked with the rule off: the versions it turns into
    # full recomputes (a summarized head) are the ones such a variant changes
    probe = {"rewrite_share": 1.0} if any("rewrite_share" in o for _, o in variants) else {}
    first = engine.resume(ckpt, new, strategy=strategy_cls(recent_window=0, tail_threshold=0.0, **probe),
                          max_new_tokens=max_new_tokens if ws[0] == 0 and not probe else 0)
    st = first.stats
    if st["restore_tokens"] <= 0:
        return None
    ref = list(engine.resume(None, new, strategy="exact", max_new_tokens=max_new_tokens).output_ids)
    results: dict[str, dict] = {}
    prev: dict | None = None
    for w in ws:
        if w == 0 and not probe:
            out, s, reused = list(first.output_ids), st, False
        elif prev is not None and prev["restore_tokens"] == 0:
            out, s, reused = prev["_out"], prev, True  # the same full-recompute plan as the smaller window
        else:
            res = engine.resume(ckpt, new, strategy=strategy_cls(recent_window=w, tail_threshold=0.0),
                                max_new_tokens=max_new_tokens)
            out, s, reused = list(res.output_ids), res.stats, False
            del res
        prev = {"agree": bool(agree_fn(out, ref)), "recompute_tokens": int(s["recompute_tokens"]),
                "restore_tokens": int(s["restore_tokens"]), "reused": reused, "probe_tokens": 0,
                "cost_rows": int(s["recompute_tokens"]), "_out": out}  # a fixed window probes nothing
        results[str(w)] = {k_: v for k_, v in prev.items() if not k_.startswith("_")}

    def run(**options) -> dict:
        """One candidate's result: ``strategy_cls(**options)`` resumed and scored against exact."""
        res = engine.resume(ckpt, new, strategy=strategy_cls(**options), max_new_tokens=max_new_tokens)
        probe = int(res.stats.get("tail_probe_tokens") or 0)
        # a probed row runs through tail_check_layer + 1 of the layers: its share of a recomputed row's cost
        check = int(options.get("tail_check_layer", engine.settings.tail_check_layer))
        probe_share = (check + 1) / max(1, int(engine.spec.num_layers))
        return {"agree": bool(agree_fn(list(res.output_ids), ref)),
                "recompute_tokens": int(res.stats["recompute_tokens"]),
                "restore_tokens": int(res.stats["restore_tokens"]), "reused": False, "probe_tokens": probe,
                "cost_rows": int(res.stats["recompute_tokens"]) + probe * probe_share}

    for tw in tail_windows or ws[-1:]:  # the measured tail rule at its windows (at each small-restore share, if given)
        for t in taus:
            for m in shares or (None,):
                opts = {} if m is None else {"min_restore_share": m}
                results[_key(tw, t, m)] = run(recent_window=tw, tail_threshold=t, **opts)
    if base is not None:  # the variants' base plan, then each variant of it
        w0, t0, m0 = _parse_key(base)
        plan = {"recent_window": w0, "tail_threshold": t0, "min_restore_share": engine.settings.min_restore_share
                if m0 is None else m0}
        for key, opts in ([(base, {})] if base not in results else []) + [(f"{base}|{n}", o) for n, o in variants]:
            results[key] = run(**{**plan, **opts})  # a variant may re-set the tail rule
    del first, ckpt
    floor_agree = None
    if floor is not None:
        from patchkv_agent.eval.noise_floor import run_floor

        fr = run_floor(engine.model, new, floor, max_new_tokens=max_new_tokens, eos_ids=engine.eos_ids)
        floor_agree = bool(agree_fn(list(fr.output_ids), ref))
    edit = (tr["versions"][k].get("edit") if isinstance(tr["versions"][k], dict) else None)
    return {"id": str(tr.get("id")), "workload": str(tr.get("workload", "")), "version": k,
            "edit": None if edit is None else str(edit), "old_tokens": len(ids[k - 1]), "new_tokens": len(new),
            "prefix_tokens": int(st["prefix_tokens"]), "suffix_tokens": int(st["suffix_tokens"]),
            "prefix_recompute_tokens": len(new) - int(st["prefix_tokens"]), "results": results,
            "floor_agree": floor_agree}


def _targets(grids: Mapping[str, Any], target: "float | Mapping[str, float]") -> dict[str, float]:
    """One checked target per workload of ``grids`` (a share for all, or a mapping that must name each)."""
    if not grids:
        raise ValueError("no workload grids: nothing to choose from")
    if isinstance(target, Mapping):
        missing = [wl for wl in grids if wl not in target]
        if missing:
            raise ValueError(f"no target for workload(s) {missing}")
        return {wl: _check_target(target[wl]) for wl in grids}
    return dict.fromkeys(grids, _check_target(target))


def choose_window_every(grids: Mapping[str, Mapping[Any, Mapping[str, Any]]],
                        target: "float | Mapping[str, float]") -> int:
    """:func:`choose_window` over several workloads: the smallest window whose agreement reaches ``target`` on
    *every* workload (the targets are per workload: a pooled share lets an easy workload hide a hard one);
    when none does, the window with the highest worst-workload share (ties: the smaller window).

    Args:
        grids: workload -> its grid (as for :func:`choose_window`); every grid must hold the same windows.
        target: the least agreement share, in ``[0, 1]``, or one per workload (e.g. a noise floor's share on
            that workload's calls).
    Returns:
        The chosen window (tokens).
    Raises:
        ValueError: no grids, grids over different windows, a workload without a target, or a bad grid or
            target (:func:`choose_window`).
    """
    targets = _targets(grids, target)
    per: dict[str, dict[int, tuple[int, int]]] = {}
    for wl, grid in grids.items():
        choose_window(grid, targets[wl])  # validates the grid
        per[wl] = {int(k): (row["agree"], row["n"]) for k, row in grid.items()}
    windows = set(next(iter(per.values())))
    if any(set(g) != windows for g in per.values()):
        raise ValueError(f"the workloads' grids hold different windows: {[sorted(g) for g in per.values()]}")
    meets = [w for w in sorted(windows) if all(_meets(*per[wl][w], targets[wl]) for wl in per)]
    if meets:
        return meets[0]
    # none meets: the window closest to its targets on the worst workload
    return min(sorted(windows), key=lambda w: (-min(per[wl][w][0] / per[wl][w][1] - targets[wl] for wl in per), w))


PLAN_RULE = ("candidates: recency windows and measured tail thresholds at the largest window or at each tail window "
             "(each at every small-restore share, when shares are given), and plan variants (head-rewrite share, "
             "kappa, reader rule) of the engine's plan at the largest window, when given; chosen: the candidate of "
             "least cost (recomputed rows plus probed rows at their share of the layers, mean over the scored "
             "versions) that meets the target on every workload, else "
             "the one closest to it on the worst workload. Per candidate: ")


def _candidates(values: Sequence[float], ok, what: str) -> tuple[float, ...]:
    """Numeric candidates, each checked by ``ok`` (else ``ValueError("every <what>, got <value>")``), sorted and
    without duplicates."""
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise ValueError(f"every {what}, got {v!r}")
        out.append(float(v))
    return tuple(sorted(set(out)))


def _check_thresholds(thresholds: Sequence[float]) -> tuple[float, ...]:
    return _candidates(thresholds, lambda t: 0 < t < float("inf"),
                       "tail threshold must be a finite number > 0 (0 is the fixed window)")


def _check_tail_windows(tail_windows: Sequence[int], windows: tuple[int, ...],
                        taus: tuple[float, ...]) -> tuple[int, ...]:
    """The threshold candidates' windows: ``tail_windows`` checked (ints > 0, sorted, no duplicates), or the largest
    window; given without thresholds, a ``ValueError`` (they would run nothing)."""
    if not tail_windows:
        return windows[-1:]
    if not taus:
        raise ValueError("tail_windows are the windows of the measured tail rule's candidates: give thresholds too")
    for w in tail_windows:
        if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
            raise ValueError(f"every tail window must be an int > 0 (tokens), got {w!r}")
    return tuple(sorted(set(tail_windows)))


def _check_shares(shares: Sequence[float]) -> tuple[float, ...]:
    return _candidates(shares, lambda m: 0 <= m <= 1, "min_restore_share candidate must be a number in [0, 1]")


def _candidate_keys(ws: Sequence[int], taus: Sequence[float], shares: Sequence[float],
                    tws: Sequence[int]) -> list[str]:
    """The window and threshold candidates' keys, in the order the stage runs them."""
    return [str(w) for w in ws] + [_key(w, t, m) for w in tws for t in taus for m in (shares or (None,))]


def candidate_keys(windows: Sequence[int], thresholds: Sequence[float] = (), min_restore_shares: Sequence[float] = (),
                   tail_windows: Sequence[int] = ()) -> list[str]:
    """The keys of the window and threshold candidates :func:`select_recent_window` runs for these arguments (what a
    ``variant_base`` may name), e.g. ``["0", "1024", "1024@0.02/r0.5"]``.

    Raises:
        ValueError: the arguments :func:`select_recent_window` refuses.
    """
    ws, taus = _check_windows(windows), _check_thresholds(thresholds)
    return _candidate_keys(ws, taus, _check_shares(min_restore_shares), _check_tail_windows(tail_windows, ws, taus))


def _key(window: int, threshold: float, share: float | None = None) -> str:
    return f"{int(window)}@{threshold:g}" + ("" if share is None else f"/r{share:g}")


def _parse_key(key: str) -> tuple[int, float, float | None]:
    """``(window, threshold, min_restore_share)`` of a candidate key (0.0: a fixed window; None: the engine's
    share); a variant's ``|<spec>`` is not part of it (:func:`_variant_of`)."""
    head, _, share = str(key).partition("|")[0].partition("/r")
    w, _, t = head.partition("@")
    return int(w), float(t) if t else 0.0, float(share) if share else None


def _variant_of(key: str) -> str | None:
    """The variant spec of a candidate key (None: no variant)."""
    return str(key).partition("|")[2] or None


def choose_plan_every(grids: Mapping[str, Mapping[str, Mapping[str, Any]]], target: "float | Mapping[str, float]",
                      pooled: Mapping[str, Mapping[str, Any]]) -> str:
    """The cheapest candidate that meets the target on every workload: of those, the least cost
    (``pooled[key]["cost_rows_mean"]``, recomputed rows plus probed rows at their share of the layers; without it,
    ``recompute_tokens_mean``; ties: the earlier key); when none meets it, the candidate with the
    highest worst-workload margin ``share - target`` (ties: fewer rows).

    Args:
        grids: workload -> {candidate key -> ``{"agree", "n"}``}; every grid must hold the same keys.
        target: the least agreement share, or one per workload.
        pooled: candidate key -> ``{"cost_rows_mean"}`` (or ``{"recompute_tokens_mean"}``) over every workload.
    Returns:
        The chosen key (``"<window>"`` or ``"<window>@<threshold>"``).
    Raises:
        ValueError: no grids, grids over different keys, a workload without a target, a bad target, or a row
            without resumes.
    """
    targets = _targets(grids, target)
    keys = list(next(iter(grids.values())))
    if any(list(g) != keys for g in grids.values()):
        raise ValueError("the workloads' grids hold different candidates")
    for g in grids.values():
        for key, row in g.items():
            if row["n"] < 1 or not 0 <= row["agree"] <= row["n"]:
                raise ValueError(f"candidate {key}: bad row {dict(row)}")
    cost = {key: (float(pooled[key].get("cost_rows_mean", pooled[key]["recompute_tokens_mean"])), i)
            for i, key in enumerate(keys)}
    meets = [key for key in keys if all(_meets(g[key]["agree"], g[key]["n"], targets[wl]) for wl, g in grids.items())]
    if meets:
        return min(meets, key=cost.__getitem__)
    return min(keys, key=lambda key: (-min(g[key]["agree"] / g[key]["n"] - targets[wl] for wl, g in grids.items()),
                                      cost[key]))


def _grid(scored: Sequence[dict], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for key in keys:
        rs = [r["results"][key] for r in scored]
        a = sum(1 for x in rs if x["agree"])
        out[key] = {"agree": a, "n": len(rs), "share": a / len(rs),
                    "recompute_tokens_mean": statistics.fmean(x["recompute_tokens"] for x in rs),
                    "cost_rows_mean": statistics.fmean(x["cost_rows"] for x in rs)}
    return out


def with_recent_window(profile: Mapping[str, Any], selection: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a profile dict with ``recent_window`` (``selection["chosen"]``; left out when it is None)
    and ``recent_window_selection`` set, placed after ``readers`` (else ``block_size``) like the shipped
    profile's. A chosen plan variant's options (``chosen_variant_options``) go where a profile keeps them:
    ``kappa``, ``readers`` and ``rewrite_share`` at the top level, the reader rule's constants in ``reader_rule``.

    Args:
        profile: a profile dict (as :func:`.profile.run_calibration` returns it).
        selection: from :func:`select_recent_window` (plus provenance), or a record of a skipped stage.
    Returns:
        The new dict (``profile`` is left as it was).
    """
    anchor = "readers" if "readers" in profile else "block_size"
    out: dict[str, Any] = {}
    extra = {"recent_window_selection": dict(selection)}
    if selection.get("chosen") is not None:
        tail = {"tail_threshold": float(selection["chosen_tail_threshold"])} if selection.get("thresholds") else {}
        if selection.get("chosen_min_restore_share") is not None:
            tail["min_restore_share"] = float(selection["chosen_min_restore_share"])
        extra = {"recent_window": int(selection["chosen"]), **tail, **extra}
    for key, value in profile.items():
        if key in ("recent_window", "recent_window_selection") or (key in ("tail_threshold", "min_restore_share")
                                                                   and key in extra):
            continue
        out[key] = value
        if key == anchor:
            out.update(extra)
    if "recent_window_selection" not in out:
        out.update(extra)
    opts = selection.get("chosen_variant_options") if selection.get("chosen") is not None else None
    if opts:
        from patchkv_agent.profiles import READER_RULE_KEYS

        rule_key = {field: short for short, field in READER_RULE_KEYS.items()}
        rule = dict(out.get("reader_rule") or {})
        for k, v in opts.items():
            if k in rule_key:
                rule[rule_key[k]] = v
            else:
                out[k] = v
        if rule:
            out["reader_rule"] = rule
    return out
