"""Per-model runtime facts shared by every engine over one model instance: its forward lock and a cheap
"did the weights change in place?" check.

- :func:`model_lock`: one re-entrant lock per model instance (weakly keyed: no attribute is added to
  the model), so engines, registries and background heals over one model never run two forwards at once.
- :class:`WeightWatch`: compares the parameters' version counters and storages with the last look
  (~0.2 ms on a 30-layer model); the module tree is walked again (~1.5 ms) only after a parameter was
  registered anew somewhere in the process, which torch's process-wide registration hook counts. The
  hook is installed by the first watch built, never at import.

Boundary: torch modules and their parameters only; knows nothing about fingerprints, checkpoints or plans.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["model_lock", "WeightWatch"]

_MODEL_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.RLock:
    """The forward lock of a model instance, shared by every engine over it (a model that cannot be weakly
    referenced gets a lock of its own per call)."""
    with _MODEL_LOCKS_GUARD:
        try:
            lock = _MODEL_LOCKS.get(model)
            if lock is None:
                lock = _MODEL_LOCKS[model] = threading.RLock()
            return lock
        except TypeError:  # not weak-referenceable: this engine's own lock
            return threading.RLock()


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
