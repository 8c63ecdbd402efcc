"""``PatchKVCheckpointSaver``: any LangGraph checkpoint saver, plus the KV handle of every thread version.

Wraps a ``BaseCheckpointSaver`` (in-memory, SQLite, Postgres, ...) and delegates everything to it.
``put`` adds to the checkpoint *metadata* (JSON, never graph state, never tensors)::

    {"patchkv": {"threads": [{"thread_id", "checkpoint_ns", "version", "ids_hash", "tokens", "kv",
                              "kv_ids_hash"}, ...]}}

one handle per registry key of the graph thread and namespace: the context version the KV belongs to,
a hash of its token ids, where the KV was (``resident``/``offloading``/``offloaded``) and a hash of the
tokens the KV holds. ``get_tuple``
reads the handles back and tells the registry (:meth:`~patchkv_agent.runtime.threads.ThreadRegistry.expect`):
in a new process, or with a new registry, the KV is gone, so the thread's next generation is an exact
recompute whose ``stats["fallback"]`` says so, and the version numbers continue from the checkpoint's.
The metadata is as trusted as the database: a handle acts only for the thread and namespace of the
checkpoint that holds it (:func:`handle_problem`), so one thread's metadata cannot drop or redirect
another thread's KV, and a malformed handle is skipped with a warning (``get_tuple`` never raises for
it). A store entry is used only when it holds the handle's tokens (``kv_ids_hash`` or ``ids_hash``).

The wrapper has exactly the capabilities of the saver it wraps: LangGraph (and its conformance suite)
decide what a saver can do by which methods its class overrides, so ``PatchKVCheckpointSaver(inner, reg)``
is an instance of a subclass built once per inner saver class that defines only the delegating methods
that class overrides (``adelete_for_runs``, ``acopy_thread``, ``aprune`` ... appear only when ``inner``
has them).

Knows LangGraph's saver interface and the registry's handles; nothing about models.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, ChannelVersions, Checkpoint, CheckpointMetadata, CheckpointTuple

from ..runtime.keys import handle_shape_problem
from ..runtime.threads import ThreadRegistry, thread_key
from .keys import base_ns, canonical_ns

META_KEY = "patchkv"
log = logging.getLogger(__name__)


class PatchKVCheckpointSaver(BaseCheckpointSaver):
    """Delegate to ``inner``; record KV handles in checkpoint metadata; announce them on load.

    The object built is an instance of a subclass of this class made for ``type(inner)`` (see the module
    docstring): it defines a saver method (``put``, ``aput``, ``delete_thread``, ``acopy_thread`` ...) only
    when ``inner``'s class overrides it, so capability checks see what ``inner`` can do.

    Args:
        inner: the saver that stores everything.
        registry: the :class:`~patchkv_agent.runtime.threads.ThreadRegistry` whose handles are recorded.

    Raises:
        TypeError: ``inner`` is not a LangGraph ``BaseCheckpointSaver``.
    """

    inner: BaseCheckpointSaver

    def __new__(cls, inner: BaseCheckpointSaver, registry: ThreadRegistry):
        if not isinstance(inner, BaseCheckpointSaver):
            raise TypeError(f"inner must be a LangGraph BaseCheckpointSaver, got {type(inner).__name__}")
        if cls is PatchKVCheckpointSaver:
            cls = wrapper_class(type(inner))
        return super().__new__(cls)

    def __init__(self, inner: BaseCheckpointSaver, registry: ThreadRegistry):
        super().__init__(serde=inner.serde)
        self.serde = inner.serde
        self.inner, self.registry = inner, registry
        self._warned: set[str] = set()

    def __getattr__(self, name: str) -> Any:  # saver-specific extras (setup, conn, ...)
        if name in ("inner", "_warned"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def config_specs(self) -> list:
        return self.inner.config_specs

    # ----------------------------------------------------------- handles

    def kv_metadata(self, config: RunnableConfig) -> dict[str, Any] | None:
        """The ``patchkv`` metadata entry for a checkpoint of ``config``'s thread and namespace (None if none)."""
        conf = config.get("configurable") or {}
        tid = conf.get("thread_id")
        if tid is None:
            return None
        ns = canonical_ns(conf.get("checkpoint_ns", ""))
        handles = [h for h in self.registry.handles(str(tid)) if base_ns(h["checkpoint_ns"]) == ns]
        return {"threads": handles} if handles else None

    def _with_kv(self, config: RunnableConfig, metadata: CheckpointMetadata) -> CheckpointMetadata:
        entry = self.kv_metadata(config)
        return {**metadata, META_KEY: entry} if entry else metadata

    def _announce(self, tup: CheckpointTuple | None) -> CheckpointTuple | None:
        """Tell the registry about the handles in ``tup``'s metadata that belong to ``tup``'s own thread and
        namespace; anything else in the entry (another thread's handle, a malformed one) is skipped with a
        warning, never raised: the metadata is as trusted as the database it came from."""
        meta = getattr(tup, "metadata", None) if tup is not None else None
        entry = meta.get(META_KEY) if isinstance(meta, Mapping) else None
        if entry is None:
            return tup
        conf = (getattr(tup, "config", None) or {}).get("configurable") or {}
        owner = conf.get("thread_id")
        handles = entry.get("threads") if isinstance(entry, Mapping) else entry
        if owner is None or not isinstance(handles, (list, tuple)):
            self._skip(owner, f"its {META_KEY!r} metadata is not {{'threads': [handle, ...]}} (found a "
                              f"{type(handles).__name__}{'' if owner is not None else ' and no thread_id'})")
            return tup
        ns = canonical_ns(str(conf.get("checkpoint_ns") or ""))
        for i, h in enumerate(handles):
            why = handle_problem(h, str(owner), ns)
            if why is not None:
                self._skip(owner, f"KV handle {i} {why}")
                continue
            self.registry.expect(thread_key(h["thread_id"], h["checkpoint_ns"]), h)
        return tup

    def _skip(self, owner: Any, why: str) -> None:
        """One warning per (thread, reason) and saver: a hostile or damaged checkpoint is read often."""
        text = f"checkpoint of thread {str(owner)[:80]!r}: {why}; skipped (its KV is not used)"
        if text not in self._warned:
            if len(self._warned) < 1024:
                self._warned.add(text)
            log.warning("%s", text)

    def _fork(self, source_thread_id: str, target_thread_id: str) -> None:
        for k in self.registry.keys():
            if k[0] == str(source_thread_id):
                self.registry.fork(k, thread_key(target_thread_id, k[1]))

    def with_allowlist(self, extra_allowlist) -> "PatchKVCheckpointSaver":
        """The same wrapper around ``inner.with_allowlist(extra_allowlist)``."""
        inner = self.inner.with_allowlist(extra_allowlist)
        return self if inner is self.inner else PatchKVCheckpointSaver(inner, self.registry)




