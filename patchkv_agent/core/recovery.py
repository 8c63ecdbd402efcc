"""Execute a recovery plan on a Hugging Face model.

Builds the KV cache of ``C_new`` from three sources: (a) the exact prefix rows of a checkpoint,
(b) restored suffix rows, RoPE-corrected for their old->new shift, and (c) one forward over only
the tokens to recompute, at their true positions, with a true per-token causal mask (a recomputed
token at new position p sees every row at positions <= p: prefix, restored and recomputed; sliding
layers also mask rows outside their window). The recomputed K/V rows are scattered into place by a
cache layer whose ``update`` writes given rows of a preallocated full-length K/V.

K/V are in the layout of :mod:`.runner`: the buffers and the output per layer ``[1, H, N, D]`` on the model's
device; the rows restored from (a checkpoint's) per layer ``[H, N, D]``. The model is reached through its
:class:`~.runner.ModelRunner` (device, dtype); the transformers cache a resume decodes on is built there.

Knows models, the transport kernels (``dequantize_scatter_many``) and plans (duck-typed: ``prefix_len``,
``restore_old_positions``, ``restore_new_positions``, ``recompute_positions``); knows nothing about
diffing, planning policy or LangGraph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..kernels import RunPayload, ScatterCall, dequantize_scatter_many
from ..kernels.formats import DEFAULT_V_GROUP, FP16, effective_v_group
from .models import ModelSpec, cache_kwarg, text_config

if TYPE_CHECKING:
    from .checkpoint import MixedKV
    from .runner import ModelRunner


class PlanLike(Protocol):
    prefix_len: int
    restore_old_positions: np.ndarray
    restore_new_positions: np.ndarray
    recompute_positions: np.ndarray


@dataclass(frozen=True, kw_only=True)
class FullRecompute:
    """The exact path: no restored rows; every position from ``prefix_len`` on recomputed, the rows before
    it kept as they are (0: a full prefill; a heal recomputes the tail after the exact rows)."""

    new_len: int
    prefix_len: int = 0

    @property
    def restore_old_positions(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    @property
    def restore_new_positions(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    @property
    def recompute_positions(self) -> np.ndarray:
        return np.arange(self.prefix_len, self.new_len, dtype=np.int64)


class ScatterLayer(CacheLayerMixin):
    """A full-length K/V of one layer; ``update`` writes the forward's rows at ``targets``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        # keys/values: [1, num_kv_heads, N, head_dim]
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True
        self.targets: torch.Tensor | None = None
        self.ready: Any = None  # CUDA event: restored rows of this layer are in place

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - preallocated
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        if self.targets is None or self.targets.numel() != key_states.shape[-2]:
            raise RuntimeError("bug: ScatterLayer.update called without matching scatter targets")
        if self.ready is not None:  # restore runs on a side stream; attention must see its rows
            torch.cuda.current_stream(self.keys.device).wait_event(self.ready)
            self.ready = None
        self.keys.index_copy_(2, self.targets, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.targets, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class ScatterCache(Cache):
    """Cache of preallocated full-length layers; see :class:`ScatterLayer`."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__(layers=[ScatterLayer(k, v) for k, v in zip(keys, values)])

    def set_targets(self, positions: torch.Tensor) -> None:
        for layer in self.layers:
            layer.targets = positions


def build_masks(spec: ModelSpec, model, q_pos: torch.Tensor, n_keys: int, dtype: torch.dtype):
    """True per-token causal masks for queries at ``q_pos`` over key rows ``0..n_keys-1``.

    Returns a ``[1, 1, q, n_keys]`` mask (boolean for sdpa, additive for eager), or a dict keyed by
    layer type when the model has several layer types (sliding layers get their window).
    """
    impl = text_config(model)._attn_implementation
    kv = torch.arange(n_keys, device=q_pos.device)
    base = kv[None, :] <= q_pos[:, None]

    def fmt(allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed[None, None]
        if impl == "eager":
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(dtype).min)
        return allowed

    types = set(spec.layer_types)
    if len(types) == 1 and "sliding_attention" not in types:
        return fmt(base)
    out = {}
    for lt in types:
        allowed = base
        if lt == "sliding_attention" and spec.sliding_window:
            allowed = base & (kv[None, :] > q_pos[:, None] - spec.sliding_window)
        out[lt] = fmt(allowed)
    return out


def check_attn_implementation(model) -> None:
    """Raise ValueError unless the model's attention takes explicit 4D masks (sdpa or eager)."""
    impl = text_config(model)._attn_implementation
    if impl not in ("sdpa", "eager") and not str(impl).startswith("patchkv"):
        raise ValueError(
            f"attention implementation {impl!r} does not accept per-token 4D masks; load the model with "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))."
        )


