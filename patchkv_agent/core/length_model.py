"""The dirty-window length model: ``d_hat`` per edited span from its ``(P, E, S)`` token counts.

A log-linear model over ``phi = [1, a, b, c, ab, ac, bc]`` (``a, b, c`` the logs of the span's prefix,
edit and segment lengths, see :func:`~patchkv_agent.core.plan.span_features`), clipped to
``[d_min, d_max]``; :meth:`LengthModel.fixed` is a constant window. ``patchkv-agent calibrate`` fits
one per model at a quantile of the measured drift lengths.

Boundary: numpy only; knows spans' token counts, nothing about plans, models or KV.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LengthModel"]

_N_FEATURES = 7  # phi = [1, a, b, c, ab, ac, bc]
_MAX_EXPONENT = 700.0  # exp() of a larger log-window would overflow: the window is then the segment's bound
_FEW_SPANS = 16  # predict() evaluates up to this many spans in Python (numpy's per-call overhead is larger)
MAX_WINDOW = (1 << 31) - 1  # d_min / d_max bound: no context is longer, and every index type holds it
_MAX_WEIGHT = 1e6  # |w| beyond this is no fitted model (the features are logs of token counts, < 22)




@dataclass(frozen=True, kw_only=True)
class LengthModel:
    """Linear quantile model of ``log d*`` (dirty-window length) on log-length features.

    ``d_hat = clip(exp(w . phi(a, b, c)), d_min, min(d_max, S_k))`` rounded up, with
    ``a = log(1+P_k)``, ``b = log(1+E_k)``, ``c = log(1+S_k)`` and ``phi = [1, a, b, c, ab, ac, bc]``.
    """

    weights: tuple[float, ...]
    d_min: int = 0
    d_max: int | None = None
    quantile: float | None = None  # the quantile the weights were fitted for (metadata)

    def __post_init__(self) -> None:
        try:
            finite = len(self.weights) == _N_FEATURES and all(math.isfinite(float(w)) for w in self.weights)
        except (TypeError, ValueError, OverflowError):
            finite = False
        if not finite:
            raise ValueError(f"LengthModel needs {_N_FEATURES} finite weights, got {str(self.weights)[:200]}")
        for name in ("d_min", "d_max"):
            v = getattr(self, name)
            if v is None and name == "d_max":
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v <= MAX_WINDOW:
                raise ValueError(f"LengthModel needs an int {name} in [0, 2^31), got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.d_max is not None and self.d_max < self.d_min:
            raise ValueError(f"LengthModel needs 0 <= d_min <= d_max, got d_min={self.d_min} d_max={self.d_max}")

    @classmethod
    def fixed(cls, d: int) -> LengthModel:
        """A constant window of ``d`` tokens (clipped to the segment): the engine default before calibration.

        Args:
            d: window length in tokens, ``>= 0``.
        Returns:
            A model that predicts ``min(d, S_k)`` for every span.
        Raises:
            ValueError: if ``d < 0``.
        """
        if d < 0:
            raise ValueError(f"fixed window must be >= 0, got {d}")
        return cls(weights=(math.log(max(d, 1)),) + (0.0,) * (_N_FEATURES - 1), d_min=int(d), d_max=int(d))

    @staticmethod
    def features(prefix_len: np.ndarray, edit_len: np.ndarray, suffix_len: np.ndarray) -> np.ndarray:
        """Feature matrix ``phi`` [k, 7] from per-span lengths (token counts, not logs)."""
        a = np.log1p(np.asarray(prefix_len, dtype=np.float64))
        b = np.log1p(np.asarray(edit_len, dtype=np.float64))
        c = np.log1p(np.asarray(suffix_len, dtype=np.float64))
        return np.stack([np.ones_like(a), a, b, c, a * b, a * c, b * c], axis=-1)

    def predict(self, prefix_len: np.ndarray, edit_len: np.ndarray, suffix_len: np.ndarray) -> np.ndarray:
        """Predicted window per span.

        Args:
            prefix_len, edit_len, suffix_len: per-span lengths ``P_k``, ``E_k``, ``S_k`` (same shape).
        Returns:
            int64 array of ``d_hat`` values in ``[0, S_k]``.
        Raises:
            ValueError: if the shapes differ.
        """
        s = np.asarray(suffix_len, dtype=np.int64)
        if not (np.shape(prefix_len) == np.shape(edit_len) == s.shape):
            raise ValueError("prefix_len, edit_len and suffix_len must have the same shape")
        if s.ndim == 1 and s.shape[0] <= _FEW_SPANS:  # the common edit: per-span arithmetic in Python, same formula
            return np.asarray([self._predict_one(float(a), float(b), int(c))
                               for a, b, c in zip(np.asarray(prefix_len).tolist(), np.asarray(edit_len).tolist(),
                                                  s.tolist())], dtype=np.int64)
        z = self.features(prefix_len, edit_len, s) @ np.asarray(self.weights, dtype=np.float64)
        hi = np.minimum(s, self.d_max) if self.d_max is not None else s
        # 1e-6 slack: exp(log(32)) must give 32, not 33
        d = np.minimum(np.ceil(np.maximum(np.exp(np.minimum(z, _MAX_EXPONENT)), self.d_min) - 1e-6), hi)  # float: no overflow
        big = ~(z < _MAX_EXPONENT)  # exp would overflow (or z is NaN): the window is bounded by the segment
        return np.where(big, hi, d).astype(np.int64)

    def _predict_one(self, p: float, e: float, s: int) -> int:
        a, b, c = math.log1p(p), math.log1p(e), math.log1p(s)
        w = self.weights
        z = w[0] + w[1] * a + w[2] * b + w[3] * c + w[4] * (a * b) + w[5] * (a * c) + w[6] * (b * c)
        hi = min(s, self.d_max) if self.d_max is not None else s
        if not z < _MAX_EXPONENT:  # exp would overflow (or z is NaN): the window is bounded by the segment
            return hi
        return min(int(math.ceil(max(math.exp(z), self.d_min) - 1e-6)), hi)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for calibration profiles."""
        return {
            "kind": "log_linear_quantile",
            "features": ["1", "a", "b", "c", "ab", "ac", "bc"],
            "weights": [float(w) for w in self.weights],
            "d_min": int(self.d_min),
            "d_max": None if self.d_max is None else int(self.d_max),
            "quantile": self.quantile,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LengthModel:
        """Inverse of :meth:`to_dict`.

        Args:
            data: a dict as written by :meth:`to_dict`.
        Returns:
            The model.
        Raises:
            ValueError: on an unknown ``kind`` or missing/invalid fields: weights must be numbers of magnitude
                at most 1e6, ``d_min`` / ``d_max`` integers in ``[0, 2^31)``, ``quantile`` a number in
                ``(0, 1)`` (each range-checked before use: a file may hold ``Infinity`` or ``1e30``).
        """
        if data.get("kind", "log_linear_quantile") != "log_linear_quantile":
            raise ValueError(f"unknown length model kind {str(data.get('kind'))[:40]!r}; expected 'log_linear_quantile'")
        w = data.get("weights")
        if (not isinstance(w, (list, tuple)) or len(w) != _N_FEATURES
                or not all(_number(x) and abs(x) <= _MAX_WEIGHT for x in w)):
            raise ValueError(f"length model dict needs a 'weights' list of {_N_FEATURES} numbers of magnitude "
                             f"<= {_MAX_WEIGHT:g}, got {str(w)[:80]}")
        lim = {}
        for name, default in (("d_min", 0), ("d_max", None)):
            v = data.get(name, default)
            if v is None and name == "d_max":
                lim[name] = None
                continue
            if not _number(v) or not (isinstance(v, int) or v.is_integer()) or not 0 <= v <= MAX_WINDOW:
                raise ValueError(f"length model {name}={str(v)[:40]} (need an integer in [0, 2^31))")
            lim[name] = int(v)
        q = data.get("quantile")
        if q is not None and not (_number(q) and 0.0 < q < 1.0):
            raise ValueError(f"length model quantile={str(q)[:40]} (need a number in (0, 1) or null)")
        return cls(weights=tuple(float(x) for x in w), d_min=lim["d_min"], d_max=lim["d_max"],
                   quantile=None if q is None else float(q))


def _number(x: Any) -> bool:
    """An int or a finite float (not a bool); never converts (a 400-digit int stays an int)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and math.isfinite(x))
