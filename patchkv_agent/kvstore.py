"""Stable import path for :mod:`patchkv_agent.runtime.kvstore` (the README's ``patchkv_agent.kvstore``)."""

from .runtime import kvstore as _impl

__all__ = _impl.__all__


def __getattr__(name: str):
    return getattr(_impl, name)