@dataclass(frozen=True, kw_only=True)
class RecoveryStats:
    """What one recovery measured (the engine folds it into its :class:`~patchkv_agent.results.EnginePart`).
    Frozen: an executor that adds to another's measurement builds a new record (:meth:`adding`).

    Attributes:
        restore_s: restoring checkpoint rows (RoPE-corrected) into the buffers.
        recompute_s: the forward over the recomputed rows until the first-token logits.
        recompute_tokens: rows run through the model.
        payload_bytes: checkpoint bytes the restore read.
        restore_kernel: the restore's kernel path (``native``, ``torch``, ``triton``; None: nothing restored).
        extras: the fields one strategy's executor owns (CacheBlend's ``cacheblend_*``), read-only; they become
            the result's strategy extras and may not reuse a result field's name.
    """

    restore_s: float
    recompute_s: float
    recompute_tokens: int
    payload_bytes: int = 0
    restore_kernel: str | None = None
    extras: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not isinstance(self.extras, MappingProxyType):
            object.__setattr__(self, "extras", MappingProxyType(dict(self.extras)))

    def adding(self, *, restore_s: float = 0.0, recompute_s: float = 0.0, **extras: Any) -> "RecoveryStats":
        """A new record: these seconds added to this one's and ``extras`` added to its extras (an executor
        that ran another's recovery after work of its own, e.g. the measured tail rule's probe).

        Args:
            restore_s, recompute_s: seconds to add.
            **extras: strategy extras to add (a key already present takes the new value).

        Returns:
            The new :class:`RecoveryStats` (this one is unchanged).
        """
        return replace(self, restore_s=self.restore_s + restore_s, recompute_s=self.recompute_s + recompute_s,
                       extras={**self.extras, **extras})


@dataclass(frozen=True, kw_only=True)
class RecoveryOutput:
    """Result of :func:`execute`: first-token logits, the full K/V of ``C_new`` and what it cost (frozen: a
    strategy that changes the outcome builds a new one with ``dataclasses.replace``).

    ``plan`` is the plan that ran when an executor changed the one it was given (the measured tail rule moves
    the blocks it kept to the recompute rows; :mod:`patchkv_agent.core.layerwise`), else None."""

    logits: torch.Tensor  # [vocab], float32
    keys: list[torch.Tensor]  # per layer [1, H, N_new, D]
    values: list[torch.Tensor]
    stats: RecoveryStats
    plan: Any = None


