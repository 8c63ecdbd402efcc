"""The length model fit: a high-quantile linear model of ``log d*`` on log-length features (numpy only).

Boundary: numpy arrays in, a :class:`patchkv_agent.core.plan.LengthModel` and numbers out. No torch, no model.

Fit: minimise the pinball (check) loss ``sum_i rho_q(y_i - phi_i . w) + ridge * |w_{1:}|^2`` over the
standardised features ``phi = [1, a, b, c, ab, ac, bc]`` (:meth:`LengthModel.features`), ``y = log(max(d*, 1))``,
by the MM algorithm of Hunter & Lange (2000): each step majorises ``rho_q`` at the current residuals by a
quadratic and solves a weighted ridge least-squares problem; the perturbation ``eps`` shrinks as it
converges. Then an optional split-conformal style intercept shift (``shift="cv"``): out-of-fold residuals
over groups (tasks) give the shift that makes the out-of-fold coverage reach ``q``, which corrects the
optimism of an in-sample quantile fit on few points.

Split: calibration/validation by a stable hash of the *group* (task) id, so that all pairs of one task
land on the same side.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np

from patchkv_agent.core.plan import LengthModel

__all__ = ["pinball_loss", "fit_quantile", "fit_length_model", "coverage", "split_by_group", "log_target"]


def pinball_loss(y: np.ndarray, pred: np.ndarray, q: float) -> float:
    """Mean pinball loss ``rho_q(y - pred)``, ``rho_q(r) = max(q r, (q - 1) r)``.

    Args:
        y, pred: same-shape arrays.
        q: quantile in ``(0, 1)``.
    Returns:
        The mean loss.
    """
    r = np.asarray(y, dtype=np.float64) - np.asarray(pred, dtype=np.float64)
    return float(np.mean(np.maximum(q * r, (q - 1.0) * r))) if r.size else 0.0


def fit_quantile(x: np.ndarray, y: np.ndarray, q: float, *, ridge: float = 1e-3, iters: int = 500,
                 tol: float = 1e-9) -> np.ndarray:
    """Linear quantile regression by MM (see the module docstring). Column 0 of ``x`` must be the intercept.

    Args:
        x: ``[n, k]`` design matrix, first column all ones.
        y: ``[n]`` targets.
        q: quantile in ``(0, 1)``.
        ridge: L2 penalty on the non-intercept weights of the *standardised* columns.
        iters: maximum MM steps.
        tol: stop when the objective improves by less than this (relative).
    Returns:
        ``[k]`` weights in the original (unstandardised) feature space.
    Raises:
        ValueError: ``q`` outside ``(0, 1)``, no rows, mismatched shapes, or a first column that is not ones.
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).ravel()
    if x.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"need x [n, k] and y [n] with n >= 1, got {x.shape} and {y.shape}")
    if not np.allclose(x[:, 0], 1.0):
        raise ValueError("column 0 of x must be the intercept (all ones)")
    mu = x[:, 1:].mean(0)
    sd = x[:, 1:].std(0)
    sd = np.where(sd > 1e-12, sd, 1.0)
    z = np.hstack([np.ones((x.shape[0], 1)), (x[:, 1:] - mu) / sd])
    k = z.shape[1]
    pen = np.full(k, float(ridge) * x.shape[0])
    pen[0] = 0.0
    w = np.zeros(k)
    w[0] = np.quantile(y, q)

    def objective(w_: np.ndarray) -> float:
        return pinball_loss(y, z @ w_, q) * y.size + 0.5 * float(pen @ (w_ * w_))

    f = objective(w)
    eps = max(1e-3, 0.1 * float(np.std(y)) if y.size > 1 else 1e-3)
    for _ in range(iters):
        r = y - z @ w
        wt = 1.0 / (eps + np.abs(r))
        # minimise sum_i [ r_i^2 wt_i / 4 + (q - 1/2) r_i ] + pen/2 |w|^2 (the MM surrogate, times 1/1)
        a = (z * (wt / 2.0)[:, None]).T @ z + np.diag(pen)
        b = (z * (wt / 2.0)[:, None]).T @ y + (q - 0.5) * z.sum(0)
        try:
            w_new = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            w_new = np.linalg.lstsq(a, b, rcond=None)[0]
        f_new = objective(w_new)
        if f_new <= f:
            done = f - f_new <= tol * max(1.0, abs(f))
            w, f = w_new, f_new
            if done and eps <= 1e-6:
                break
        eps = max(eps * 0.5, 1e-7)
    # back to the unstandardised feature space
    out = np.empty(k)
    out[1:] = w[1:] / sd
    out[0] = w[0] - float(out[1:] @ mu)
    return out


def log_target(d_star: np.ndarray) -> np.ndarray:
    """Regression target ``log(max(d*, 1))``."""
    return np.log(np.maximum(np.asarray(d_star, dtype=np.float64), 1.0))


