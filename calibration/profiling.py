"""The profiling step: paired exact prefills of every episode's versions -> drift per edited span ->
the oracle boundary ``d*`` of each span (the labels of the length model).

Boundary: drives a :class:`~patchkv_agent.engine.PatchKVEngine` through its public methods only
(``resume(None, ids, strategy="exact")``, ``checkpoint_from``; its tokenizer for traces and answers);
:class:`~.config.PairProfile` records and label rows out. Per episode (a chain of context versions of
one task) every version is prefilled exactly once (``exact`` resume, which also gives the greedy
reference continuation); its checkpoint for the next pair is taken with ``checkpoint_from`` (attention
statistics from a short tail pass). For each adjacent pair the stale suffix values (old version) are
compared with the exact new ones: per edited span one :class:`~.drift.SpanDrift` and its oracle boundary
``d*`` (the numbers live in :mod:`.drift`). Does not fit, resume with a repair strategy, select or write.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.eval.traces import version_ids

from .config import CalibConfig, Episode, PairProfile
from .drift import SpanDrift, block_deviation, default_profile_layers, oracle_boundary, span_drift

__all__ = ["episodes_from_traces", "profile_episodes", "label_spans"]


def _answered(engine, output_ids: Sequence[int], gold: Sequence[str] | None) -> bool | None:
    from patchkv_agent.eval.metrics import answer_match

    if gold is None or engine.tokenizer is None:
        return None
    return bool(answer_match(engine.tokenizer.decode(list(output_ids), skip_special_tokens=True), list(gold)))


def episodes_from_traces(engine, traces: Sequence[dict]) -> list[Episode]:
    """Episodes from traces (``docs/TRACES.md``) (versions tokenized with the engine's chat template).

    Args:
        engine: the engine (its tokenizer renders ``messages``/``text`` versions).
        traces: trace dicts (e.g. :func:`patchkv_agent.eval.workloads.build_traces`).
    Returns:
        One :class:`Episode` per trace; ``task`` = ``<workload>/<source id>`` (from ``meta.source_id``,
        else the trace id without its edit kind), so edit kinds of one example share a task; ``answers``
        from the versions' own ``answers`` when every version has them (edit-following traces).
    """
    out = []
    for t in traces:
        meta = t.get("meta") or {}
        wl = str(t.get("workload") or "default")
        task = f"{wl}/{meta['source_id']}" if "source_id" in meta else str(t["id"]).rsplit("/", 1)[0]
        per = [v.get("answers") for v in t["versions"]]
        answers = tuple(tuple(str(a) for a in g) for g in per) if all(per) else None
        out.append(Episode(id=str(t["id"]), task=task, workload=wl, answers=answers,
                           versions=tuple(tuple(version_ids(engine, v)) for v in t["versions"])))
    return out


def _pair_d_star(sd: SpanDrift, cfg: CalibConfig) -> int:
    bd = block_deviation(sd.deviation, cfg.profile_block, cfg.block_reduce)
    return oracle_boundary(bd, block_size=cfg.profile_block, suffix_len=sd.suffix_len, tau_v=cfg.tau_v,
                           gamma=cfg.gamma)


@torch.no_grad()
def profile_episodes(engine, episodes: Sequence[Episode], cfg: CalibConfig, keep_tasks: set[str] = frozenset(),
                     bar=None) -> list[PairProfile]:
    """Paired exact prefills and drift per edited span, for every adjacent version pair.

    Args:
        engine: the engine.
        episodes: the episodes.
        cfg: the run's configuration (``layers``, ``metric``, ``ref_tokens``).
        keep_tasks: tasks whose pairs keep their checkpoint and reference for :func:`evaluate_grid`.
        bar: optional progress bar (``update(1)`` per prefilled version).
    Returns:
        The :class:`PairProfile` list, in episode order.
    """
    layers = cfg.layers or default_profile_layers(engine.spec.num_layers)
    out = []
    for ep in episodes:
        prev_ckpt = None
        n_ref = cfg.ref_tokens if ep.answers is None else max(cfg.ref_tokens, cfg.follow_tokens)
        for k, ids in enumerate(ep.versions):
            res = engine.resume(None, list(ids), strategy="exact", max_new_tokens=n_ref)
            if prev_ckpt is not None:
                edit = diff_versions(prev_ckpt.token_ids, res.context_ids)
                spans = span_drift(edit, prev_ckpt.values, res.values, layers=layers, metric=cfg.metric)
                keep = ep.task in keep_tasks
                gold, old = (None, None) if ep.answers is None else (ep.answers[k], ep.answers[k - 1])
                out.append(PairProfile(
                    pair_id=f"{ep.id}#v{k}", task=ep.task, workload=ep.workload, spans=spans,
                    new_ids=np.asarray(ids, dtype=np.int64), ckpt=prev_ckpt if keep else None,
                    ref_logits=res.logits.detach().cpu() if keep else None,
                    ref_output_ids=list(res.output_ids) if keep else [], answers=gold, old_answers=old,
                    exact_follows=_answered(engine, res.output_ids, gold),
                    exact_stale=_answered(engine, res.output_ids, old)))
            prev_ckpt = engine.checkpoint_from(res) if k + 1 < len(ep.versions) else None
            del res
            if bar is not None:
                bar.update(1)
    return out


def label_spans(pairs: Sequence[PairProfile], cfg: CalibConfig) -> list[dict[str, Any]]:
    """One label row per span: ``pair, task, workload, P, E, S, d_star``.

    Args:
        pairs: profiled pairs.
        cfg: ``tau_v``, ``gamma``, ``profile_block``, ``block_reduce``.
    Returns:
        The rows.
    """
    return [{"pair": p.pair_id, "task": p.task, "workload": p.workload, "P": sd.prefix_len, "E": sd.edit_len,
             "S": sd.suffix_len, "d_star": _pair_d_star(sd, cfg)} for p in pairs for sd in p.spans]
