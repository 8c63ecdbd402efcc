"""The typed results of a resume: :class:`ResumeStats`, made of one part per layer that measured something,
and :class:`ResumeResult`.

- :class:`EnginePart`: what the engine and the strategy measured (tokens, plan counts, times, the restore
  kernel, a fallback, a heal), written by the engine only; ``extras`` holds the fields one strategy owns
  (CacheBlend's ``cacheblend_*``), nobody else's.
- :class:`RuntimePart`: what the registry and the store resume add (thread, version, the :class:`BaseKind` it
  resumed from, waits, the store read, the tool-wait preparation's :class:`PreparedOutcome`).
- :class:`CallPart`: what the call adds (the stream's decode, the chat model's tool mode, grammar and
  sampling, the middleware's tool time).

Every part is a frozen dataclass; a layer adds its part with :meth:`ResumeStats.with_runtime` /
:meth:`ResumeStats.with_call` (a new object: no layer edits another's fields, nobody edits a dict). The
one JSON form is :meth:`ResumeStats.to_json` (read back by :meth:`ResumeStats.from_json`): a flat object,
the engine's fields, then the runtime's and the call's when those parts are present, then the strategy's
extras. It is the result row of docs/TRACES.md, a LangChain ``response_metadata["patchkv"]`` entry and a
benchmark summary's source alike, so the schema lives here only. ``ResumeStats`` also reads as a read-only
mapping of that form (``stats["ttft_s"]``) and its fields as attributes (``stats.ttft_s``, ``stats.base``:
None when the part that owns the field is absent).

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
from .core.fallback import Fallback, FallbackKind

__all__ = ["ResumeStats", "EnginePart", "PrepareStats", "RuntimePart", "CallPart", "SamplingInfo", "BaseKind",
           "PreparedOutcome", "ResumeResult", "json_safe"]


class BaseKind(enum.StrEnum):
    """Where a resume's base KV came from (``RuntimePart.base``; the value is what JSON holds)."""

    RESIDENT = "resident"      # the thread's last resume, still on the device
    PREPARED = "prepared"      # the context prepared while the tools ran (a hit or a partial)
    BACKGROUND = "background"  # the checkpoint the background offload wrote (in this process or the store)
    EVICTED = "evicted"        # the checkpoint written when the resident KV was evicted
    RESTART = "restart"        # a store entry found for a graph checkpoint after a restart
    NONE = "none"              # no base: recomputed exactly (``fallback`` says why when one was expected)


class PreparedOutcome(enum.StrEnum):
    """What the tool-wait preparation was to this call (``RuntimePart.prepared``)."""

    HIT = "hit"                # the call's context starts with the prepared one
    PARTIAL = "partial"        # a prefix was ready, or the call diverged inside it; the resume started there
    MISS = "miss"              # prepared, not used (the resident base recomputes less, or an exact call)
    UNFINISHED = "unfinished"  # still predicting or queued when the call came
    FAILED = "failed"          # no prediction (``prepared_reason`` says why)


class _Part:
    """Shared helpers of the frozen parts: field names, a validated ``replace``, the JSON form."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields, in the order the JSON form writes them."""
        return tuple(f.name for f in fields(cls))

    def replace(self, **values):
        """A copy with ``values`` set.

        Raises:
            TypeError: a value names no field of this part.
        """
        unknown = sorted(set(values) - set(self.field_names()))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no fields {unknown}")
        return dataclasses.replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.field_names()}


class _ReadOnlyMap(Mapping):
    """A read-only mapping (the strategy extras, a prediction's notes): no layer edits another's."""

    __slots__ = ("_d",)

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._d = dict(items or {})

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return repr(self._d)

    def __reduce__(self):
        return (_ReadOnlyMap, (self._d,))


