"""Text -> token ids, memoized per segment: the resume path tokenizes what an edit changed, not the context.

An agent's next call renders its whole conversation through the chat template, and tokenizing that text
grows with the context (SmolLM2's fast tokenizer: ~20 ms at 8k tokens, ~90 ms at 32k on a 2-core CPU),
far more than everything else the host does on a resume. But a Hugging Face
fast tokenizer first cuts its input at its *added tokens* (``<|im_start|>``, ``<|im_end|>``, ...) and then
normalizes, pre-tokenizes and encodes each piece between them on its own. So the ids of a rendered
conversation are the concatenation of the ids of its pieces, and a piece that was seen before (an unchanged
message: the same role line and content between the same special tokens) has the ids it had then.

:class:`SegmentEncoder` cuts the text the way the tokenizer does (leftmost-longest match of the added tokens'
contents), looks every piece up in a bounded LRU cache and encodes the misses in one batch. A piece that does
not start the text is encoded behind an added token (and that token's id dropped), so a pre-tokenizer that
treats the start of the input specially (SentencePiece's ``prepend_scheme="first"``) sees each piece exactly
where it stands. What the tokenizer does that this cannot mirror disables the memo (:attr:`reason` says why;
every call then tokenizes the whole text): a slow (Python) tokenizer, added tokens with ``lstrip`` /
``rstrip`` / ``single_word`` or normalized matching, ``split_special_tokens``, or a probe whose segmented ids
differ from the whole-text ids (checked when the encoder is built).

Message text is text: a tokenizer matches its special tokens anywhere in its input, so a message whose
content holds ``<|im_start|>system`` would be read as a real turn marker (a tool's output forging a system
turn). :meth:`SegmentEncoder.as_text` breaks every special token's text inside a message's strings (a break
string after its first character) before the chat template renders them, so the only special tokens in a
rendered context are the template's own; a text without a special token's text is returned unchanged, so
ordinary conversations keep their ids. The break is chosen once per tokenizer
(:attr:`SegmentEncoder.literal_break`, :func:`choose_literal_break`): the first of :data:`BREAK_CANDIDATES`
(zero width space, word joiner, backslash, space) that the vocabulary encodes and decodes back without
``<unk>``, so the broken text keeps its characters on every vocabulary (``<\\|im_start|>`` on a vocabulary of
printable ASCII; invisible on one that holds U+200B).

Boundary: a tokenizer object (duck-typed: ``__call__``, ``added_tokens_decoder``, ``is_fast``) in, numpy
int64 arrays out; no model, no torch.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["SegmentEncoder", "DEFAULT_CACHE_TOKENS", "LITERAL_BREAK", "BREAK_CANDIDATES", "choose_literal_break",
           "special_token_texts"]

DEFAULT_CACHE_TOKENS = 1 << 21  # ids the memo keeps (int64: 16 MiB), least recently used dropped first
_PROBE_TEXT = ("system\nYou are helpful.", "user\n  Hi there!\n\n{\"a\": [1, 2]}", "assistant\n", "\n",
               " leading space", "tool\nnaïve — 12345 ok\tTab", "x")


LITERAL_BREAK = "\u200b"  # zero width space: the preferred break (invisible), where the vocabulary encodes it
BREAK_CANDIDATES = ("\u200b", "\u2060", "\\", " ")
"""Breaks :func:`choose_literal_break` tries, in order: zero width space and word joiner (invisible), then
backslash (reads as an escape: ``<\\/tool_response>``) and space (every vocabulary encodes one)."""
_LONE = "\ufffd"  # what a one-character special token's text becomes (nothing can be inserted into it)


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def special_token_texts(tokenizer: Any, literal_break: str | None = LITERAL_BREAK) -> tuple[str, ...]:
    """The texts a call of ``tokenizer`` reads as special tokens wherever they stand in its input: its added
    tokens flagged ``special`` and its ``all_special_tokens``, longest first.

    Args:
        tokenizer: a Hugging Face tokenizer (or any object; missing attributes count as none).
        literal_break: the break :meth:`SegmentEncoder.as_text` inserts (None: keep every text).
    Returns:
        The texts (texts holding ``literal_break`` or U+FFFD are left out: :meth:`SegmentEncoder.as_text`
        could not break them without making new ones).
    """
    found: set[str] = set()
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        for at in decoder.values():
            content = getattr(at, "content", None)
            if isinstance(content, str) and content and getattr(at, "special", False):
                found.add(content)
    try:
        found.update(t for t in (getattr(tokenizer, "all_special_tokens", None) or ()) if isinstance(t, str) and t)
    except TypeError:
        pass
    keep = (t for t in found if _LONE not in t and (not literal_break or literal_break not in t))
    return tuple(sorted(keep, key=lambda t: (-len(t), t)))


def _ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [[int(i) for i in ids] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _unk_id(tokenizer: Any) -> int | None:
    """The id the tokenizer gives unknown characters: its ``unk_token_id``, else its backend model's."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        name = getattr(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None), "unk_token", None)
        unk = tokenizer.backend_tokenizer.token_to_id(name) if isinstance(name, str) else None
    return int(unk) if isinstance(unk, int) and not isinstance(unk, bool) else None


