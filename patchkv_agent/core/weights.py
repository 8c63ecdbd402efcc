"""The mechanisms behind a model's forward lock and its cheap "did the weights change in place?" check
(one of each per model instance, held by its :class:`~patchkv_agent.core.runner.ModelRunner`).

- :class:`ForwardLock`: re-entrant, so engines, registries and background heals over one model never run two
  forwards at once; background work takes it through :meth:`ForwardLock.background`, which gives way to
  any foreground caller waiting (a foreground forward waits for at most the one background chunk running).
- :class:`WeightWatch`: compares the parameters' version counters and storages with the last look
  (~0.2 ms on a 30-layer model); the module tree is walked again (~1.5 ms) only after a parameter was
  registered anew somewhere in the process, which torch's process-wide registration hook counts. The
  hook is installed by the first watch built, never at import.

Boundary: torch modules and their parameters only; knows nothing about fingerprints, checkpoints or plans.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["ForwardLock", "WeightWatch"]


class ForwardLock:
    """A re-entrant lock with two kinds of holders: foreground (``with lock:``) before background.

    Foreground callers (a resume, a decode step, a checkpoint pass) acquire it as an ``RLock``. Background
    work that runs in chunks (a context prepared while a tool runs) takes it per chunk through
    :meth:`background`, which waits while any foreground caller is waiting for or holding the lock and
    re-checks once it has it: a foreground caller that arrives while a chunk runs waits for that chunk only,
    never for the next one.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(threading.Lock())
        self._foreground = 0  # foreground callers waiting for or holding the lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Acquire as a foreground caller (``RLock.acquire``'s arguments)."""
        with self._cond:
            self._foreground += 1
        ok = False
        try:
            ok = self._lock.acquire(blocking, timeout)
            return ok
        finally:
            if not ok:
                self._leave()

    def release(self) -> None:
        """Release a foreground hold."""
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        with self._cond:
            self._foreground -= 1
            if self._foreground == 0:
                self._cond.notify_all()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def foreground_waiting(self) -> bool:
        """Whether a foreground caller waits for (or holds) the lock now."""
        return self._foreground > 0

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """Hold the lock for one background chunk, after every waiting foreground caller."""
        while True:
            with self._cond:
                while self._foreground:
                    self._cond.wait()
            self._lock.acquire()
            with self._cond:
                if not self._foreground:
                    break
            self._lock.release()  # a foreground caller came in between: it goes first
        try:
            yield
        finally:
            self._lock.release()


_PARAM_REGISTRATIONS = [0]  # parameters registered on any module of this process since the hook went in
_PARAM_HOOK: list = []  # the hook's handle, once installed
_PARAM_HOOK_GUARD = threading.Lock()


def _count_registration(module, name, param) -> None:
    _PARAM_REGISTRATIONS[0] += 1


def _watch_parameter_registrations() -> None:
    with _PARAM_HOOK_GUARD:
        if not _PARAM_HOOK:
            _PARAM_HOOK.append(torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration))


class WeightWatch:
    """Whether ``model``'s weights changed in place since the last :meth:`changed` (or construction).

    In-place writes (``load_state_dict``, optimizer steps, adapter merges) bump a tensor's version
    counter; ``p.data = ...`` changes its storage; parameters registered anew (``setattr`` of a
    ``Parameter``, ``load_state_dict(assign=True)``) bump the registration count.

    Args:
        model: a torch module.
    """

    def __init__(self, model: torch.nn.Module):
        _watch_parameter_registrations()
        self.model = model
        self._params: list | None = None
        self._registrations_seen = -1
        self._seen = self._state()

    def _state(self) -> tuple:
        if self._params is None or _PARAM_REGISTRATIONS[0] != self._registrations_seen:
            self._registrations_seen = _PARAM_REGISTRATIONS[0]
            self._params = list(self.model.parameters())
        return tuple((id(p), p._version, p.data_ptr()) for p in self._params)

    def changed(self) -> bool:
        """True when a parameter changed since the last look (and remember the current state)."""
        state = self._state()
        if state == self._seen:
            return False
        self._seen = state
        return True