@dataclass(frozen=True, kw_only=True)
class PrepareStats(_Part):
    """The chunked computation of a prepared context (:meth:`~patchkv_agent.engine.PatchKVEngine.prepare`).

    Attributes:
        reused_rows: leading rows copied from the base's exact rows.
        computed_rows: rows recomputed in chunks.
        chunks: background forwards run.
        stopped: a stop request ended it before the last chunk.
        forward_s: seconds in the forwards (their sum; the waits for the lock excluded).
    """

    reused_rows: int
    computed_rows: int
    chunks: int
    stopped: bool
    forward_s: float


@dataclass(frozen=True, kw_only=True, eq=False)
class EnginePart(_Part):
    """What the engine and the strategy measured: the per-resume fields of the trace-result format
    (docs/TRACES.md). Written by the engine only.

    Attributes:
        strategy: the strategy that ran (``exact`` after a fallback, ``prepared`` for a preparation).
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
        offload_s, stats_s, quantize_s: the checkpoint's own costs (its provenance; None without a checkpoint).
        fallback: None, or why the exact path was taken (a :class:`Fallback`; JSON: its text, and its kind as
            ``fallback_kind``).
        approx_rows: rows of the result's K/V that may differ from a full prefill (0: exact).
        nonfinite_values: non-finite values in the logits and recomputed K/V rows (reported, never raised).
        head_rewrite: the plan's head-rewrite rule recomputed every suffix token.
        small_restore: the plan's small-restore rule recomputed every suffix token (too little to restore).
        heal_s, healed_rows: set on the copy :meth:`PatchKVEngine.heal` returns (None before a heal).
        restore_kernel: the restore path that ran (``native``, ``torch``, ``triton``); None when the executor
            restored nothing or has its own (CacheBlend).
        prepare: the chunked computation, on a preparation's result only (None otherwise; absent from JSON).
        extras: fields one strategy owns (CacheBlend: ``cacheblend_full_layers``, ``cacheblend_full_tokens``,
            ``cacheblend_selected``, ``cacheblend_selected_positions``; patchkv's measured tail rule:
            ``tail_probe_blocks``, ``tail_probe_tokens``, ``tail_recomputed_blocks``, ``tail_recomputed_tokens``,
            ``tail_deviation_max``, ``tail_block_deviation``, ``tail_small_restore``, ``tail_probe``), read-only, in the order given; their
            names never shadow a field of any part.

    Raises:
        ValueError: an extras key that is a field name of a part.
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
    restore_kernel: str | None = None
    prepare: PrepareStats | None = None
    extras: Mapping[str, Any] = field(default_factory=_ReadOnlyMap)

    def __post_init__(self):
        if self.fallback is not None and not isinstance(self.fallback, Fallback):
            raise TypeError(f"fallback must be a Fallback or None, got {type(self.fallback).__name__}")
        clash = sorted(set(self.extras) & _RESERVED)
        if clash:
            raise ValueError(f"strategy extras may not use the result's field names {clash}")
        if not isinstance(self.extras, _ReadOnlyMap):
            object.__setattr__(self, "extras", _ReadOnlyMap(self.extras))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The named fields, in the order the JSON form writes them (``prepare`` and ``extras`` excluded)."""
        return tuple(f.name for f in fields(cls) if f.name not in ("prepare", "extras"))

    def to_dict(self) -> dict[str, Any]:
        """The named fields in order (``fallback_kind`` after ``fallback``), then ``prepare`` when set."""
        out: dict[str, Any] = {}
        for k in self.field_names():
            out[k] = getattr(self, k)
            if k == "fallback":
                out["fallback_kind"] = self.fallback.kind if self.fallback is not None else None
        if self.prepare is not None:
            out["prepare"] = self.prepare
        return out