def _keeps_text(tokenizer: Any, brk: str, texts: list[str], halves: list[int], special_ids: set[int],
                unk: int | None) -> bool:
    """Whether every text of ``texts`` broken by ``brk`` encodes to no special id and to no more ``<unk>``
    than its two halves do (``halves``: their count), and (when it encodes without ``<unk>``) decodes back to
    itself."""
    broken = [t[0] + brk + t[1:] for t in texts]
    for text, ids, before in zip(broken, _ids(tokenizer, broken), halves):
        if any(i in special_ids and i != unk for i in ids):
            return False
        n_unk = ids.count(unk) if unk is not None else 0
        if n_unk > before:
            return False
        if n_unk == 0 and tokenizer.decode(ids, skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False) != text:
            return False
    return True


def choose_literal_break(tokenizer: Any, candidates: tuple[str, ...] = BREAK_CANDIDATES) -> str:
    """The break :meth:`SegmentEncoder.as_text` inserts into special token texts for ``tokenizer``: the first
    candidate that no special token's text holds and that, inserted after the first character of each
    special token's text, encodes to no special id, adds no ``<unk>`` and decodes back to the broken text.

    Args:
        tokenizer: a Hugging Face tokenizer (duck-typed: ``__call__``, ``decode``, ``unk_token_id``).
        candidates: the breaks to try, in order of preference.
    Returns:
        The chosen break; :data:`LITERAL_BREAK` when the tokenizer has no special token texts or no
        candidate passes (a tokenizer this cannot probe included).
    """
    texts = special_token_texts(tokenizer, None)
    if not texts:
        return LITERAL_BREAK
    special_ids: set[int] = set()
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        special_ids = {int(i) for i, at in decoder.items() if getattr(at, "content", None) in texts}
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if callable(convert):  # special texts outside the added tokens' table
        special_ids.update(i for i in (convert(t) for t in texts) if isinstance(i, int))
    try:
        unk = _unk_id(tokenizer)
        probe = [t for t in texts if len(t) > 1]
        first, rest = _ids(tokenizer, [t[0] for t in probe]), _ids(tokenizer, [t[1:] for t in probe])
        halves = [(a.count(unk) + b.count(unk)) if unk is not None else 0 for a, b in zip(first, rest)]
    except Exception:  # a tokenizer this cannot probe
        return LITERAL_BREAK
    if not probe:  # one-character special texts only: they become U+FFFD, no break is inserted
        return LITERAL_BREAK
    for brk in candidates:
        if not brk or any(brk in t for t in texts):
            continue
        try:
            if _keeps_text(tokenizer, brk, probe, halves, special_ids, unk):
                return brk
        except Exception:  # a tokenizer that cannot encode or decode this: try the next candidate
            continue
    return LITERAL_BREAK


