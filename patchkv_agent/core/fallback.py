"""Why a resume took the exact path: :class:`Fallback` ``(kind, detail)`` with a :class:`FallbackKind`.

Every place that turns a condition into an exact recomputation (the engine: unsupported RoPE, a
checkpoint run failing its checksum, changed weights; the store resume: missing, corrupt, foreign or
unreachable entries; the thread registry: evicted or dropped KV) builds its reason here, so the text
has one format and the kind can be read back without parsing it.

A :class:`Fallback` *is* its text (a ``str`` subclass: ``"exact recompute: " + label + detail``), so
``stats["fallback"]`` compares, prints, and serialises to JSON exactly as the free strings it replaces;
``.kind`` and ``.detail`` carry the structure.

Boundary: no imports beyond the standard library.
"""

from __future__ import annotations

import enum

__all__ = ["Fallback", "FallbackKind", "FALLBACK_PREFIX"]

FALLBACK_PREFIX = "exact recompute: "


class FallbackKind(str, enum.Enum):
    """Why a resume was recomputed exactly. The value is a stable snake-case name (for counting)."""

    UNSUPPORTED_ROPE = "unsupported_rope"      # a restored row would need an unsupported RoPE rotation
    CORRUPT_RUN = "corrupt_run"                # a checkpoint run failed its checksum during the restore
    WEIGHTS_CHANGED = "weights_changed"        # the model's weights changed since the checkpoint was written
    FOREIGN_MODEL = "foreign_model"            # the stored entry was written by another model
    MISSING = "missing"                        # the store holds no entry under the key (evicted, expired, ...)
    FOREIGN = "foreign"                        # the stored entry belongs to another key
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # the stored entry failed verification on read
    STORE_UNAVAILABLE = "store_unavailable"    # the tier could not be reached
    STORE_ERROR = "store_error"                # the tier failed in an unforeseen way (logged; never raised)
    EVICTED = "evicted"                        # resident KV evicted without an offload
    BUDGET_DROPPED = "budget_dropped"          # an offloaded checkpoint dropped by the offload budget
    STORE_REFUSED = "store_refused"            # the store did not keep the offloaded checkpoint
    NOT_HELD = "not_held"                      # the KV a graph checkpoint refers to is not held here


# the words between the prefix and the detail, one per kind (part of the trace format's fallback text)
_LABELS: dict[FallbackKind, str] = {
    FallbackKind.UNSUPPORTED_ROPE: "",
    FallbackKind.CORRUPT_RUN: "",
    FallbackKind.WEIGHTS_CHANGED: "",
    FallbackKind.FOREIGN_MODEL: "",
    FallbackKind.MISSING: "checkpoint missing: ",
    FallbackKind.FOREIGN: "foreign checkpoint: ",
    FallbackKind.CORRUPT_CHECKPOINT: "corrupt checkpoint: ",
    FallbackKind.STORE_UNAVAILABLE: "store unavailable: ",
    FallbackKind.STORE_ERROR: "store error: ",
    FallbackKind.EVICTED: "",
    FallbackKind.BUDGET_DROPPED: "",
    FallbackKind.STORE_REFUSED: "",
    FallbackKind.NOT_HELD: "",
}


class Fallback(str):
    """The reason a resume was recomputed exactly; equal to (and serialised as) its text.

    Args:
        kind: the :class:`FallbackKind` (or its value).
        detail: what happened, in words (the part after the kind's label).

    Attributes:
        kind: the :class:`FallbackKind`.
        detail: the detail text.

    Raises:
        ValueError: an unknown kind.
    """

    kind: FallbackKind
    detail: str

    def __new__(cls, kind: FallbackKind | str, detail: object) -> "Fallback":
        kind = FallbackKind(kind)
        detail = str(detail)
        obj = super().__new__(cls, FALLBACK_PREFIX + _LABELS[kind] + detail)
        obj.kind, obj.detail = kind, detail
        return obj

    @classmethod
    def from_text(cls, kind: FallbackKind | str, text: str) -> "Fallback":
        """The Fallback whose text is ``text`` (its JSON form) and whose kind is ``kind``.

        Raises:
            ValueError: an unknown kind, or a text that is not a fallback text of that kind.
        """
        kind = FallbackKind(kind)
        head = FALLBACK_PREFIX + _LABELS[kind]
        if not isinstance(text, str) or not text.startswith(head):
            raise ValueError(f"not the text of a {kind.value} fallback: {str(text)[:80]!r}")
        return cls(kind, text[len(head):])

    def __reduce__(self):
        return (Fallback, (self.kind.value, self.detail))

    def __repr__(self) -> str:
        return f"Fallback({self.kind.name}, {self.detail!r})"
