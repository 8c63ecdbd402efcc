"""Token ids -> word ids, for the lexical reader signal: one id per word, whatever its tokenization.

A tokenizer spells one word differently by where it stands: byte-level BPE gives ``" Sofia"`` one token
after a space and ``"S" "of" "ia"`` at the start of a line or inside a JSON string; SentencePiece marks the
space with ``"▁"``. :func:`~patchkv_agent.core.readers.lexical_reader_scores` asks which later blocks
mention what an edit changed, so it compares *words*: maximal runs of alphanumeric characters across
token boundaries, case-folded, with the tokenizer's space markers (``Ġ``, ``▁``, ``Ċ``) read as spaces.
A word's id is the 63-bit xxh64 of its text (deterministic across processes); every position of the
word carries it, and positions without an alphanumeric character get ``-1``.

Word ids are per-version data: :meth:`WordIndex.__call__` maps a whole version once (when its checkpoint is
written); :meth:`WordIndex.carry` gives the next version's from the previous one's, re-reading only the
words that touch an edited span (whether token ``i`` continues the word of token ``i - 1`` depends on
those two tokens only, so a word inside an unchanged run keeps its id). The resume path never maps the
whole context in Python.

Boundary: numpy, xxhash and a ``token id -> piece`` function (the tokenizer's own vocabulary strings);
no torch, no model, no diff (the caller hands the position map). Pieces are read once per id and cached
(the cache is bounded by the vocabulary).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import xxhash

__all__ = ["WordIndex"]

_SPACE_MARKERS = str.maketrans({"Ġ": " ", "▁": " ", "Ċ": "\n", "ĉ": "\t"})


def _word_id(parts: list[str]) -> int:
    """The id of the word spelled by ``parts`` (case-folded alphanumeric cores): 63-bit xxh64, non-negative."""
    return xxhash.xxh64_intdigest("".join(parts).encode()) >> 1


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

    def _joins(self, a: int, b: int) -> bool:
        """Whether token ``b`` continues the word of the token ``a`` right before it."""
        return self._info(a)[1] and self._info(b)[0]

    def carry(self, new_ids: Any, old_words: Any, new_to_old: Any, changed: Any) -> np.ndarray:
        """Word ids of a new version from the old version's, re-reading only the words at edited spans.

        Every new position with an old counterpart (``new_to_old >= 0``) takes its old word id; then, per
        changed span ``[start, end)`` (new coordinates; ``start == end`` for a deletion), the window from the
        start of the word holding ``start - 1`` to the end of the word holding ``end`` is mapped afresh (its
        ends are word boundaries of the new version, so the window maps as a whole version would). A word
        outside every window lies inside one unchanged run without touching its ends, so it is the same
        word, with the same id, as in the old version. Equal to ``self(new_ids)`` when ``old_words ==
        self(old_ids)`` and ``changed`` covers every new position whose token or neighbour changed (the
        edited spans of a diff do); the cost is the edited tokens plus one vectorized gather.

        Args:
            new_ids: 1-D token ids of the new version.
            old_words: word ids of the old version (``self(old_ids)``).
            new_to_old: int ``[len(new_ids)]``: the old position of each reused new token, ``-1`` elsewhere.
            changed: ``(start, end)`` pairs in new coordinates, covering every position with ``new_to_old ==
                -1`` and every place where a reused run meets another run.
        Returns:
            int64 ``[len(new_ids)]`` word ids.
        Raises:
            ValueError: ``new_to_old`` has another length than ``new_ids``, or points outside ``old_words``.
        """
        ids = np.asarray(new_ids, dtype=np.int64).ravel()
        old = np.asarray(old_words, dtype=np.int64).ravel()
        n2o = np.asarray(new_to_old, dtype=np.int64).ravel()
        n = ids.shape[0]
        if n2o.shape[0] != n:
            raise ValueError(f"new_to_old has {n2o.shape[0]} entries for {n} tokens")
        if n and int(n2o.max(initial=-1)) >= old.shape[0]:
            raise ValueError(f"new_to_old points past the {old.shape[0]} old word ids")
        out = np.where(n2o >= 0, old[np.maximum(n2o, 0)] if old.shape[0] else -1, -1).astype(np.int64, copy=False)
        return self._remap(ids, out, changed)

    def carry_runs(self, new_ids: Any, old_words: Any, runs: Any, changed: Any) -> np.ndarray:
        """:meth:`carry` with the reused positions given as runs instead of a per-position map: one slice copy
        per run, so the cost is the runs and the edited tokens plus one pass of copies (what the resume path
        calls: an :class:`~patchkv_agent.core.diff.Edit` knows its aligned runs).

        Args:
            new_ids: 1-D token ids of the new version.
            old_words: word ids of the old version (``self(old_ids)``).
            runs: ``(new_start, old_start, length)`` triples, disjoint: ``new[new_start + i]`` reuses
                ``old[old_start + i]``; every other position must lie in ``changed``.
            changed: as in :meth:`carry`.
        Returns:
            int64 ``[len(new_ids)]`` word ids (equal to :meth:`carry` with the equivalent map).
        Raises:
            ValueError: a run outside ``new_ids`` or ``old_words``.
        """
        ids = np.asarray(new_ids, dtype=np.int64).ravel()
        old = np.asarray(old_words, dtype=np.int64).ravel()
        n = ids.shape[0]
        out = np.full(n, -1, dtype=np.int64)
        for ns, os_, ln in runs:
            ns, os_, ln = int(ns), int(os_), int(ln)
            if ln <= 0:
                continue
            if ns < 0 or os_ < 0 or ns + ln > n or os_ + ln > old.shape[0]:
                raise ValueError(f"run (new {ns}, old {os_}, {ln} tokens) lies outside {n} new tokens / "
                                 f"{old.shape[0]} old word ids")
            out[ns:ns + ln] = old[os_:os_ + ln]
        return self._remap(ids, out, changed)

    def _remap(self, ids: np.ndarray, out: np.ndarray, changed: Any) -> np.ndarray:
        """Map the word windows around each changed span afresh into ``out`` (see :meth:`carry`)."""
        n = ids.shape[0]
        toks = ids.tolist() if n <= 64 else None  # python ints for the walks (only near the windows otherwise)
        tok = (lambda i: toks[i]) if toks is not None else (lambda i: int(ids[i]))
        for start, end in changed:
            start, end = max(0, min(int(start), n)), max(0, min(int(end), n))
            lo = start
            if lo > 0:
                lo -= 1
                while lo > 0 and self._joins(tok(lo - 1), tok(lo)):
                    lo -= 1
            hi = end
            if hi < n:
                while hi + 1 < n and self._joins(tok(hi), tok(hi + 1)):
                    hi += 1
                hi += 1
            if hi > lo:
                out[lo:hi] = self(ids[lo:hi])
        return out

    def __call__(self, ids: Any) -> np.ndarray:
        """Word id per position.

        Args:
            ids: 1-D token ids.
        Returns:
            int64 ``[len(ids)]``: the word id of the word each position belongs to, ``-1`` for positions
            without an alphanumeric character.
        """
        arr = np.asarray(ids, dtype=np.int64).ravel()
        out = [-1] * arr.shape[0]
        cache, info = self._cache, self._info
        word: list[str] = []
        start = 0  # first position of the open word (``word`` non-empty)
        prev_trail = False
        for i, tid in enumerate(arr.tolist()):
            got = cache.get(tid)
            lead, trail, core = got if got is not None else info(tid)
            if word and not (core and lead and prev_trail):  # the open word ends before position i
                out[start:i] = [_word_id(word)] * (i - start)
                word.clear()
            if not core:
                prev_trail = False
                continue
            if not word:
                start = i
            word.append(core)
            prev_trail = trail
            if not trail:  # ends in a non-word character: the word ends with this token
                out[start:i + 1] = [_word_id(word)] * (i + 1 - start)
                word.clear()
        if word:
            out[start:] = [_word_id(word)] * (len(out) - start)
        return np.asarray(out, dtype=np.int64)
