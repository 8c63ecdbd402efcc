"""ModelRunner: what the package keeps about one model instance, in one object beside it.

Nothing is written onto the user's model (no attribute, no entry in a map of models): its forward lock, its
attention capture, its weight watch, the layer layout of the transformers cache it decodes on, and the lookup
of its first parameter (device and dtype) live in the model's :class:`ModelRunner`. The engine, the recovery
(:mod:`.recovery`), the preparation (:mod:`.prepare`) and the strategies reach the model through it
(``runner.model``).

Sharing. Every engine built over one model instance gets the same runner (:meth:`ModelRunner.of`), so they
share one :class:`~.weights.ForwardLock`: one forward at a time per model, whatever number of engines,
registries and direct callers use it (an attention capture swaps the model's attention function for its
pass: another forward inside it would be recorded, or race the swap). The table behind :meth:`ModelRunner.of`
(:class:`RunnerTable`, one per process: :data:`RUNNERS`) is process-wide by nature: it maps ``id(model)`` to the
runner and holds the runner weakly (an entry goes with the last engine that used it; the runner holds its model,
so the id is not reused while the entry lives). It keeps nothing alive and adds nothing to the model.

K/V layout. One layout goes through the engine's paths: per layer one tensor ``[1, H, N, D]`` (batch 1, KV
heads, positions, head dim) on the model's device and dtype, a transformers cache layer's own. The recovery
buffers, a forward's output (:class:`~.recovery.RecoveryOutput`), a prepared context, a resume's
``keys``/``values`` and the decode cache hold it. Two boundaries convert:

- checkpoint storage: a :class:`~.checkpoint.Checkpoint` holds ``[H, N, D]`` per layer on the CPU, and the
  rows a recovery restores from are read in that layout; :func:`stored_layout` is the one conversion (views,
  no copy), applied where K/V are written to a checkpoint or read back as a restore source;
- the transformers cache: :meth:`ModelRunner.dynamic_cache` adopts the tensors as they are.

Process-wide state that stays: transformers' attention registry (the capture's function is registered by
name, the way transformers dispatches attention), :mod:`.capture`'s :class:`~.capture.ActiveCaptures` (the
attention modules inside a ``with capture:`` block, emptied when the block exits), this module's
:class:`RunnerTable` and torch's parameter-registration hook (:mod:`.weights`).

Boundary: torch and transformers' cache classes; knows nothing about fingerprints, checkpoints' contents,
plans or strategies.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .models import cache_kwarg
from .weights import ForwardLock, WeightWatch

__all__ = ["ModelRunner", "RunnerTable", "RUNNERS", "stored_layout"]


def stored_layout(kv: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer ``[1, H, N, D]`` K/V (the engine's layout) as ``[H, N, D]`` views (checkpoint storage's)."""
    return [t[0] for t in kv]


