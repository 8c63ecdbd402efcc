"""Where a checkpoint came from and what writing it cost: :class:`CheckpointProvenance` and its :class:`Source`.

A :class:`~patchkv_agent.core.checkpoint.Checkpoint` carries one (``checkpoint.provenance``); a resume
reports its ``offload_s`` / ``stats_s`` / ``quantize_s`` and reads ``exact_rows`` (how much of the base is
exact). Stored checkpoints keep it as the JSON object :meth:`CheckpointProvenance.to_json` writes (the
entry's ``stats`` field, as before it was typed), and :meth:`CheckpointProvenance.from_json` reads it back,
old entries' stats dicts included. Those bytes come from disk or a shared store and are untrusted: a key no
field names, a value of the wrong type (a string, a list, a bool for a number), a negative or non-finite
number or an unknown source is refused with a ``ValueError`` naming the field, before anything uses it.

Boundary: standard library only; knows nothing about tensors or stores.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["CheckpointProvenance", "Source"]


class Source(enum.StrEnum):
    """How a checkpoint's K/V were computed (the value is what JSON holds)."""

    PREFILL = "prefill"    # engine.checkpoint: a prefill of its ids
    RESUME = "resume"      # engine.checkpoint_from: a resumed (or healed) state, offloaded
    RESIDENT = "resident"  # engine.as_checkpoint: a zero-copy view of a resident state


_INTS = ("exact_rows", "kept_full_tokens")


@dataclass(frozen=True, kw_only=True)
class CheckpointProvenance:
    """Where a checkpoint came from and its off-path costs; every field is optional (None: unknown, e.g. a
    checkpoint built by hand).

    Attributes:
        source: how the K/V were computed (a :class:`Source`).
        exact_rows: leading rows equal to a full prefill (None: all of them).
        offload_s: the whole checkpoint pass (prefill or statistics, quantization, copies).
        prefill_s: its prefill (``Source.PREFILL``).
        stats_s: the attention statistics (0.0 when a resume's own were reused).
        words_s: mapping the ids to word ids.
        quantize_s: building the mixed-precision runs, split into ``value_residual_s``, ``key_residual_s``,
            ``tags_s`` and ``pack_s``.
        copy_s: copying the rows to host memory.
        kept_full_tokens: tokens in blocks kept ``FP16`` because a value was beyond the fp16 range.

    Raises:
        ValueError: a source that is not a :class:`Source`, a value of the wrong type, negative or non-finite.
    """

    source: Source | None = None
    exact_rows: int | None = None
    offload_s: float | None = None
    prefill_s: float | None = None
    stats_s: float | None = None
    words_s: float | None = None
    quantize_s: float | None = None
    value_residual_s: float | None = None
    key_residual_s: float | None = None
    tags_s: float | None = None
    pack_s: float | None = None
    copy_s: float | None = None
    kept_full_tokens: int | None = None

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "source":
                if not isinstance(v, str):
                    raise ValueError(f"provenance source must be a string, got {type(v).__name__}")
                try:
                    v = Source(v)
                except ValueError:
                    raise ValueError(f"unknown provenance source {v[:40]!r} (one of {[s.value for s in Source]})") \
                        from None
            elif f.name in _INTS:
                if isinstance(v, bool) or not hasattr(v, "__index__"):
                    raise ValueError(f"provenance {f.name} must be an integer, got {type(v).__name__}")
                v = int(v.__index__())
                if v < 0:
                    raise ValueError(f"provenance {f.name} must be >= 0, got {v}")
            else:
                if isinstance(v, (bool, str, bytes)) or not hasattr(v, "__float__"):
                    raise ValueError(f"provenance {f.name} must be a number of seconds, got {type(v).__name__}")
                v = float(v)
                if not math.isfinite(v) or v < 0:
                    raise ValueError(f"provenance {f.name} must be finite and >= 0, got {v}")
            object.__setattr__(self, f.name, v)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def replace(self, **values) -> "CheckpointProvenance":
        """A copy with ``values`` set (validated).

        Raises:
            TypeError: a value names no field.
            ValueError: as the constructor.
        """
        unknown = sorted(set(values) - set(self.field_names()))
        if unknown:
            raise TypeError(f"CheckpointProvenance has no fields {unknown}")
        return dataclasses.replace(self, **values)

    def to_json(self) -> dict[str, Any]:
        """Every field, the source as its value (JSON scalars only)."""
        return {k: (v.value if isinstance(v, Source) else v) for k, v in
                ((f.name, getattr(self, f.name)) for f in fields(self))}

    @classmethod
    def from_json(cls, data: Any) -> "CheckpointProvenance":
        """Read :meth:`to_json`, or the stats dict of a checkpoint stored before provenance was typed (the same
        keys, some absent).

        Raises:
            ValueError: not a JSON object, a key no field names, or a bad value (see the class).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"checkpoint provenance must be an object, got {type(data).__name__}")
        unknown = [k for k in data if k not in cls.field_names()]
        if unknown:
            shown = ", ".join(repr(str(k)[:40]) for k in unknown[:5])
            raise ValueError(f"checkpoint provenance has unknown fields {shown}")
        return cls(**{str(k): v for k, v in data.items()})