@dataclass(frozen=True, kw_only=True)
class RuntimePart(_Part):
    """What the runtime adds: a registry's thread, the base it resumed from, a store read, the tool-wait
    preparation. Written by :class:`~patchkv_agent.runtime.threads.ThreadRegistry` and the store resume; the
    fields of a step that did not run stay None.

    Attributes:
        requested_strategy: the strategy the caller asked for (``strategy`` is what ran).
        thread_id, checkpoint_ns, context: the registry thread key and the context (lane) it resumed in.
        version, base_version: this version's number and the one it was resumed from (None: none).
        base: where the base KV came from, a :class:`BaseKind`.
        offload_wait_s: time spent waiting for a pending offload before the resume.
        heal_wait_s: time spent waiting for a heal in progress.
        base_approx_rows: approximate rows in the resident base (0 once healed).
        base_heal_s, base_healed_rows: the heal of the base (None: no heal ran).
        store_tier, store_get_s, store_key: the store read of a resume from a checkpoint tier.
        prepared: the tool-wait preparation of this call's context, a :class:`PreparedOutcome`; None: nothing
            was prepared.
        prepared_reason: why a preparation was not a hit (or the prediction's note on a hit).
        prepared_tokens: rows the preparation computed in the background.
        prepared_wasted: of those, rows this call did not use.
        prepared_hidden_share: the share of this call's recompute (rows from the first token it changed
            against the thread's previous context) done during the tool wait.
        prepared_info: the prediction's own notes (editors applied, assumptions made), read-only.
        prepared_predict_s, prepared_compute_s: the preparation's prediction (editors, renders, a summary
            made during the wait) and its chunked forward, both in the background.
    """

    requested_strategy: str | None = None
    thread_id: str | None = None
    checkpoint_ns: str | None = None
    context: str | None = None
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
    prepared: PreparedOutcome | None = None
    prepared_reason: str | None = None
    prepared_tokens: int | None = None
    prepared_wasted: int | None = None
    prepared_hidden_share: float | None = None
    prepared_info: Mapping[str, Any] | None = None
    prepared_predict_s: float | None = None
    prepared_compute_s: float | None = None

    @classmethod
    def preparation_fields(cls) -> tuple[str, ...]:
        """The fields the tool-wait preparation reports (``prepared*``; its record,
        :class:`~patchkv_agent.runtime.state.TakenPreparation`, sets only these)."""
        return tuple(n for n in cls.field_names() if n.startswith("prepared"))

    def __post_init__(self):
        if self.base is not None:
            object.__setattr__(self, "base", BaseKind(self.base))
        if self.prepared is not None:
            object.__setattr__(self, "prepared", PreparedOutcome(self.prepared))
        if self.prepared_info is not None and not isinstance(self.prepared_info, _ReadOnlyMap):
            object.__setattr__(self, "prepared_info", _ReadOnlyMap(self.prepared_info))


@dataclass(frozen=True, kw_only=True)
class SamplingInfo(_Part):
    """The sampling parameters of a call (JSON: ``{"temperature", "top_p", "seed"}``)."""

    temperature: float
    top_p: float
    seed: int | None = None


@dataclass(frozen=True, kw_only=True)
class CallPart(_Part):
    """What the call adds: the decode (:class:`~patchkv_agent.runtime.stream.TokenStream`), the chat model
    (:class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel`) and the agent middleware
    (:class:`~patchkv_agent.langgraph.middleware.PatchKVMiddleware`); the fields of a layer that did not run
    stay None.

    Attributes:
        decode_s, output_tokens: the decode, set when the stream ends.
        tool_mode: how tools were rendered (``template``, ``json``; chat model).
        thread_key: the ``(thread_id, checkpoint_ns)`` the call resumed (chat model; JSON: a list).
        grammar: the grammar the decode ran under (its kind), or None (chat model).
        sampling: the sampling parameters (chat model).
        grammar_mask_s, grammar_steps: the grammar's masking time and steps (chat model, under a grammar).
        tool_s: the tools run since the thread's previous call (middleware).
        offload_hidden_share: the share of the base's offload the tools hid (middleware).
        prepared_unexplained: on a call that left its prediction, what the editors given to the middleware
            do not explain (an edit made by a middleware the prediction did not run), else None (middleware).
    """

    decode_s: float | None = None
    output_tokens: int | None = None
    tool_mode: str | None = None
    thread_key: tuple[str, str] | None = None
    grammar: str | None = None
    sampling: SamplingInfo | None = None
    grammar_mask_s: float | None = None
    grammar_steps: int | None = None
    tool_s: float | None = None
    offload_hidden_share: float | None = None
    prepared_unexplained: str | None = None

    def __post_init__(self):
        if self.thread_key is not None:
            object.__setattr__(self, "thread_key", tuple(str(x) for x in self.thread_key))
        if isinstance(self.sampling, Mapping):
            object.__setattr__(self, "sampling", SamplingInfo(**self.sampling))


