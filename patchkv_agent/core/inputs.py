"""The one validator of what callers hand the public API: token ids and ``max_new_tokens``.

The engine (``checkpoint``, ``resume``, ``encode``), the thread registry and the command line all call
these functions, so that a bad input fails the same way wherever it enters, before any compute, with a
message that names the fix. Nothing is coerced silently: float ids (``1.7``), bools, strings (``"5"``),
NaN, values beyond int64, ragged or nested lists are rejected, not truncated or converted.

Errors are :class:`InvalidInput`, a subclass of both ``ValueError`` and ``TypeError`` (callers written
against either keep working).

Boundary: numpy only; the torch tensor case is recognised without importing torch.
"""

from __future__ import annotations

import array
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["InvalidInput", "as_token_ids", "check_max_new_tokens", "non_negative_int"]

_INT64_MAX = int(np.iinfo(np.int64).max)


class InvalidInput(ValueError, TypeError):
    """A public-API argument that cannot be used as given; the message says what to pass instead."""


def _describe(x: Any) -> str:
    text = repr(x)
    return (text if len(text) <= 40 else text[:37] + "...") + f" ({type(x).__name__})"


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def as_token_ids(token_ids: Any, *, vocab_size: int | None = None, max_positions: int | None = None,
                 what: str = "token_ids") -> np.ndarray:
    """Token ids as a fresh 1-D int64 array, or an :class:`InvalidInput` naming the problem.

    Accepted: a list / tuple / range of Python or numpy ints, a 1-D numpy array of an integer dtype,
    a 1-D torch tensor of an integer dtype. A list is converted in one C-level pass (no per-token Python:
    ~3 ms per 128k ids, the cost of reading Python ints); only a list with a bad element takes the
    per-element pass that names it.

    Args:
        token_ids: the ids.
        vocab_size: ids must lie in ``[0, vocab_size)`` (None: only ``>= 0`` and within int64).
        max_positions: at most this many ids (None: no limit).
        what: the argument's name in messages.

    Returns:
        int64 ``[n]`` array (a copy; ``n >= 1``).

    Raises:
        InvalidInput: not a flat sequence of ints (float, bool, str, None, dict elements; a string or a
            mapping; nested or ragged lists; a 2-D tensor), empty, outside the vocabulary or int64, or
            longer than ``max_positions``.
    """
    if (token_ids is None or isinstance(token_ids, (str, bytes, Mapping, set, frozenset))
            or not hasattr(token_ids, "__iter__")):
        hint = " (text: tokenize it first, e.g. engine.encode(text))" if isinstance(token_ids, (str, bytes)) else ""
        raise InvalidInput(f"{what} must be a list of ints, a 1-D int array or a 1-D int tensor, got "
                           f"{_describe(token_ids)}{hint}")
    mod = type(token_ids).__module__
    if mod.startswith("torch"):  # a torch.Tensor: integer dtype only, 1-D
        if token_ids.dim() != 1:
            raise InvalidInput(f"{what} must be a 1-D tensor or a list of ints, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or str(token_ids.dtype) == "torch.bool":
            raise InvalidInput(f"{what} must hold integer token ids, got a {token_ids.dtype} tensor; "
                               "ids are never converted from floats or bools")
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray) and token_ids.dtype != object:
        if token_ids.ndim != 1:
            raise InvalidInput(f"{what} must be 1-D (one context's ids), got shape {token_ids.shape}")
        if token_ids.dtype.kind not in "iu":
            raise InvalidInput(f"{what} must hold integer token ids, got a {token_ids.dtype} array; "
                               "ids are never converted from floats, bools or strings")
        if token_ids.dtype.kind == "u" and token_ids.size and int(token_ids.max()) > _INT64_MAX:
            raise InvalidInput(f"{what} holds ids beyond int64: {int(token_ids.max())}")
        return _check_range(token_ids.astype(np.int64, copy=True), what, vocab_size, max_positions)
    seq = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
    ids = _fast_ints(seq)
    if ids is None:  # something is off: the per-element pass names it
        ids = _checked_ints(seq, what, vocab_size)
    return _check_range(ids, what, vocab_size, max_positions)


