"""The analysis run: every chosen figure over every context, one progress bar, one JSON-able result.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.plan import plan_suffix_blocks

from .a_drift import _layers, drift_spans, summarize_drift
from .b_selection import evaluate_selection, summarize_selection
from .c_precision import _spread, block_sensitivity, summarize_precision
from .d_ablation import ablation_grid, summarize_ablation
from .inputs import SELECTORS, AnalysisConfig, Context, PreparedContext, prepare_context

def _work_units(ctx: Context, cfg: AnalysisConfig) -> int:
    units = 2
    if "b" in cfg.figures:
        units += len(SELECTORS)
    if "c" in cfg.figures:
        blocks = plan_suffix_blocks(diff_versions(np.asarray(ctx.old_ids), np.asarray(ctx.new_ids)),
                                    block_size=cfg.block_size)
        units += 1 + _spread(blocks.n_blocks, cfg.max_blocks).size
    if "d" in cfg.figures:
        units += len(cfg.kappas) * len(cfg.blocks)
    return units


def _context_meta(prep: PreparedContext) -> dict[str, Any]:
    e = prep.edit
    return {"id": prep.context.id, "workload": prep.context.workload, "edit": prep.context.edit,
            "old_tokens": int(e.old_len), "new_tokens": int(e.new_len), "prefix_tokens": int(e.prefix_len),
            "inserted_tokens": int(e.new_token_count), "suffix_tokens": int(e.suffix_len), "spans": len(e.spans),
            "reference_output_ids": [int(t) for t in prep.ref.output_ids]}


def run_analysis(engine, contexts: Sequence[Context], cfg: AnalysisConfig = AnalysisConfig(), *,
                 progress: bool = True) -> dict[str, Any]:
    """Compute the chosen figures over the contexts.

    Args:
        engine: the engine.
        contexts: the edited contexts.
        cfg: the configuration.
        progress: show a tqdm progress bar (one step per prefill/resume).
    Returns:
        The JSON-able result: ``config``, ``model`` (fingerprint), ``contexts`` (meta per context) and one
        section per computed figure: ``drift`` (``spans``, ``summary``), ``selection`` (``rows``,
        ``summary``), ``precision`` (``contexts``, ``summary``), ``ablation`` (``rows``, ``summary``).
    Raises:
        ValueError: no contexts, or as the per-figure functions.
    """
    from tqdm.auto import tqdm

    if not contexts:
        raise ValueError("no contexts to analyse")
    t0 = time.perf_counter()
    total = sum(_work_units(c, cfg) for c in contexts)
    bar = tqdm(total=total, desc="analysis", unit="pass", disable=not progress, file=sys.stderr)
    data: dict[str, Any] = {"config": {**asdict(cfg), "figures": list(cfg.figures)},
                            "fingerprint": engine.spec.fingerprint, "contexts": []}
    drift, sel_rows, prec, abl_rows = [], [], [], []
    try:
        for i, ctx in enumerate(contexts):
            bar.set_postfix_str(ctx.id[-40:])
            prep = prepare_context(engine, ctx, max_new_tokens=cfg.max_new_tokens, mixed=cfg.precision == "mixed")
            bar.update(2)
            data["contexts"].append(_context_meta(prep))
            if "a" in cfg.figures:
                for row in drift_spans(engine.spec, prep.ckpt.keys, prep.ckpt.values, prep.ref.keys,
                                       prep.ref.values, prep.edit, layers=cfg.layers, bin_size=cfg.bin_size):
                    drift.append({"context": ctx.id, **row})
            if "b" in cfg.figures:
                sel_rows += evaluate_selection(engine, prep, window=cfg.window, block_size=cfg.block_size,
                                               budget=cfg.budget, budget_blocks=cfg.budget_blocks,
                                               seed=cfg.seed * 100_003 + i, precision=cfg.precision,
                                               max_new_tokens=cfg.max_new_tokens, bar=bar)
            if "c" in cfg.figures:
                prec.append(block_sensitivity(engine, prep, block_size=cfg.block_size, max_blocks=cfg.max_blocks,
                                              fmt=cfg.quant_format, bar=bar))
            if "d" in cfg.figures:
                abl_rows += ablation_grid(engine, prep, kappas=cfg.kappas, blocks=cfg.blocks, window=cfg.window,
                                          precision=cfg.precision, max_new_tokens=cfg.max_new_tokens, bar=bar)
            del prep
    finally:
        bar.close()
    if "a" in cfg.figures:
        data["drift"] = {"bin_size": cfg.bin_size,
                         "layers": _layers(engine.spec, cfg.layers), "spans": drift,
                         "summary": summarize_drift(drift, cfg.bin_size)}
    if "b" in cfg.figures:
        data["selection"] = {"window": cfg.window, "block_size": cfg.block_size, "rows": sel_rows,
                             "summary": summarize_selection(sel_rows)}
    if "c" in cfg.figures:
        data["precision"] = {"format": cfg.quant_format, "block_size": cfg.block_size, "contexts": prec,
                             "summary": summarize_precision(prec, cfg.top_share)}
    if "d" in cfg.figures:
        data["ablation"] = {"window": cfg.window, "rows": abl_rows, "summary": summarize_ablation(abl_rows)}
    data["timing"] = {"analysis_s": round(time.perf_counter() - t0, 2)}
    return data
