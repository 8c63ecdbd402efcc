"""Token ids -> word ids, for the lexical reader signal: one id per word, whatever its tokenization.

A tokenizer spells one word differently by where it stands: byte-level BPE gives ``" Sofia"`` one token
after a space and ``"S" "of" "ia"`` at the start of a line or inside a JSON string; SentencePiece marks the
space with ``"▁"``. :func:`~patchkv_agent.core.plan.lexical_reader_scores` asks which later blocks
mention what an edit changed, so it compares *words*: maximal runs of alphanumeric characters across
token boundaries, case-folded, with the tokenizer's space markers (``Ġ``, ``▁``, ``Ċ``) read as spaces.
A word's id is the 63-bit xxh64 of its text (deterministic across processes); every position of the
word carries it, and positions without an alphanumeric character get ``-1``.

Boundary: numpy, xxhash and a ``token id -> piece`` function (the tokenizer's own vocabulary strings);
no torch, no model. Pieces are read once per id and cached (the cache is bounded by the vocabulary).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import xxhash

__all__ = ["WordIndex"]

_SPACE_MARKERS = str.maketrans({"Ġ": " ", "▁": " ", "Ċ": "\n", "ĉ": "\t"})


class WordIndex:
    """Maps token-id arrays to per-position word ids (``-1`` where a position holds no word character).

    Args:
        piece: ``token id -> vocabulary string`` (e.g. ``tokenizer.convert_ids_to_tokens``); space
            markers in it are read as spaces.

    Raises:
        TypeError: ``piece`` is not callable.
    """

    def __init__(self, piece: Callable[[int], Any]):
        if not callable(piece):
            raise TypeError(f"piece must be callable (token id -> string), got {type(piece).__name__}")
        self._piece = piece
        # per id: (starts a word: leading char alnum and no space before it, ends in alnum, case-folded alnum core)
        self._cache: dict[int, tuple[bool, bool, str]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "WordIndex":
        """The index of a Hugging Face tokenizer (its ``convert_ids_to_tokens``).

        Args:
            tokenizer: a tokenizer with ``convert_ids_to_tokens(int) -> str``.
        Returns:
            The index.
        Raises:
            TypeError: the tokenizer has no ``convert_ids_to_tokens``.
        """
        fn = getattr(tokenizer, "convert_ids_to_tokens", None)
        if fn is None:
            raise TypeError(f"{type(tokenizer).__name__} has no convert_ids_to_tokens; pass WordIndex(piece=...)")
        return cls(fn)

    def _info(self, tid: int) -> tuple[bool, bool, str]:
        got = self._cache.get(tid)
        if got is None:
            raw = self._piece(tid)
            text = raw.translate(_SPACE_MARKERS) if isinstance(raw, str) else ""
            core = "".join(c for c in text.casefold() if c.isalnum())
            got = (bool(text) and text[0].isalnum(), bool(text) and text[-1].isalnum(), core)
            with self._lock:
                self._cache[tid] = got
        return got

    def __call__(self, ids: Any) -> np.ndarray:
        """Word id per position.

        Args:
            ids: 1-D token ids.
        Returns:
            int64 ``[len(ids)]``: the word id of the word each position belongs to, ``-1`` for positions
            without an alphanumeric character.
        """
        arr = np.asarray(ids, dtype=np.int64).ravel()
        out = np.full(arr.shape[0], -1, dtype=np.int64)
        word: list[str] = []
        members: list[int] = []
        prev_trail = False

        def close() -> None:
            if members:
                out[members] = xxhash.xxh64_intdigest("".join(word).encode()) >> 1  # non-negative int64
                word.clear()
                members.clear()

        for i, tid in enumerate(arr.tolist()):
            lead, trail, core = self._info(tid)
            if not core:
                close()
                prev_trail = False
                continue
            if not (lead and prev_trail):
                close()
            word.append(core)
            members.append(i)
            prev_trail = trail
            if not trail:
                close()
        close()
        return out