def handle_problem(handle: Any, thread_id: str, ns: str) -> str | None:
    """Why a KV handle read from checkpoint metadata may not act, or None when it may.

    A handle acts only for the thread (and graph namespace) whose checkpoint holds it, and only when it
    has the shape :meth:`~patchkv_agent.runtime.threads.ThreadRegistry.handle` writes.

    Args:
        handle: one element of the metadata's ``threads`` list.
        thread_id: the thread of the checkpoint it was read from.
        ns: that checkpoint's canonical namespace.

    Returns:
        None, or the reason in words (for the warning).
    """
    shape = handle_shape_problem(handle)
    if shape is not None:
        return shape
    if handle["thread_id"] != thread_id:
        return f"names thread {handle['thread_id'][:80]!r}, not its own"
    if base_ns(handle["checkpoint_ns"]) != ns:
        return f"names namespace {handle['checkpoint_ns'][:80]!r}, not its own {ns!r}"
    return None


class _Delegates:
    """The delegating saver methods; :func:`wrapper_class` copies those ``inner``'s class overrides."""

    # -------------------------------------------------------------- sync

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Fetch a checkpoint tuple from ``inner`` and announce its KV handles to the registry.

        Returns:
            The tuple, or None if not found.
        """
        return self._announce(self.inner.get_tuple(config))

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:
        """Delegate to ``inner.list``."""
        return self.inner.list(config, filter=filter, before=before, limit=limit)

    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        """Store through ``inner`` with the KV handles added to ``metadata``.

        Returns:
            ``inner.put``'s config.
        """
        return self.inner.put(config, checkpoint, self._with_kv(config, metadata), new_versions)

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        """Delegate to ``inner.put_writes``."""
        return self.inner.put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        """Delete the thread in ``inner`` and drop its KV from the registry."""
        self.inner.delete_thread(thread_id)
        self.registry.forget(thread_id)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delegate to ``inner.delete_for_runs``."""
        return self.inner.delete_for_runs(run_ids)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy the thread in ``inner``; the copy's registry keys start from the source's KV."""
        self.inner.copy_thread(source_thread_id, target_thread_id)
        self._fork(source_thread_id, target_thread_id)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Delegate to ``inner.prune``."""
        return self.inner.prune(thread_ids, strategy=strategy)

    def get_next_version(self, current: Any, channel: None = None) -> Any:
        """Delegate to ``inner.get_next_version``."""
        return self.inner.get_next_version(current, channel)

    def get_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]):
        """Delegate to ``inner.get_delta_channel_history``."""
        return self.inner.get_delta_channel_history(config=config, channels=channels)

    # ------------------------------------------------------------- async

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Async twin of :meth:`get_tuple`."""
        return self._announce(await self.inner.aget_tuple(config))

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        """Async twin of :meth:`list`."""
        async for tup in self.inner.alist(config, filter=filter, before=before, limit=limit):
            yield tup

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        """Async twin of :meth:`put`."""
        return await self.inner.aput(config, checkpoint, self._with_kv(config, metadata), new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        """Async twin of :meth:`put_writes`."""
        return await self.inner.aput_writes(config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        """Async twin of :meth:`delete_thread`."""
        await self.inner.adelete_thread(thread_id)
        self.registry.forget(thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Async twin of :meth:`delete_for_runs`."""
        return await self.inner.adelete_for_runs(run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Async twin of :meth:`copy_thread`."""
        await self.inner.acopy_thread(source_thread_id, target_thread_id)
        self._fork(source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Async twin of :meth:`prune`."""
        return await self.inner.aprune(thread_ids, strategy=strategy)

    async def aget_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]):
        """Async twin of :meth:`get_delta_channel_history`."""
        return await self.inner.aget_delta_channel_history(config=config, channels=channels)


DELEGATED = tuple(n for n, v in vars(_Delegates).items() if callable(v) and not n.startswith("_"))
_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def overridden(saver_cls: type, name: str) -> bool:
    """Whether ``saver_cls`` overrides ``BaseCheckpointSaver.<name>`` (how LangGraph detects capabilities)."""
    base = getattr(BaseCheckpointSaver, name, None)
    impl = getattr(saver_cls, name, None)
    return impl is not None and impl is not base


def wrapper_class(inner_cls: type) -> type:
    """The :class:`PatchKVCheckpointSaver` subclass for savers of class ``inner_cls`` (built once).

    Returns:
        A subclass defining exactly the delegating methods of :data:`DELEGATED` that ``inner_cls`` overrides.
    """
    with _CLASSES_LOCK:
        cls = _CLASSES.get(inner_cls)
        if cls is None:
            methods = {n: vars(_Delegates)[n] for n in DELEGATED if overridden(inner_cls, n)}
            cls = type(f"PatchKVCheckpointSaver[{inner_cls.__name__}]", (PatchKVCheckpointSaver,),
                       {**methods, "__module__": __name__, "__doc__": PatchKVCheckpointSaver.__doc__})
            _CLASSES[inner_cls] = cls
        return cls