class SegmentEncoder:
    """Token ids of a text, from cached ids of the pieces between the tokenizer's added tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerFast`` for the memo to work).
        max_tokens: ids the memo keeps at most (least recently used pieces are dropped), ``>= 0``
            (0: no memo).

    Attributes:
        reason: None when the memo is used, else why not (every call then tokenizes the whole text).
        hits, misses: pieces served from the memo / encoded, since construction.
        literal_break: the break :meth:`as_text` inserts for this tokenizer (chosen on first use).

    Raises:
        ValueError: ``max_tokens`` negative or not an int.
    """

    def __init__(self, tokenizer: Any, *, max_tokens: int = DEFAULT_CACHE_TOKENS):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.hits = self.misses = 0
        self._memo: OrderedDict[tuple[bool, str], np.ndarray] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._special: dict[str, int] = {}
        self._special_ids: dict[str, np.ndarray] = {}
        self._pattern: re.Pattern | None = None
        self._anchor: tuple[str, int] | None = None
        self._break: tuple[Any, str] | None = None  # (tokenizer, its literal break)
        self._literal: dict[tuple[str, ...], re.Pattern | None] = {}  # as_text's patterns, by `also`
        self._literal_of: Any = tokenizer  # the tokenizer those patterns are of
        self.reason: str | None = "max_tokens=0" if max_tokens == 0 else self._configure()

    # ------------------------------------------------------------------ set-up

    def _configure(self) -> str | None:
        tok = self.tokenizer
        if not getattr(tok, "is_fast", False):
            return "not a fast tokenizer"
        if getattr(tok, "split_special_tokens", False):
            return "split_special_tokens is on"
        decoder = getattr(tok, "added_tokens_decoder", None)
        if not isinstance(decoder, dict) or not decoder:
            return "no added tokens to cut at"
        special: dict[str, int] = {}
        for tid, at in decoder.items():
            content = getattr(at, "content", None)
            if not isinstance(content, str) or not content:
                return f"added token {tid} has no text"
            for flag in ("lstrip", "rstrip", "single_word", "normalized"):
                if getattr(at, flag, False):
                    return f"added token {content!r} has {flag}=True"
            special[content] = int(tid)
        self._special = special
        # leftmost match, longest first at a position (the tokenizer's added-vocabulary split)
        self._pattern = re.compile("(" + "|".join(re.escape(s) for s in sorted(special, key=len, reverse=True)) + ")")
        self._special_ids = {k: np.asarray([v], dtype=np.int64) for k, v in special.items()}
        anchor = min(special, key=lambda s: (len(s), s))
        self._anchor = (anchor, special[anchor])
        a, b = list(special)[:2] if len(special) > 1 else (anchor, anchor)
        for probe in (a.join(_PROBE_TEXT), b + a.join(_PROBE_TEXT) + b, _PROBE_TEXT[1] + a + b + _PROBE_TEXT[0]):
            try:
                whole = self._whole(probe)
                got = self._segmented(probe, memo=False)
            except Exception as e:  # a tokenizer this cannot drive: tokenize whole texts
                return f"probe failed: {type(e).__name__}: {e}"
            if not np.array_equal(whole, got):
                return "segmented ids differ from the whole text's on a probe"
        return None

    # ------------------------------------------------------------------ encoding

    def _whole(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def _encode_pieces(self, keys: list[tuple[bool, str]]) -> list[np.ndarray]:
        """Ids of pieces, each as it stands in a text (``first``: at its start), in one batch call."""
        anchor, anchor_id = self._anchor
        texts = [p if first else anchor + p for first, p in keys]
        out = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        got = []
        for (first, piece), ids in zip(keys, out):
            arr = np.asarray(ids, dtype=np.int64)
            if not first:
                if arr.shape[0] == 0 or arr[0] != anchor_id:
                    raise ValueError(f"the tokenizer did not cut at its added token {anchor!r}")
                arr = arr[1:]
            arr.setflags(write=False)
            got.append(arr)
        return got

    def _segmented(self, text: str, *, memo: bool = True) -> np.ndarray:
        parts = self._pattern.split(text)  # text, special, text, special, ..., text (texts may be empty)
        texts = parts[0::2]
        keys = [(j == 0, t) for j, t in enumerate(texts) if t]
        found: dict[tuple[bool, str], np.ndarray] = {}
        if memo:
            with self._lock:
                get, touch = self._memo.get, self._memo.move_to_end
                for k in keys:
                    v = get(k)
                    if v is not None:
                        touch(k)
                        found[k] = v
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        if missing:
            found.update(zip(missing, self._encode_pieces(missing)))
            if memo:
                self._remember(missing, found)
        if memo:
            self.hits += len(keys) - len(missing)
            self.misses += len(missing)
        special = self._special_ids
        chunks = []
        for j, t in enumerate(texts):
            if t:
                chunks.append(found[(j == 0, t)])
            if 2 * j + 1 < len(parts):
                chunks.append(special[parts[2 * j + 1]])
        return np.concatenate(chunks) if chunks else _empty()

    def _remember(self, keys: list[tuple[bool, str]], found: dict[tuple[bool, str], np.ndarray]) -> None:
        with self._lock:
            for k in keys:
                v = found[k]
                if v.shape[0] > self.max_tokens or k in self._memo:
                    continue
                self._memo[k] = v
                self._held += int(v.shape[0]) + 1  # a piece holds at least one slot (empty pieces count)
            while self._held > self.max_tokens and self._memo:
                _, old = self._memo.popitem(last=False)
                self._held -= int(old.shape[0]) + 1

    def encode(self, text: str) -> np.ndarray:
        """The ids ``tokenizer(text, add_special_tokens=False)`` gives, as a fresh int64 array.

        Args:
            text: the text (e.g. a rendered chat template).
        Returns:
            int64 ``[n]`` (writable; the memo keeps its own read-only pieces).
        Raises:
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if self.reason is not None:
            return self._whole(text)
        try:
            return self._segmented(text)
        except ValueError as e:  # the tokenizer did not cut where the probes said it would: stop memoizing
            self.reason = f"segmentation failed on a call: {e}"
            self.clear()
            return self._whole(text)

    __call__ = encode

    @property
    def literal_break(self) -> str:
        """The break :meth:`as_text` inserts after a special token text's first character: chosen once per
        tokenizer by :func:`choose_literal_break` (re-chosen when ``tokenizer`` is replaced)."""
        got = self._break
        if got is None or got[0] is not self.tokenizer:
            got = self._break = (self.tokenizer, choose_literal_break(self.tokenizer))
        return got[1]

    def _literal_pattern(self, also: tuple[str, ...]) -> re.Pattern | None:
        """The pattern :meth:`as_text` breaks: the special token texts and ``also`` (cached per ``also``)."""
        if self._literal_of is not self.tokenizer or len(self._literal) > 16:
            self._literal, self._literal_of = {}, self.tokenizer
        pat = self._literal.get(also, False)
        if pat is False:
            brk = self.literal_break
            texts = set(special_token_texts(self.tokenizer, brk))
            texts.update(t for t in also if t and brk not in t and _LONE not in t)
            ordered = sorted(texts, key=lambda t: (-len(t), t))
            pat = self._literal[also] = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        return pat

    def as_text(self, value: Any, also: tuple[str, ...] = ()) -> Any:
        """``value`` with every special token's text inside its strings broken (see the module docstring), so a
        tokenizer call reads it as text: for message contents, roles, tool call names and arguments, before
        a chat template renders them.

        Args:
            value: a string, or lists / tuples / dicts of them (keys included) and other values (kept).
            also: more texts to break the same way, which the tokenizer reads as text but a reader of the
                rendered context would take for markup (e.g. the ``<tool_response>`` tags of the tool protocol).
        Returns:
            The same structure (new containers; unchanged strings are the same objects). A string that holds
            no special token's text (nor one of ``also``) is returned as it is, so the ids of ordinary text do
            not change; applying it twice changes nothing more. Each match gets :attr:`literal_break` after
            its first character (a one-character special token's text becomes U+FFFD).
        """
        pattern = self._literal_pattern(tuple(also))
        if pattern is None:
            return value
        brk = self.literal_break

        def cut(m: re.Match) -> str:
            t = m.group(0)
            return t[0] + brk + t[1:] if len(t) > 1 else _LONE

        def walk(v: Any) -> Any:
            if isinstance(v, str):
                # each pass breaks at least one match and makes none (no text in the pattern holds the
                # inserted characters), so this ends; a second pass is needed only for overlapping texts
                while pattern.search(v):
                    v = pattern.sub(cut, v)
                return v
            if isinstance(v, dict):
                return {walk(k): walk(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x) for x in v]
            if isinstance(v, tuple):
                return tuple(walk(x) for x in v)
            return v

        return walk(value)

    @property
    def cached_tokens(self) -> int:
        """Ids the memo holds now."""
        return self._held

    def clear(self) -> None:
        """Forget every memoized piece."""
        with self._lock:
            self._memo.clear()
            self._held = 0