class ModelRunner:
    """One model instance's forward lock, attention capture, weight watch, cache layout and device.

    Build it with :meth:`of` (engines over one model share it); ``ModelRunner(model)`` is a runner of its own.

    Args:
        model: a torch module (a transformers causal LM for forwards, captures and caches).

    Attributes:
        model: the model; nothing is set on it.
        lock: the model's re-entrant :class:`~.weights.ForwardLock`, held around every forward through it.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.lock = ForwardLock()
        self._watch = WeightWatch(model)
        self._watch_guard = threading.Lock()  # the watch's own (a look never waits for a forward)
        self._weights_version = 0
        self._captures: dict[int, Any] = {}  # capture window -> AttentionCapture
        self._first: tuple[weakref.ref, str] | None = None  # (module holding the first parameter, its name)
        self._cache_layers: tuple[Any, list | None] | None = None  # (config, per-layer cache types) or None

    @classmethod
    def of(cls, model, table: "RunnerTable | None" = None) -> "ModelRunner":
        """The runner of ``model``, shared by every caller while one of them holds it (see the module doc).

        Args:
            model: the model.
            table: the :class:`RunnerTable` to look it up in (None: the process's, :data:`RUNNERS`).

        Returns:
            The runner (built, and entered in the table, when the table holds none for ``model``).
        """
        return (RUNNERS if table is None else table).runner_of(model, cls)

    # ------------------------------------------------------------------ device

    def parameter(self) -> torch.Tensor:
        """``next(model.parameters())``, found once (~40 us a resume saved): the module that holds it and its
        name are remembered (weakly), and each call checks that module still holds that parameter, so a model
        moved in place (``.to``: device and dtype are read live) or a first parameter that was replaced is
        followed."""
        got = self._first
        mod = got[0]() if got is not None else None
        if mod is not None:
            param = mod._parameters.get(got[1])
            if param is not None:
                return param
        for mod in self.model.modules():  # the order model.parameters() walks
            for name, param in mod._parameters.items():
                if param is not None:
                    try:
                        self._first = (weakref.ref(mod), name)  # one tuple: atomic for concurrent callers
                    except TypeError:  # a module that cannot be weakly referenced: looked up each time
                        pass
                    return param
        return next(self.model.parameters())  # none: raises StopIteration as before

    @property
    def device(self) -> torch.device:
        """Where the model's (first) parameter lives now."""
        return self.parameter().device

    @property
    def dtype(self) -> torch.dtype:
        """The model's (first) parameter's dtype now."""
        return self.parameter().dtype

    # ----------------------------------------------------------------- weights

    def weights_version(self) -> int:
        """How many in-place weight changes were seen so far (a look costs ~0.2 ms; see
        :class:`~.weights.WeightWatch`). Each user compares it with the count it last saw: one runner's
        watch serves every engine over the model."""
        with self._watch_guard:
            if self._watch.changed():
                self._weights_version += 1
            return self._weights_version

    # ----------------------------------------------------------------- capture

    def capture(self, window: int):
        """The model's :class:`~.capture.AttentionCapture` for the last ``window`` queries, reset (use it under
        :attr:`lock`); None when this transformers has no attention interface to capture through."""
        cap = self._captures.get(window)
        if cap is None:
            try:
                from .capture import AttentionCapture
            except ImportError:  # statistics are optional for exact strategies
                return None
            cap = self._captures[window] = AttentionCapture(self.model, window=window)
        cap.reset()
        return cap

    # -------------------------------------------------------- transformers cache

    def dynamic_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
        """A standard transformers cache holding these K/V (``[1, H, N, D]`` per layer, adopted without a
        copy), as a prefill would leave it (sliding layers keep their window), so ``model(next_ids,
        cache=...)`` continues decoding."""
        cache = self._new_dynamic_cache()
        for layer, (k, v) in enumerate(zip(keys, values)):
            if not _adopt(cache, layer, k, v):
                cache.update(k, v, layer)
        return cache

    def _new_dynamic_cache(self) -> DynamicCache:
        """``DynamicCache(config=model.config)``, without deriving the layer types from the config each time.

        Reading a config's per-layer fields through transformers' attribute machinery costs tens of microseconds
        per cache. The first call builds the cache the standard way and records each layer's type (and sliding
        window); later calls build the same empty layers directly. A layer type other than ``DynamicLayer`` /
        ``DynamicSlidingWindowLayer`` (chunked, dummy, linear-attention...) or a replaced config is built the
        standard way every time.
        """
        config = self.model.config
        memo = self._cache_layers
        if memo is None or memo[0] is not config:
            cache = DynamicCache(config=config)
            specs: list[tuple[type, dict[str, Any]]] | None = []
            for lay in cache.layers:
                kind = type(lay)
                if kind is DynamicLayer:
                    specs.append((kind, {}))
                elif kind is DynamicSlidingWindowLayer:
                    specs.append((kind, {"sliding_window": lay.sliding_window}))
                else:
                    specs = None
                    break
            if not cache.layers or cache.offloading or type(cache) is not DynamicCache:
                specs = None
            self._cache_layers = (config, specs)  # one tuple: atomic for concurrent resumes
            return cache
        if memo[1] is None:
            return DynamicCache(config=config)
        cache = DynamicCache.__new__(DynamicCache)
        Cache.__init__(cache, layers=[kind(**kw) for kind, kw in memo[1]], offloading=False,
                       offload_only_non_sliding=False)
        return cache

    # ------------------------------------------------------------------ decode

    @torch.no_grad()
    def decode_step(self, cache: Cache, token: int, pos: int) -> torch.Tensor:
        """One decode step: feed ``token`` at position ``pos`` through ``cache`` (which it extends).

        Args:
            cache: the cache holding every earlier position (:meth:`dynamic_cache` of a resume).
            token: the token id at ``pos``.
            pos: its position (the cache's length).

        Returns:
            The next token's logits ``[vocab]`` (the model's dtype).
        """
        device = self.device
        res = self.model(input_ids=torch.tensor([[int(token)]], device=device),
                         position_ids=torch.tensor([[int(pos)]], device=device), **{cache_kwarg(self.model): cache},
                         use_cache=True)
        return res.logits[0, -1]

    @torch.no_grad()
    def greedy_decode(self, cache: Cache, first_logits: torch.Tensor, start_pos: int, max_new_tokens: int,
                      eos_ids: set[int]) -> list[int]:
        """Greedy continuation from first-token logits; stops after an EOS token (included).

        Each step is :meth:`decode_step` (the one the runtime's token streams take too).
        """
        out: list[int] = []
        if max_new_tokens <= 0:
            return out
        tok = int(first_logits.argmax())
        out.append(tok)
        pos = start_pos
        while len(out) < max_new_tokens and tok not in eos_ids:
            tok = int(self.decode_step(cache, tok, pos).argmax())
            out.append(tok)
            pos += 1
        return out


class RunnerTable:
    """The runner of each live model instance: what makes every engine over one model share one forward lock.

    Process-wide by nature: a model instance is one object in the process, shared by whoever holds it (several
    engines, registries, direct callers), and its forward lock must be one whatever owns those engines; so no
    engine can own the table. Entries are keyed by ``id(model)`` and hold the runner weakly (it goes with the
    last engine that used it; the runner holds its model, so the id is not reused while the entry lives); the
    table keeps nothing alive and writes nothing on the model. Lookups are serialised by the table's lock.
    """

    def __init__(self) -> None:
        self._runners: "weakref.WeakValueDictionary[int, ModelRunner]" = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def runner_of(self, model, factory: type[ModelRunner] = ModelRunner) -> ModelRunner:
        """The runner of ``model``, built with ``factory(model)`` when the table holds none for it.

        Args:
            model: the model instance.
            factory: the runner class (a subclass of :class:`ModelRunner`).

        Returns:
            The runner every caller of ``model`` shares while one of them holds it.
        """
        with self._lock:
            runner = self._runners.get(id(model))
            if runner is None or runner.model is not model:
                runner = self._runners[id(model)] = factory(model)
            return runner

    def __len__(self) -> int:
        with self._lock:
            return len(self._runners)


RUNNERS = RunnerTable()  # the process's table (see RunnerTable)


def _adopt(cache: DynamicCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Hand ``k`` / ``v`` to an empty layer of ``cache`` without a copy, leaving it as ``update`` would.

    ``DynamicLayer.update`` on an empty layer concatenates the states onto an empty tensor: a full copy of
    the context's K/V on the resume path (138 ms at 128k tokens on a CPU). For the two layer types whose
    state is exactly (keys, values[, cumulative length]) the tensors are adopted instead; a sliding layer
    keeps the last ``sliding_window - 1`` rows, as its update does. Any other layer type (or a transformers
    version whose layers differ) returns False and takes ``update``. The cache then shares storage with
    ``k`` / ``v``: decoding concatenates (new tensors), nothing writes into them in place.
    """
    layers = getattr(cache, "layers", None)
    if layers is None or layer >= len(layers):
        return False
    lay = layers[layer]
    kind = type(lay)
    if kind not in (DynamicLayer, DynamicSlidingWindowLayer) or getattr(lay, "is_initialized", True) or getattr(lay, "record_past", False):
        return False
    lay.lazy_initialization(k, v)
    if kind is DynamicSlidingWindowLayer:
        lay.cumulative_length += k.shape[-2]
        k, v = k[:, :, -lay.sliding_window + 1:, :], v[:, :, -lay.sliding_window + 1:, :]
    lay.keys, lay.values = k, v
    return True