def _groups_to_folds(groups: Sequence[str], n_folds: int) -> np.ndarray:
    uniq = sorted(set(groups), key=lambda g: hashlib.sha256(f"fold:{g}".encode()).hexdigest())
    fold_of = {g: i % n_folds for i, g in enumerate(uniq)}
    return np.asarray([fold_of[g] for g in groups], dtype=np.int64)


def fit_length_model(prefix_len: np.ndarray, edit_len: np.ndarray, suffix_len: np.ndarray, d_star: np.ndarray, *,
                     quantile: float = 0.9, ridge: float = 0.1, groups: Sequence[str] | None = None,
                     shift: str = "none", n_folds: int = 5, d_min: int = 0, d_max: int | None = None) -> LengthModel:
    """Fit the dirty-window length model on oracle labels.

    Args:
        prefix_len, edit_len, suffix_len: per-span ``P_k``, ``E_k``, ``S_k``.
        d_star: per-span oracle boundaries.
        quantile: target quantile of ``d*`` (e.g. 0.9: the window covers ``d*`` for 90% of spans).
        ridge: see :func:`fit_quantile`.
        groups: task id of each row, for the out-of-fold shift (rows of one task share a fold).
        shift: ``"cv"`` (intercept shift from grouped out-of-fold residuals; needs ``groups`` with >= 2
            distinct values, else falls back to ``"none"``) or ``"none"``.
        n_folds: folds for ``shift="cv"``.
        d_min, d_max: clip of the prediction (see :class:`LengthModel`).
    Returns:
        The :class:`LengthModel` (``quantile`` set).
    Raises:
        ValueError: mismatched lengths, no rows, or a bad ``quantile``/``shift``.
    """
    if shift not in ("cv", "none"):
        raise ValueError(f"shift must be 'cv' or 'none', got {shift!r}")
    x = LengthModel.features(prefix_len, edit_len, suffix_len)
    y = log_target(d_star)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{x.shape[0]} feature rows but {y.shape[0]} labels")
    w = fit_quantile(x, y, quantile, ridge=ridge)
    if shift == "cv" and groups is not None and len(set(groups)) >= 2:
        if len(groups) != y.shape[0]:
            raise ValueError(f"{len(groups)} groups for {y.shape[0]} rows")
        folds = _groups_to_folds(list(groups), min(n_folds, len(set(groups))))
        resid = np.empty_like(y)
        for f in np.unique(folds):
            tr = folds != f
            wf = fit_quantile(x[tr], y[tr], quantile, ridge=ridge)
            resid[~tr] = y[~tr] - x[~tr] @ wf
        n = resid.size
        # the ceil((n+1) q)-th smallest out-of-fold residual (split-conformal rank), never a negative shift
        rank = min(n, int(math.ceil((n + 1) * quantile)))
        w = w.copy()
        w[0] += max(0.0, float(np.sort(resid)[rank - 1]))
    return LengthModel(weights=tuple(float(v) for v in w), d_min=int(d_min), d_max=d_max, quantile=float(quantile))


def coverage(model: LengthModel, prefix_len: np.ndarray, edit_len: np.ndarray, suffix_len: np.ndarray,
             d_star: np.ndarray) -> float:
    """Share of spans whose oracle boundary the model covers (``d* <= d_hat``).

    Args:
        model: the length model.
        prefix_len, edit_len, suffix_len, d_star: per-span arrays.
    Returns:
        The coverage in ``[0, 1]`` (``nan`` for no rows).
    """
    d = np.asarray(d_star, dtype=np.int64)
    if d.size == 0:
        return float("nan")
    d_hat = model.predict(np.asarray(prefix_len), np.asarray(edit_len), np.asarray(suffix_len))
    return float(np.mean(d <= d_hat))


def split_by_group(groups: Sequence[str], *, val_share: float = 0.3,
                   salt: str = "patchkv-calib") -> tuple[list[str], list[str]]:
    """Deterministic calibration/validation split of task ids (never one task on both sides).

    Groups are ordered by ``sha256(salt + id)``; the first ``round(val_share * n)`` (at least one, and
    at most ``n - 1``, when there are two or more groups) go to validation.

    Args:
        groups: task ids (duplicates allowed: one entry per pair).
        val_share: share of tasks held out for validation, in ``[0, 1)``.
        salt: hash salt (changing it draws another split).
    Returns:
        ``(calib_ids, val_ids)``: sorted, disjoint lists of distinct task ids.
    Raises:
        ValueError: ``val_share`` outside ``[0, 1)``.
    """
    if not 0.0 <= val_share < 1.0:
        raise ValueError(f"val_share must be in [0, 1), got {val_share}")
    uniq = sorted(set(groups), key=lambda g: hashlib.sha256(f"{salt}:{g}".encode()).hexdigest())
    n = len(uniq)
    n_val = int(round(val_share * n))
    if n >= 2 and val_share > 0:
        n_val = min(max(n_val, 1), n - 1)
    else:
        n_val = 0
    return sorted(uniq[n_val:]), sorted(uniq[:n_val])
