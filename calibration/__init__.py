"""Offline calibration: paired prefills, drift labels, quantile fit, frozen per-model profiles."""