_PARTS: tuple[tuple[str, type[_Part]], ...] = (("engine", EnginePart), ("runtime", RuntimePart), ("call", CallPart))
# flat name -> the part that owns it (``extras`` and ``prepare`` are the engine's)
_OWNER: dict[str, str] = {n: p for p, cls in _PARTS for n in (f.name for f in fields(cls))}
assert len(_OWNER) == sum(len(fields(cls)) for _, cls in _PARTS), "bug: two parts name the same field"
_RESERVED = frozenset(_OWNER) | {"fallback_kind"}


@dataclass(frozen=True, eq=False)
class ResumeStats(Mapping):
    """The stats of one resume: an :class:`EnginePart`, and a :class:`RuntimePart` and a :class:`CallPart`
    when those layers ran.

    Reads as a read-only mapping of :meth:`to_dict` (the JSON form's keys), and every part's fields read as
    read-only properties (``stats.ttft_s``, ``stats.base``; None for a field of an absent part). A layer adds its own
    part through :meth:`with_runtime` / :meth:`with_call`, which return a new object.

    Attributes:
        engine: what the engine measured.
        runtime: what the runtime added, or None (an engine call).
        call: what the call added (decode, chat model, middleware), or None.
    """

    engine: EnginePart
    runtime: RuntimePart | None = None
    call: CallPart | None = None

    def __post_init__(self):
        for name, cls in _PARTS:
            v = getattr(self, name)
            if not (isinstance(v, cls) or (v is None and name != "engine")):
                raise TypeError(f"ResumeStats.{name} must be a {cls.__name__}, got {type(v).__name__}")

    @property
    def fallback_kind(self) -> FallbackKind | None:
        """The fallback's kind (None: no fallback)."""
        fb = self.engine.fallback
        return fb.kind if fb is not None else None

    # ------------------------------------------------------------------ adding a part

    def with_engine(self, **values) -> "ResumeStats":
        """A copy with engine fields set: for :meth:`PatchKVEngine.heal`, and for a runtime layer that decided
        to run the engine exactly and records why (``fallback``).

        Raises:
            TypeError: a value names no :class:`EnginePart` field.
        """
        return dataclasses.replace(self, engine=self.engine.replace(**values))

    def with_runtime(self, **values) -> "ResumeStats":
        """A copy with :class:`RuntimePart` fields set (the part is created when absent).

        Raises:
            TypeError: a value names no :class:`RuntimePart` field.
        """
        return dataclasses.replace(self, runtime=(self.runtime or RuntimePart()).replace(**values))

    def with_call(self, **values) -> "ResumeStats":
        """A copy with :class:`CallPart` fields set (the part is created when absent).

        Raises:
            TypeError: a value names no :class:`CallPart` field.
        """
        return dataclasses.replace(self, call=(self.call or CallPart()).replace(**values))

    # ------------------------------------------------------------------ the one JSON form

    def to_dict(self) -> dict[str, Any]:
        """The flat view: the engine's fields, the runtime's and the call's (when present), then the
        strategy's extras. Values as held (Fallback, enums, arrays, parts); :meth:`to_json` is its JSON form."""
        out = self.engine.to_dict()
        for part in (self.runtime, self.call):
            if part is not None:
                out.update(part.to_dict())
        out.update(self.engine.extras)
        return out

    def to_json(self, *, arrays: bool = True) -> dict[str, Any]:
        """The one JSON form: the result row of docs/TRACES.md, the ``response_metadata["patchkv"]`` of a chat
        model reply, what the benches write. ``fallback`` becomes its text (``fallback_kind`` its kind), enums
        their values, nested parts objects, numpy scalars Python numbers, arrays lists (``arrays=False``: array
        fields are left out)."""
        return {k: json_safe(v) for k, v in self.to_dict().items() if arrays or not isinstance(v, np.ndarray)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ResumeStats":
        """Read :meth:`to_json` (or :meth:`to_dict`) back. A part is built when any of its keys is present;
        keys no part names are the strategy's extras.

        Raises:
            KeyError: a required engine field is missing.
            ValueError: a ``fallback`` without its ``fallback_kind``, an unknown enum value.
            TypeError: ``data`` is not a mapping.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"ResumeStats.from_json takes a mapping, got {type(data).__name__}")
        data = dict(data)
        engine = {k: data[k] for k in EnginePart.field_names() if k in data}
        required = {f.name for f in fields(EnginePart)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise KeyError(f"stats lack the fields {missing}")
        fb, kind = data.get("fallback"), data.get("fallback_kind")
        if fb is not None and not isinstance(fb, Fallback):
            if kind is None:
                raise ValueError("a fallback text without its fallback_kind cannot be read back")
            kind = FallbackKind(kind)
            engine["fallback"] = Fallback.from_text(kind, str(fb))
        if data.get("prepare") is not None:
            p = data["prepare"]
            engine["prepare"] = p if isinstance(p, PrepareStats) else PrepareStats(**p)
        engine["extras"] = {k: v for k, v in data.items() if k not in _RESERVED}
        parts: dict[str, Any] = {"engine": EnginePart(**engine)}
        for name, pcls in _PARTS[1:]:
            own = {k: data[k] for k in pcls.field_names() if k in data}
            parts[name] = pcls(**own) if own else None
        return cls(**parts)

    # ------------------------------------------------------------------ read-only mapping view of to_dict

    def __getitem__(self, key: str) -> Any:
        if key in _OWNER and key not in ("extras", "prepare"):
            part = self.__dict__.get(_OWNER[key])
            if part is None:
                raise KeyError(key)
            return getattr(part, key)
        if key == "fallback_kind":
            return self.fallback_kind
        if key == "prepare" and self.engine.prepare is not None:
            return self.engine.prepare
        return self.engine.extras[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None


def _flat_read(part: str, name: str) -> property:
    def read(self: ResumeStats) -> Any:
        obj = getattr(self, part)
        return getattr(obj, name) if obj is not None else None

    read.__name__ = name
    return property(read, doc=f"``{part}.{name}`` (None without the {part} part; read-only).")


# every part's field reads as a property of ResumeStats (derived, read-only; an unknown name is an AttributeError)
for _name, _part in _OWNER.items():
    assert not hasattr(ResumeStats, _name), f"bug: {_name} shadows a ResumeStats attribute"
    setattr(ResumeStats, _name, _flat_read(_part, _name))
del _name, _part


def json_safe(x: Any) -> Any:
    """``x`` with Fallbacks as text, enums as values, parts as objects, numpy scalars as Python numbers and
    arrays as lists (nested)."""
    if isinstance(x, Fallback):
        return str(x)
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, _Part):
        return {k: json_safe(v) for k, v in x.to_dict().items()}
    if isinstance(x, Mapping):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


@dataclass(eq=False)
class ResumeResult:
    """What a resume returns.

    Attributes:
        logits: first-token logits ``[vocab]`` (float32).
        output_ids: greedy continuation (ends with EOS if one was produced).
        cache: a transformers ``DynamicCache`` holding ``C_new``'s KV plus the decoded tokens except
            the last; ``model(input_ids=[[output_ids[-1]]], cache=res.cache)`` continues.
        stats: a :class:`ResumeStats` (the engine's part; a registry's results add the runtime's and the
            call's); reads as the result format's dict (``ttft_s``, ``recompute_tokens``, ``fallback``: None,
            or a :class:`~patchkv_agent.core.fallback.Fallback` saying why the exact path was taken).
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
