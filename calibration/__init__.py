"""Offline calibration: paired prefills, drift labels, quantile fit, frozen per-model profiles.

Importable as ``patchkv_agent.calibration`` (setuptools package-dir map). Modules:

- :mod:`.drift`: value deviation of stale suffix rows, block deviations, the oracle boundary ``d*``.
- :mod:`.fit`: pinball (quantile) fit of the length model, coverage, the task-level split.
- :mod:`.select`: the selection rule (quality target, else minimax) for ``tau_V``, ``kappa`` and ``block_size``.
- :mod:`.profile`: the profiler driving an engine end to end (incl. the precision-policy stage), and the
  profile writer.
- :mod:`.cli`: ``patchkv-agent calibrate`` (``add_calibrate_cli`` / ``calibrate_main``).
- :mod:`.analysis`: the analysis figures (drift by distance, block selection, per-block precision
  sensitivity, kappa x block ablation); ``python -m patchkv_agent.calibration.analysis``.
- ``profiles/*.json``: the frozen profiles, read by :mod:`patchkv_agent.profiles`.

Nothing here is imported by the resume path; this package is light to import (no torch at import time).
"""
