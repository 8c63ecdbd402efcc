"""patchkv-agent: selective KV-cache recovery for LLM agents whose prompts are edited in the middle.

Public entry point: :class:`PatchKVEngine` (checkpoint a context version, resume an edited one).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["PatchKVEngine", "ResumeResult", "ResumeStats", "EnginePart", "RuntimePart", "CallPart", "BaseKind",
           "PreparedOutcome", "RecoverySettings", "Fallback", "FallbackKind", "Checkpoint", "CheckpointProvenance",
           "Source", "__version__"]


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for `diff` or `plan`, which are numpy-only) must not pull in torch.
    if name == "PatchKVEngine":
        from .engine import PatchKVEngine

        return PatchKVEngine
    if name in ("ResumeResult", "ResumeStats", "EnginePart", "RuntimePart", "CallPart", "BaseKind", "PreparedOutcome"):
        from . import results

        return getattr(results, name)
    if name == "RecoverySettings":
        from .core.settings import RecoverySettings

        return RecoverySettings
    if name in ("Fallback", "FallbackKind"):
        from .core import fallback

        return getattr(fallback, name)
    if name in ("CheckpointProvenance", "Source"):
        from .core import provenance

        return getattr(provenance, name)
    if name == "Checkpoint":
        from .core.checkpoint import Checkpoint

        return Checkpoint
    raise AttributeError(f"module 'patchkv_agent' has no attribute {name!r}")
