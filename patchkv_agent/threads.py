"""Stable import path for :mod:`patchkv_agent.runtime.threads` (the README's ``patchkv_agent.threads``)."""

from .runtime import threads as _impl

__all__ = _impl.__all__


def __getattr__(name: str):
    return getattr(_impl, name)
