"""Offline calibration: paired prefills, drift labels, quantile fit, frozen per-model profiles.

Importable as ``patchkv_agent.calibration`` (setuptools package-dir map). Modules:

- :mod:`.drift`: value deviation of stale suffix rows, block deviations, the oracle boundary ``d*``.
- :mod:`.fit`: pinball (quantile) fit of the length model, coverage, the task-level split.
- :mod:`.select`: the selection rule (quality target, else minimax) for ``tau_V``, ``kappa`` and ``block_size``.
- :mod:`.config`: the run's data types and defaults (``Episode``, ``CalibConfig``, ``PairProfile``).
- :mod:`.profiling`: paired exact prefills, drift per edited span, the ``d*`` labels.
- :mod:`.evaluation`: resumes of the kept pairs under given configurations, scored against the exact reference.
- :mod:`.precision_stage`: the precision-policy stage (``direct`` at FP16 vs each policy; the smallest payload
  meeting the target).
- :mod:`.agent_stage`: the opt-in agent stage (``--agent-workloads``): the recency window ``recent_window`` chosen
  by next-action agreement with exact on agent-workload resumes from the exact KV of the call before.
- :mod:`.reader_stage`: the opt-in reader stage (``--reader-workloads``): the reader rule's constants chosen by
  whether resumes answer an edited episode's new gold where exact does (edit-following workloads, ``calib``).
- :mod:`.profile`: the profiler driving an engine end to end (``run_calibration``) and the profile's report;
  re-exports the profiler's public names.
- :mod:`.outputs`: the profile writer, the raw resume rows and the drift curves.
- :mod:`.cli`: ``patchkv-agent calibrate`` (``add_calibrate_cli`` / ``calibrate_main``).
- :mod:`.analysis`: the analysis figures (drift by distance, block selection, per-block precision
  sensitivity, kappa x block ablation); ``python -m patchkv_agent.calibration.analysis``.
- ``profiles/``: the drift curves of the shipped profile (``*.drift.npz``, for figures). The profiles
  themselves are read below the engine, so they ship with :mod:`patchkv_agent.profiles`
  (``patchkv_agent/profiles/shipped/``); ``calibrate`` writes to the user cache by default.

Nothing here is imported by the resume path; this package is light to import (no torch at import time).
"""