def restore_rows(
    spec: ModelSpec,
    src_k: list[torch.Tensor],
    src_v: list[torch.Tensor],
    dst_k: list[torch.Tensor],
    dst_v: list[torch.Tensor],
    old_pos: np.ndarray,
    new_pos: np.ndarray,
    layers: Sequence[int] | None = None,
    shared: dict | None = None,
) -> str:
    """Copy checkpoint rows ``old_pos`` into ``new_pos`` of every layer, rotating keys by the shift.

    The rows go to :func:`~patchkv_agent.kernels.dequantize_scatter_many` as one full-precision
    run per layer (on CPU: the native one-pass restore when available, else torch ops).

    Args:
        spec: the model spec (per-layer RoPE).
        src_k, src_v: per layer ``[H, N_old, D]`` checkpoint tensors (CPU).
        dst_k, dst_v: per layer ``[1, H, N_new, D]`` destination tensors.
        old_pos, new_pos: aligned int64 arrays of rows.
        layers: restrict to these layers (default all).
        shared: one dict per restore made a few layers at a time: the row tensors and RoPE angles are built
            once in it (:func:`~patchkv_agent.kernels.dequantize_scatter_many`).

    Returns:
        The kernel path taken: ``"native"`` or ``"torch"``.

    Raises:
        RuntimeError: if a shifted row would need an unsupported RoPE (a bug: callers check first).
    """
    if len(old_pos) == 0:
        return "torch"
    shared = {} if shared is None else shared
    idx = shared.get("restore_rows")
    if idx is None:  # the rows, once per restore (a GPU restore runs a layer at a time)
        old_t = torch.from_numpy(np.array(old_pos, dtype=np.int64))
        new_t = torch.from_numpy(np.array(new_pos, dtype=np.int64))
        delta = torch.from_numpy(np.array(new_pos - old_pos, dtype=np.int64))
        idx = shared["restore_rows"] = (old_t, new_t, delta, bool((delta != 0).any()))
    old_t, new_t, delta, shifted = idx
    calls = []
    for layer in range(spec.num_layers) if layers is None else layers:
        rope = spec.rope_for_layer(layer)
        if shifted and not rope.supported:
            raise RuntimeError(f"bug: restoring shifted rows under unsupported RoPE ({rope.reason})")
        h, n_old, d = src_k[layer].shape  # the full-precision rows as one FP16 run, restored in part
        run = RunPayload(tag=FP16, n_rows=n_old, num_kv_heads=h, head_dim=d, block_size=max(n_old, 1),
                         v_group=effective_v_group(d, DEFAULT_V_GROUP), k_data=src_k[layer], v_data=src_v[layer])
        calls.append(ScatterCall(run, dst_k[layer][0], dst_v[layer][0], new_t, delta,
                                 rope.inv_freq if shifted else None, rope.interleaved, src_rows=old_t))
    return dequantize_scatter_many(calls, shared)


def restore_rows_mixed(
    spec: ModelSpec,
    mixed: "MixedKV",
    n_old: int,
    dst_k: list[torch.Tensor],
    dst_v: list[torch.Tensor],
    old_pos: np.ndarray,
    new_pos: np.ndarray,
    layers: Sequence[int] | None = None,
    shared: dict | None = None,
) -> tuple[int, str]:
    """Restore rows from mixed-precision payloads: verify, dequantize, RoPE-correct, scatter.

    Every payload is checksummed before any row of the restore is written; then all (layer, tag)
    runs go to :func:`~patchkv_agent.kernels.dequantize_scatter_many` at once (on CPU: one native
    multithreaded pass when available). A run only partly wanted restores just its wanted rows.

    Args:
        spec: the model spec (per-layer RoPE).
        mixed: the checkpoint's :class:`~patchkv_agent.core.checkpoint.MixedKV`.
        n_old: tokens in the checkpoint.
        dst_k, dst_v: per layer ``[1, H, N_new, D]`` destinations.
        old_pos, new_pos: aligned int64 rows to restore.
        layers: restrict to these layers (default all).
        shared: as for :func:`restore_rows`.

    Returns:
        ``(bytes, path)``: payload bytes read (whole tag payloads touched, all layers) and the
        kernel path taken (``"triton"``, ``"native"`` or ``"torch"``).

    Raises:
        CorruptCheckpoint: a payload failed its checksum (nothing is served from it).
    """
    if len(old_pos) == 0:
        return 0, "torch"
    device = dst_k[0].device
    shared = {} if shared is None else shared
    per_tag = shared.get("restore_rows_mixed")
    if per_tag is None:  # the rows of each tag, once per restore (a GPU restore runs a layer at a time)
        dst_of = np.full(n_old, -1, dtype=np.int64)
        dst_of[np.asarray(old_pos)] = np.asarray(new_pos)
        per_tag = shared["restore_rows_mixed"] = {}
        for tag, rows in mixed.tag_rows.items():
            dst = dst_of[rows]
            want = dst >= 0
            if not want.any():
                continue
            full = bool(want.all())
            per_tag[tag] = (torch.from_numpy((dst - rows)[want]), torch.from_numpy(dst[want].copy()).to(device),
                            None if full else torch.from_numpy(np.flatnonzero(want)))
    read, calls = 0, []
    for tag, (delta, dst_t, sel) in per_tag.items():
        for layer in range(spec.num_layers) if layers is None else layers:
            p = mixed.verify(layer, tag)
            read += p.nbytes
            rope = spec.rope_for_layer(layer)
            inv = rope.inv_freq if rope.supported else None
            calls.append(ScatterCall(p, dst_k[layer][0], dst_v[layer][0], dst_t, delta, inv, rope.interleaved,
                                     src_rows=sel))
    return read, dequantize_scatter_many(calls, shared) if calls else "torch"


