"""Analysis figures: drift by distance, block selection, per-block precision sensitivity, kappa x block ablation.

Boundary: drives a :class:`~patchkv_agent.engine.PatchKVEngine` through its public methods
(``checkpoint``, ``resume`` with a strategy name or a :class:`~patchkv_agent.strategies.Strategy`
instance), reads the planner's block layout and plan assembly (:mod:`patchkv_agent.core.plan`), the RoPE
and K8V4/K8V8 torch references (:mod:`patchkv_agent.kernels`) and the scoring of
:mod:`patchkv_agent.eval.metrics`. It writes one JSON file and one PNG per figure; the ``plot_*``
functions read only that JSON (no model), for the notebook. Nothing here is imported by the resume path,
and no module of the library is patched.

Per edited context (version 0 checkpointed with ``engine.checkpoint``, version 1 prefilled exactly with
``engine.resume(None, ids, strategy="exact")``, aligned by :func:`patchkv_agent.core.diff.diff_versions`),
one module per figure:

- :mod:`.inputs`: contexts, :class:`AnalysisConfig`, the two reference passes, scoring.
- :mod:`.a_drift`: (a) cosine of stale values / raw keys / RoPE-corrected keys against exact, by distance.
- :mod:`.b_selection`: (b) extra blocks after the dirty window by attention, distance, random, low attention.
- :mod:`.c_precision`: (c) first-token KL of quantizing one suffix block at a time; its concentration.
- :mod:`.d_ablation`: (d) ``patchkv`` over ``kappa x block size`` at a fixed window.
- :mod:`.driver`: :func:`run_analysis`, all chosen figures over all contexts.
- :mod:`.plots`: the four figures from the JSON, :func:`write_outputs`.
- :mod:`.cli` / ``__main__``: the command line.

Command line::

    python -m patchkv_agent.calibration.analysis --model smollm2-135m --n 3 --out-dir runs/figures/analysis
"""

from __future__ import annotations

from .a_drift import corrected_keys, drift_spans, position_cosines, summarize_drift
from .b_selection import BlockSetStrategy, block_scores, evaluate_selection, selection_masks, summarize_selection
from .c_precision import block_sensitivity, concentration, quantized_rows, summarize_precision
from .cli import build_parser, main
from .d_ablation import ablation_grid, summarize_ablation
from .driver import run_analysis
from .inputs import (DEFAULT_WORKLOADS, FIGURE_NAMES, FIGURES, SELECTORS, AnalysisConfig, Context, PreparedContext,
                     build_contexts, prepare_context)
from .plots import plot_ablation, plot_drift, plot_precision, plot_selection, write_outputs

__all__ = [
    "FIGURES", "FIGURE_NAMES", "SELECTORS", "DEFAULT_WORKLOADS", "Context", "AnalysisConfig", "PreparedContext",
    "prepare_context", "corrected_keys", "position_cosines", "drift_spans", "summarize_drift",
    "BlockSetStrategy", "block_scores", "selection_masks", "evaluate_selection", "summarize_selection",
    "quantized_rows", "block_sensitivity", "concentration", "summarize_precision",
    "ablation_grid", "summarize_ablation",
    "build_contexts", "run_analysis", "plot_drift", "plot_selection", "plot_precision", "plot_ablation",
    "write_outputs", "build_parser", "main",
]
