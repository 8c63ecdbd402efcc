"""The typed results of a resume: :class:`ResumeStats` (what the engine measured),
:class:`RuntimeStats` (plus what the runtime added: thread, base, store), :class:`CallStats` (what a chat-model
call added: tool mode, grammar, sampling, the tool wait) and :class:`PatchKVReport` (the runtime part and the call
part together, whose :meth:`~PatchKVReport.to_json` is the one JSON form of ``response_metadata["patchkv"]``), and
:class:`ResumeResult`. :class:`BaseKind` names where a resume's base KV came from.

The stats are dataclasses that also read as a mapping (``stats["ttft_s"]``, ``dict(stats)``,
``json.dumps(dict(stats))``): a result row (docs/TRACES.md), a LangChain ``response_metadata`` entry and a
benchmark summary are all :meth:`ResumeStats.to_dict` of one object, so the schema lives here only.
Strategy-specific fields (``restore_kernel``, ``cacheblend_*``) sit in ``extras`` and read the same way.

Boundary: data only. Knows the diff's :class:`~patchkv_agent.core.diff.Edit` and
:class:`~patchkv_agent.core.fallback.Fallback`; computes nothing, imports no model code.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

import numpy as np

from .core.diff import Edit
from .core.fallback import Fallback

__all__ = ["ResumeStats", "RuntimeStats", "CallStats", "PatchKVReport", "BaseKind", "ResumeResult", "json_safe"]


class BaseKind(str, enum.Enum):
    """Where a runtime resume's base KV came from (``RuntimeStats.base``; the values are the JSON strings).

    ``RESIDENT``: the thread's last resume, still on the device; ``PREPARED``: the context prepared while the
    thread's tools ran; ``BACKGROUND`` / ``EVICTED``: a checkpoint this process offloaded (after the call, or when
    the resident budget evicted it); ``RESTART``: a store entry found after a restart; ``NONE``: no base (an
    exact recompute).
    """

    RESIDENT = "resident"
    PREPARED = "prepared"
    BACKGROUND = "background"
    EVICTED = "evicted"
    RESTART = "restart"
    NONE = "none"

    def __str__(self) -> str:
        return self.value

    @property
    def offload_waited(self) -> bool:
        """Whether a resume from this base could have waited for an offload (only a background checkpoint's)."""
        return self is BaseKind.BACKGROUND


@dataclass(kw_only=True, eq=False)
class ResumeStats(Mapping):
    """The per-resume fields of the trace-result format (docs/TRACES.md), as the engine fills them.

    Reads as a read-only mapping of :meth:`to_dict` (named fields in order, then ``extras``); set a field
    as an attribute.

    Attributes:
        strategy: the strategy that ran (``exact`` after a fallback).
        prompt_tokens: tokens in ``C_new``.
        prefix_tokens: common-prefix tokens of the checkpoint's version and ``C_new``.
        new_tokens: tokens of ``C_new`` in edited spans.
        suffix_tokens: aligned suffix tokens.
        recompute_tokens: rows recomputed.
        recompute_ratio: ``recompute_tokens`` over the rows after the reused prefix.
        restore_tokens: suffix rows restored from the checkpoint.
        payload_bytes: checkpoint bytes read by the restore.
        ttft_s: restore + recompute until the first token's logits.
        plan_s: diff + plan.
        restore_s, recompute_s: the two parts of the recovery.
        offload_s, stats_s, quantize_s: the checkpoint's own costs (None without a checkpoint).
        fallback: None, or why the exact path was taken (a :class:`Fallback`, serialised as its text).
        approx_rows: rows of the result's K/V that may differ from a full prefill (0: exact).
        nonfinite_values: non-finite values in the logits and recomputed K/V rows (reported, never raised).
        head_rewrite: the plan's head-rewrite rule recomputed every suffix token.
        small_restore: the plan's small-restore rule recomputed every suffix token (too little to restore).
        heal_s, healed_rows: set on the copy :meth:`PatchKVEngine.heal` returns (None before a heal).
        extras: strategy-specific fields (``restore_kernel``, ``cacheblend_*``), in the order given.
    """

    strategy: str
    prompt_tokens: int
    prefix_tokens: int
    new_tokens: int
    suffix_tokens: int
    recompute_tokens: int
    recompute_ratio: float
    restore_tokens: int
    payload_bytes: int
    ttft_s: float
    plan_s: float
    restore_s: float
    recompute_s: float
    offload_s: float | None
    stats_s: float | None
    quantize_s: float | None
    fallback: Fallback | None
    approx_rows: int = 0
    nonfinite_values: int = 0
    head_rewrite: bool = False
    small_restore: bool = False
    heal_s: float | None = None
    healed_rows: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The named fields, in the order :meth:`to_dict` writes them (``extras`` excluded)."""
        return tuple(f.name for f in fields(cls) if f.name != "extras")

    def to_dict(self) -> dict[str, Any]:
        """The stats dict of a resume: the named fields in order, then the extras not named."""
        out = {k: getattr(self, k) for k in self.field_names()}
        out.update({k: v for k, v in self.extras.items() if k not in out})
        return out

    def to_json(self, *, arrays: bool = True) -> dict[str, Any]:
        """:meth:`to_dict`, JSON-safe: the result row of docs/TRACES.md and the ``response_metadata["patchkv"]``
        of a chat model reply. ``fallback`` becomes its text, numpy scalars Python numbers, arrays lists
        (``arrays=False``: array fields are left out)."""
        out = {}
        for k, v in self.to_dict().items():
            if isinstance(v, np.ndarray) and not arrays:
                continue
            out[k] = json_safe(v)
        return out

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any]) -> "ResumeStats":
        """Read a stats dict back; keys beyond the named fields go to ``extras``.

        Raises:
            KeyError: a required field (one without a default) is missing.
        """
        names = cls.field_names()
        required = {f.name for f in fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(stats))
        if missing:
            raise KeyError(f"stats lack the fields {missing}")
        return cls(**{k: stats[k] for k in names if k in stats},
                   extras={k: v for k, v in stats.items() if k not in names})

    def extend(self, cls: type["ResumeStats"], **values) -> "ResumeStats":
        """A copy as ``cls`` (a subclass, e.g. :class:`RuntimeStats`) with ``values`` set.

        Raises:
            TypeError: ``cls`` is not a subclass, or a value names no field of ``cls``.
        """
        if not (isinstance(cls, type) and issubclass(cls, ResumeStats)):
            raise TypeError(f"extend takes a ResumeStats subclass, got {cls!r}")
        theirs = set(cls.field_names())
        own = {k: getattr(self, k) for k in self.field_names() if k in theirs}
        own["extras"] = dict(self.extras)
        return cls(**{**own, **values})

    # read-only mapping view of to_dict (Mapping supplies get, keys, items, values, ==, in)
    def __getitem__(self, key: str) -> Any:
        if key != "extras" and key in self.field_names():
            return getattr(self, key)
        return self.extras[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None  # mutable


def json_safe(x: Any) -> Any:
    """``x`` with Fallbacks as text, numpy scalars as Python numbers and arrays as lists (nested)."""
    if isinstance(x, Fallback):
        return str(x)
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, Mapping):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


@dataclass(kw_only=True, eq=False)
class RuntimeStats(ResumeStats):
    """:class:`ResumeStats` plus the fields the runtime adds (a registry's thread, the base it resumed
    from, a store read, the stream's decode); the fields of a layer that did not run stay None.

    Attributes:
        requested_strategy: the strategy the caller asked for (``strategy`` is what ran).
        thread_id, checkpoint_ns, context: the registry thread key and the context (lane) it resumed in.
        version, base_version: this version's number and the one it was resumed from (None: none).
        base: where the base KV came from, a :class:`BaseKind` (its string in JSON).
        offload_wait_s: time spent waiting for a pending offload before the resume.
        heal_wait_s: time spent waiting for a heal in progress.
        base_approx_rows: approximate rows in the resident base (0 once healed).
        base_heal_s, base_healed_rows: the heal of the base (None: no heal ran).
        store_tier, store_get_s, store_key: the store read of a resume from a checkpoint tier.
        decode_s, output_tokens: set when a stream ends.
        prepared: the tool-wait preparation of this call's context: ``hit`` (the call's context starts
            with the prepared one), ``partial`` (a prefix of it was ready, or the call diverged inside it,
            and the resume started there), ``miss`` (prepared, not used: the resident base shared more),
            ``unfinished`` (still predicting or queued when the call came), ``failed`` (no prediction: see
            ``prepared_reason``); None: nothing was prepared.
        prepared_reason: why a preparation was not a hit (or the prediction's note on a hit).
        prepared_tokens: rows the preparation computed in the background.
        prepared_wasted: of those, rows this call did not use.
        prepared_hidden_share: the share of this call's recompute (rows from the first token it changed
            against the thread's previous context) done during the tool wait.
        prepared_info: the prediction's own notes (editors applied, assumptions made).
        prepared_predict_s, prepared_compute_s: the preparation's prediction (editors, renders, a summary
            made during the wait) and its chunked forward, both in the background.
    """

    requested_strategy: str | None = None
    thread_id: str | None = None
    checkpoint_ns: str | None = None
    context: Any = None
    version: int | None = None
    base_version: int | None = None
    base: BaseKind | None = None
    offload_wait_s: float | None = None
    heal_wait_s: float | None = None
    base_approx_rows: int | None = None
    base_heal_s: float | None = None
    base_healed_rows: int | None = None
    store_tier: str | None = None
    store_get_s: float | None = None
    store_key: str | None = None
    decode_s: float | None = None
    output_tokens: int | None = None
    prepared: str | None = None
    prepared_reason: str | None = None
    prepared_tokens: int | None = None
    prepared_wasted: int | None = None
    prepared_hidden_share: float | None = None
    prepared_info: dict | None = None
    prepared_predict_s: float | None = None
    prepared_compute_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class CallStats:
    """What a chat-model call adds to its resume's stats (the call part of :class:`PatchKVReport`).

    Attributes:
        tool_mode: how tools were offered (``none``, ``auto``, ``required``, ``forced``...).
        thread_key: the registry thread key ``[thread_id, checkpoint_ns]`` (None: no thread).
        grammar: the constrained-decoding grammar's kind (None: unconstrained).
        sampling: ``{"temperature", "top_p", "seed"}`` of the decode.
        grammar_mask_s, grammar_steps: the grammar's masking time and steps (None without a grammar).
        tool_s: the tools' wall time before this call (set by the middleware, None before).
        offload_hidden_share: the share of the base's offload hidden behind the tool wait (set by the middleware).
    """

    tool_mode: str | None = None
    thread_key: list | None = None
    grammar: str | None = None
    sampling: dict | None = None
    grammar_mask_s: float | None = None
    grammar_steps: int | None = None
    tool_s: float | None = None
    offload_hidden_share: float | None = None

    def replace(self, **values) -> "CallStats":
        """A copy with ``values`` set (an unknown name raises ``TypeError``)."""
        return dataclasses.replace(self, **values)


_CALL_FIELDS = tuple(f.name for f in fields(CallStats))


@dataclass(frozen=True)
class PatchKVReport:
    """A chat-model response's PatchKV report: the resume's stats (the engine and runtime parts) and the call part.

    :meth:`to_json` is the one JSON form (``AIMessage.response_metadata["patchkv"]``): the stats' fields, then the
    call's; :meth:`from_json` reads it back, so a layer above the chat model (the middleware) adds its fields with
    :meth:`with_call` and writes the whole report, never editing another layer's keys.
    """

    stats: ResumeStats
    call: CallStats = field(default_factory=CallStats)

    def with_call(self, **values) -> "PatchKVReport":
        """A copy whose call part has ``values`` set."""
        return PatchKVReport(self.stats, self.call.replace(**values))

    def to_json(self) -> dict[str, Any]:
        out = self.stats.to_json()
        out.update({k: json_safe(getattr(self.call, k)) for k in _CALL_FIELDS})
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "PatchKVReport":
        """Read :meth:`to_json` back (the stats as :class:`RuntimeStats`: runtime fields absent stay None).

        Raises:
            KeyError: a required stats field is missing.
        """
        data = dict(data)
        call = CallStats(**{k: data.pop(k) for k in _CALL_FIELDS if k in data})
        base = data.get("base")
        if isinstance(base, str) and base in BaseKind._value2member_map_:
            data["base"] = BaseKind(base)
        return cls(RuntimeStats.from_dict(data), call)


@dataclass(eq=False)
class ResumeResult:
    """What a resume returns.

    Attributes:
        logits: first-token logits ``[vocab]`` (float32).
        output_ids: greedy continuation (ends with EOS if one was produced).
        cache: a transformers ``DynamicCache`` holding ``C_new``'s KV plus the decoded tokens except
            the last; ``model(input_ids=[[output_ids[-1]]], cache=res.cache)`` continues.
        stats: a :class:`ResumeStats` (the runtime's results: a :class:`RuntimeStats`); reads as the
            result format's dict (``ttft_s``, ``recompute_tokens``, ``fallback``: None, or a
            :class:`~patchkv_agent.core.fallback.Fallback` saying why the exact path was taken).
        context_ids: ``C_new`` token ids.
        keys, values: per layer ``[1, H, len(C_new), D]`` K/V of ``C_new`` (what the next checkpoint holds).
        edit: the diff of the checkpoint's version against ``C_new``.
        fingerprint: the model fingerprint the K/V were computed under (None: unknown, taken as the
            engine's current one).
        scores: float32 ``[len(C_new)]`` attention statistics taken during the resume's own forward (the
            last ``capture_window`` recomputed query rows, which end with the last context token), or None;
            ``PatchKVEngine.checkpoint_from`` and ``PatchKVEngine.as_checkpoint`` use them instead of a
            second pass.
        exact_rows: how many leading rows of ``keys`` / ``values`` equal what a full prefill computes
            (``len(context_ids)`` after ``exact`` / ``prefix`` / a healed resume; the first restored
            position, or less when the base was itself approximate, after a selective one). Rows from
            there on were computed while restored (stale) rows were in view: ``PatchKVEngine.heal``
            recomputes them. None: unknown (a result built by hand), taken as all rows exact.
        words: int64 word ids of ``context_ids[:len(words)]`` (the lexical reader signal's per-version data,
            carried from the checkpoint and updated over the edited spans only), or None without a
            tokenizer. A runtime that appends decoded tokens to ``context_ids`` leaves it as it is: the
            engine extends it over the appended tokens when it offloads.
    """

    logits: Any
    output_ids: list[int]
    cache: Any
    stats: ResumeStats
    context_ids: np.ndarray
    keys: list = field(repr=False)
    values: list = field(repr=False)
    edit: Edit | None = None
    fingerprint: str | None = None
    scores: np.ndarray | None = field(default=None, repr=False)
    exact_rows: int | None = None
    words: np.ndarray | None = field(default=None, repr=False)

    @property
    def approx_rows(self) -> int:
        """Rows of the K/V that may differ from a full prefill (0: the state is exact)."""
        n = int(self.keys[0].shape[-2]) if self.keys else len(self.context_ids)
        return 0 if self.exact_rows is None else max(0, n - int(self.exact_rows))