class RecoveryBuffers:
    """The shared start of every recovery: a validated plan and the full-length K/V of ``C_new``.

    Allocates per layer ``[1, H, N_new, D]`` K/V on the model's device and dtype; :meth:`restore` fills
    the exact prefix rows and the restored suffix rows (RoPE-corrected), leaving the recompute rows to
    the caller's forward. Used by :func:`execute` (one forward) and by strategies with their own
    schedule (CacheBlend's layer-wise recompute).

    Args:
        runner: the HF causal LM's :class:`~.runner.ModelRunner`.
        spec: its :class:`ModelSpec`.
        new_ids: int64 ``[N_new]`` ids of ``C_new``.
        plan: restore/recompute positions; ``recompute_positions`` must end with ``N_new - 1``.

    Attributes:
        keys, values: per layer ``[1, H, N_new, D]`` destination tensors.
        recompute, restore_old, restore_new: the plan's rows as writable int64 arrays.
        prefix_len, n_new: the plan's prefix length and the context length.
        device, dtype: the model's.
        payload_bytes: checkpoint bytes read by :meth:`restore` so far.
        kernel: the restore's kernel path (``"native"``, ``"torch"``, ``"triton"``; None before a restore).

    Raises:
        ValueError: the plan does not recompute the last token or does not cover ``C_new`` exactly.
    """

    def __init__(self, runner: "ModelRunner", spec: ModelSpec, new_ids: torch.Tensor, plan: PlanLike):
        self.spec = spec
        self.n_new = n_new = int(new_ids.numel())
        self.recompute = np.array(plan.recompute_positions, dtype=np.int64)  # writable copies for torch
        if len(self.recompute) == 0 or self.recompute[-1] != n_new - 1:
            raise ValueError("plan must recompute the last context token (it produces the first logits)")
        self.prefix_len = int(plan.prefix_len)
        self.restore_old = np.array(plan.restore_old_positions, dtype=np.int64)
        self.restore_new = np.array(plan.restore_new_positions, dtype=np.int64)
        if self.prefix_len + len(self.restore_new) + len(self.recompute) != n_new:
            raise ValueError(f"plan covers {self.prefix_len}+{len(self.restore_new)}+{len(self.recompute)} rows, "
                             f"context has {n_new}")
        param = runner.parameter()
        self.device, self.dtype = param.device, param.dtype
        shape = (1, spec.num_kv_heads, n_new, spec.head_dim)
        self.keys = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(spec.num_layers)]
        self.values = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(spec.num_layers)]
        self.payload_bytes = 0
        self.kernel: str | None = None
        self._shared: dict = {}  # row tensors and RoPE angles, built once for all layers of this restore

    @property
    def restores_anything(self) -> bool:
        """True when the plan copies prefix rows or restores suffix rows."""
        return bool(self.prefix_len or len(self.restore_new))

    def restore(self, src_k: list[torch.Tensor] | None, src_v: list[torch.Tensor] | None,
                mixed: "MixedKV | None" = None, layers: Sequence[int] | None = None) -> int:
        """Copy the prefix rows and restore the suffix rows of ``layers`` (default all).

        Args:
            src_k, src_v: per layer ``[H, N_old, D]`` checkpoint K/V (needed when the plan restores rows).
            mixed: restore the suffix rows from these mixed-precision runs instead (prefix rows always
                come from the full-precision rows).
            layers: restrict to these layers.

        Returns:
            Checkpoint bytes read (also added to :attr:`payload_bytes`).

        Raises:
            CorruptCheckpoint: a mixed run failed its checksum.
        """
        layers = range(self.spec.num_layers) if layers is None else layers
        n_prefix, n_restore = self.prefix_len, len(self.restore_new)
        for layer in layers if n_prefix else ():
            self.keys[layer][0, :, :n_prefix].copy_(src_k[layer][:, :n_prefix], non_blocking=True)
            self.values[layer][0, :, :n_prefix].copy_(src_v[layer][:, :n_prefix], non_blocking=True)
        read = 0
        if n_restore and mixed is not None:
            read, self.kernel = restore_rows_mixed(self.spec, mixed, src_k[0].shape[1], self.keys, self.values,
                                                   self.restore_old, self.restore_new, layers, self._shared)
        elif n_restore:
            self.kernel = restore_rows(self.spec, src_k, src_v, self.keys, self.values, self.restore_old,
                                       self.restore_new, layers, self._shared)
            read = len(layers) * n_restore * src_k[0].shape[0] * src_k[0].shape[2] * src_k[0].element_size() * 2
        self.payload_bytes += read
        return read