def _fast_ints(seq: list | tuple) -> np.ndarray | None:
    """``seq`` as int64 in one C-level pass (``array('q')`` takes only objects with ``__index__``: Python
    and numpy ints, bools), or None when the per-element pass must run: a non-int element, an id beyond
    int64, a negative id, or a bool (bools convert to 0 / 1, so only the elements equal to 0 or 1 are
    looked at in Python: the cost stays that of the conversion)."""
    try:
        ids = np.frombuffer(array.array("q", seq), dtype=np.int64)
    except (TypeError, OverflowError, ValueError):
        return None
    if ids.size and int(ids.min()) < 0:
        return None
    for i in np.flatnonzero(ids <= 1).tolist():
        if isinstance(seq[i], (bool, np.bool_)):
            return None
    return ids


def _checked_ints(seq: list | tuple, what: str, vocab_size: int | None) -> np.ndarray:
    """The per-element pass: int64 ids, or the :class:`InvalidInput` of the first bad element."""
    for i, x in enumerate(seq):
        if not _is_int(x):
            if isinstance(x, (list, tuple, np.ndarray)) or getattr(x, "ndim", 0):
                raise InvalidInput(f"{what} must be a flat sequence of ints (one context), but element {i} "
                                   f"is {_describe(x)}: nested or ragged lists are not ids")
            kind = f"a float ({x!r})" if isinstance(x, (float, np.floating)) else (
                f"a bool ({x!r})" if isinstance(x, (bool, np.bool_)) else _describe(x))
            raise InvalidInput(f"{what}[{i}] is {kind}, not an int token id; ids are never "
                               "converted: pass the ints the tokenizer gave")
        if not 0 <= int(x) <= _INT64_MAX:
            raise InvalidInput(f"{what}[{i}] = {int(x)} is outside the vocabulary"
                               + (f" [0, {vocab_size})" if vocab_size is not None else " (ids are >= 0)")
                               + "; tokenize with this model's tokenizer")
    return np.array([int(x) for x in seq], dtype=np.int64) if seq else np.zeros(0, dtype=np.int64)


def _check_range(ids: np.ndarray, what: str, vocab_size: int | None, max_positions: int | None) -> np.ndarray:
    if ids.size == 0:
        raise InvalidInput(f"{what} is empty: a context needs at least one token")
    hi = vocab_size if vocab_size is not None else _INT64_MAX
    bad = ids[(ids < 0) | (ids >= hi)]
    if bad.size:
        raise InvalidInput(f"{what} holds ids outside the vocabulary [0, {hi}): {bad[:5].tolist()}; "
                           "tokenize with this model's tokenizer")
    if max_positions is not None and ids.size > max_positions:
        raise InvalidInput(f"{what} has {ids.size} tokens, more than the model's maximum of {max_positions} "
                           "positions; trim or compact the context")
    return ids


def non_negative_int(value: Any, *, what: str = "max_new_tokens") -> int:
    """``value`` as an int ``>= 0``; strings are parsed only when they spell a decimal integer.

    Meant for command-line arguments (``argparse`` ``type=``) and settings read from text; the Python API
    uses :func:`check_max_new_tokens`, which takes no strings.

    Raises:
        InvalidInput: not a non-negative integer.
    """
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        value = int(value.strip())
    if not _is_int(value) or int(value) < 0:
        raise InvalidInput(f"{what} must be a non-negative integer, got {_describe(value)}")
    return int(value)


def check_max_new_tokens(max_new_tokens: Any, *, context_len: int, max_positions: int | None) -> int:
    """The number of tokens to decode: a non-negative int, clipped to the model's remaining positions.

    Every decoded token needs a position below ``max_positions``: ``context_len + k <= max_positions``.

    Args:
        max_new_tokens: the caller's value.
        context_len: tokens in the context.
        max_positions: the model's maximum positions (None: no limit).

    Returns:
        ``min(max_new_tokens, max_positions - context_len)``.

    Raises:
        InvalidInput: not an int (``2.5``, ``"3"``, ``None``, ``True``), negative, or ``> 0`` when the
            context already fills every position.
    """
    if not _is_int(max_new_tokens) or int(max_new_tokens) < 0:
        raise InvalidInput(f"max_new_tokens must be a non-negative int, got {_describe(max_new_tokens)}")
    n = int(max_new_tokens)
    if max_positions is None:
        return n
    remaining = int(max_positions) - int(context_len)
    if n > 0 and remaining <= 0:
        raise InvalidInput(f"the context's {context_len} tokens already fill the model's {max_positions} positions: "
                           "no token can be decoded; trim or compact the context, or pass max_new_tokens=0 for "
                           "the first-token logits only")
    return min(n, max(remaining, 0))