def start_restore(buf: RecoveryBuffers, src_k: list[torch.Tensor] | None, src_v: list[torch.Tensor] | None,
                  mixed: "MixedKV | None" = None) -> list[Any] | None:
    """Fill ``buf``'s prefix and restored rows. On CUDA the restore runs layer by layer on a side stream and the
    per-layer events are returned (a layer's attention waits for its event, so the restore of deeper layers
    overlaps the forward of shallower ones: set them as the :class:`ScatterLayer` ``ready`` events); elsewhere it
    runs now and None is returned.

    Raises:
        CorruptCheckpoint: a mixed run failed its checksum.
    """
    if buf.device.type != "cuda" or not buf.restores_anything:
        buf.restore(src_k, src_v, mixed)
        return None
    side = torch.cuda.Stream(buf.device)
    side.wait_stream(torch.cuda.current_stream(buf.device))
    events = [torch.cuda.Event() for _ in range(buf.spec.num_layers)]
    with torch.cuda.stream(side):
        for layer in range(buf.spec.num_layers):
            buf.restore(src_k, src_v, mixed, [layer])
            events[layer].record(side)
    return events


@torch.no_grad()
def execute(
    runner: "ModelRunner",
    spec: ModelSpec,
    new_ids: torch.Tensor,
    plan: PlanLike,
    src_k: list[torch.Tensor] | None = None,
    src_v: list[torch.Tensor] | None = None,
    mixed: "MixedKV | None" = None,
) -> RecoveryOutput:
    """Run a plan: restore prefix and F rows, recompute the rest in one forward.

    Args:
        runner: the :class:`~.runner.ModelRunner` of the HF causal LM (sdpa or eager attention).
        spec: its :class:`ModelSpec`.
        new_ids: int64 ``[N_new]`` token ids of ``C_new``.
        plan: restore/recompute positions; ``recompute_positions`` must include ``N_new - 1``.
        src_k, src_v: per layer ``[H, N_old, D]`` checkpoint K/V (needed when the plan restores rows).
        mixed: restore the F rows from these mixed-precision runs instead of ``src_k/src_v``
            (prefix rows always come from the full-precision rows).

    Returns:
        :class:`RecoveryOutput` with first-token logits, full K/V and ``restore_s``/``recompute_s``.

    Raises:
        ValueError: the plan does not recompute the last token or does not cover C_new exactly.
        CorruptCheckpoint: a mixed run failed its checksum.
    """
    t0 = time.perf_counter()
    buf = RecoveryBuffers(runner, spec, new_ids, plan)
    model = runner.model
    device = buf.device
    events = start_restore(buf, src_k, src_v, mixed)
    t1 = time.perf_counter()

    q_pos = torch.from_numpy(buf.recompute).to(device)
    cache = ScatterCache(buf.keys, buf.values)
    cache.set_targets(q_pos)
    for layer, ev in enumerate(events or ()):
        cache.layers[layer].ready = ev
    mask = build_masks(spec, model, q_pos, buf.n_new, buf.dtype)
    out = model(
        input_ids=new_ids.to(device)[q_pos][None],
        position_ids=q_pos[None],
        attention_mask=mask,
        **{cache_kwarg(model): cache},
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[0, -1].float()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the decode waits for every restored row
    t2 = time.perf_counter()
    return RecoveryOutput(
        logits=logits, keys=buf.keys, values=buf.values,
        stats=RecoveryStats(restore_s=t1 - t0, recompute_s=t2 - t1, recompute_tokens=len(buf.recompute),
                            payload_bytes=buf.payload_bytes, restore_kernel=buf.kernel),
    )
