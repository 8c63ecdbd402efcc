"""Checkpoint <-> (metadata dict + named binary blobs), every blob checksummed, and the checkpoint key.

A :class:`~patchkv_agent.core.checkpoint.Checkpoint` becomes a JSON-safe metadata dict (the key it was stored
under, the fingerprint, stats, the mixed-precision layout, and per blob its dtype, shape, length and
xxh3-64) plus one raw byte blob per tensor: ``token_ids``, ``scores``, ``k.<layer>``, ``v.<layer>``,
``mixed.tags``, ``mixed.rows.<tag>``, ``p.<layer>.<tag>.<field>`` (the :class:`RunPayload` tensors).
:func:`decode_checkpoint` checks every blob's length and checksum, the metadata's own checksum, and
that the content belongs to the requested key (thread, version, fingerprint, token-ids hash) before
it builds a single tensor; a failure raises :class:`~patchkv_agent.core.checkpoint.CorruptCheckpoint` (or its
subclass :class:`ForeignCheckpoint`) naming what failed.

Knows the checkpoint and run-payload layouts; nothing about where the bytes live (see the stores).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np
import torch
import xxhash

from ...kernels import RunPayload
from ...core.precision import Run, Tag
from ...core.checkpoint import Checkpoint, CorruptCheckpoint, MixedKV

SCHEMA = 1
_PAYLOAD_HEADER = ("tag", "n_rows", "num_kv_heads", "head_dim", "block_size", "v_group")


class ForeignCheckpoint(CorruptCheckpoint):
    """The bytes are intact but belong to another key (thread, version, model or token ids)."""


def ids_hash(token_ids) -> str:
    """A short stable hash of a token-id sequence (blake2b of its int64 bytes, 16 hex digits).

    The one definition: :mod:`patchkv_agent.runtime.threads` re-exports it, so registry handles and store keys
    agree.
    """
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


@dataclass(frozen=True, kw_only=True)
class CheckpointKey:
    """What a stored checkpoint is keyed and verified by.

    Attributes:
        deployment: the deployment (store namespace) it belongs to.
        thread_id: the agent thread.
        checkpoint_ns: the graph namespace (``""`` for a root graph).
        version: the thread's context version the checkpoint holds.
        fingerprint: :func:`patchkv_agent.core.models.fingerprint` of the model that wrote it.
        ids_hash: :func:`ids_hash` of the checkpoint's token ids.
    """

    deployment: str
    thread_id: str
    checkpoint_ns: str = ""
    version: int
    fingerprint: str
    ids_hash: str

    @classmethod
    def of(cls, ckpt: Checkpoint, *, deployment: str, thread_id: str, version: int,
           checkpoint_ns: str = "") -> "CheckpointKey":
        """The key of ``ckpt`` as version ``version`` of a thread (fingerprint and ids hash taken from it)."""
        return cls(deployment=str(deployment), thread_id=str(thread_id), checkpoint_ns=str(checkpoint_ns),
                   version=int(version), fingerprint=ckpt.fingerprint, ids_hash=ids_hash(ckpt.token_ids))

    @property
    def digest(self) -> str:
        """32 hex digits identifying the key (safe as a file or Redis key name)."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=16).hexdigest()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "CheckpointKey":
        return cls(**json.loads(text))

    def describe(self) -> str:
        return (f"thread {self.thread_id!r} (ns {self.checkpoint_ns!r}) version {self.version} "
                f"of deployment {self.deployment!r}")


# ------------------------------------------------------------------------------------ blobs


def _bytes_view(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A flat uint8 view (no copy when already contiguous on the CPU)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _describe(name: str, x: torch.Tensor | np.ndarray, view: np.ndarray) -> dict[str, Any]:
    kind = "torch" if isinstance(x, torch.Tensor) else "numpy"
    dtype = str(x.dtype).removeprefix("torch.")
    return {"name": name, "kind": kind, "dtype": dtype, "shape": list(x.shape), "nbytes": int(view.nbytes),
            "xxh3": xxhash.xxh3_64_hexdigest(view)}


def _arrays(ckpt: Checkpoint) -> list[tuple[str, torch.Tensor | np.ndarray]]:
    out: list[tuple[str, torch.Tensor | np.ndarray]] = [("token_ids", np.asarray(ckpt.token_ids, dtype=np.int64))]
    if ckpt.scores is not None:
        out.append(("scores", np.asarray(ckpt.scores)))
    for i, (k, v) in enumerate(zip(ckpt.keys, ckpt.values)):
        out += [(f"k.{i}", k), (f"v.{i}", v)]
    m = ckpt.mixed
    if m is not None:
        out.append(("mixed.tags", np.asarray(m.tags)))
        out += [(f"mixed.rows.{tag}", np.asarray(rows)) for tag, rows in m.tag_rows.items()]
        for i, layer in enumerate(m.payloads):
            for tag, p in layer.items():
                out += [(f"p.{i}.{tag}.{field}", t) for field, t in p.tensors().items()]
    return out


def _json_safe(stats: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if isinstance(v, (str, int, float, bool)) or v is None}


def encode_checkpoint(ckpt: Checkpoint, key: CheckpointKey) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Metadata and blobs of ``ckpt`` stored under ``key``.

    Args:
        ckpt: the checkpoint.
        key: the key it is stored under (its fingerprint and ids hash must be ``ckpt``'s).

    Returns:
        ``(meta, blobs)``: ``meta`` is JSON-safe and carries its own checksum (``meta_xxh3``); ``blobs``
        maps blob names to flat uint8 arrays that may share memory with ``ckpt``'s tensors.

    Raises:
        ValueError: ``key`` does not describe ``ckpt`` (build it with :meth:`CheckpointKey.of`).
    """
    if not isinstance(ckpt, Checkpoint):
        raise TypeError(f"expected a Checkpoint, got {type(ckpt).__name__}")
    if key.fingerprint != ckpt.fingerprint or key.ids_hash != ids_hash(ckpt.token_ids):
        raise ValueError(f"key {key.describe()} does not describe this checkpoint (fingerprint or token ids "
                         "differ); build it with CheckpointKey.of(ckpt, ...)")
    blobs, table = {}, []
    for name, x in _arrays(ckpt):
        view = _bytes_view(x)
        blobs[name] = view
        table.append(_describe(name, x, view))
    meta: dict[str, Any] = {"schema": SCHEMA, "key": json.loads(key.to_json()), "fingerprint": ckpt.fingerprint,
                            "n_layers": len(ckpt.keys), "stats": _json_safe(ckpt.stats), "blobs": table,
                            "mixed": None}
    m = ckpt.mixed
    if m is not None:
        meta["mixed"] = {
            "block_size": m.block_size,
            "runs": [[int(r.tag), r.first_block, r.n_blocks] for r in m.runs],
            "tags": list(m.tag_rows),
            "headers": [{tag: {f: getattr(p, f) for f in _PAYLOAD_HEADER} for tag, p in layer.items()}
                        for layer in m.payloads],
            "checksums": [dict(layer) for layer in m.checksums],
        }
    meta["meta_xxh3"] = meta_checksum(meta)
    return meta, blobs


def meta_checksum(meta: Mapping[str, Any]) -> str:
    """xxh3-64 of the canonical JSON of ``meta`` without its ``meta_xxh3`` field."""
    body = {k: v for k, v in meta.items() if k != "meta_xxh3"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def blob_nbytes(meta: Mapping[str, Any]) -> int:
    """Total blob bytes an entry holds (what store budgets count)."""
    return sum(int(b["nbytes"]) for b in meta["blobs"])


# ------------------------------------------------------------------------------------ decode


def check_meta(meta: Mapping[str, Any], key: CheckpointKey) -> None:
    """Refuse metadata that is damaged, of another schema, or of another key.

    Raises:
        CorruptCheckpoint: checksum or schema mismatch.
        ForeignCheckpoint: the entry belongs to another thread, version, model or token ids.
    """
    if not isinstance(meta, Mapping) or "meta_xxh3" not in meta or "key" not in meta:
        raise CorruptCheckpoint(f"metadata of {key.describe()} is unreadable")
    if meta_checksum(meta) != meta["meta_xxh3"]:
        raise CorruptCheckpoint(f"metadata checksum mismatch for {key.describe()}")
    if meta.get("schema") != SCHEMA:
        raise CorruptCheckpoint(f"stored schema {meta.get('schema')} is not {SCHEMA}")
    stored = CheckpointKey(**meta["key"])
    if stored == key:
        return
    for field, what in (("deployment", "deployment"), ("thread_id", "thread"), ("checkpoint_ns", "namespace"),
                        ("version", "version"), ("fingerprint", "model"), ("ids_hash", "token ids")):
        a, b = getattr(stored, field), getattr(key, field)
        if a != b:
            raise ForeignCheckpoint(f"refused: the entry found for {key.describe()} belongs to another "
                                    f"{what} ({field} {str(a)[:40]!r}, requested {str(b)[:40]!r})")


def _build(spec: Mapping[str, Any], raw: bytes | bytearray | memoryview) -> torch.Tensor | np.ndarray:
    if len(raw) != spec["nbytes"]:
        raise CorruptCheckpoint(f"blob {spec['name']} has {len(raw)} bytes, expected {spec['nbytes']} "
                                "(truncated or wrong length)")
    if xxhash.xxh3_64_hexdigest(raw) != spec["xxh3"]:
        raise CorruptCheckpoint(f"blob {spec['name']} failed its checksum (flipped bytes)")
    shape = tuple(spec["shape"])
    if spec["kind"] == "numpy":
        return np.frombuffer(bytes(raw), dtype=np.dtype(spec["dtype"])).reshape(shape).copy()
    dtype = getattr(torch, spec["dtype"])
    if not spec["nbytes"]:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def decode_checkpoint(meta: Mapping[str, Any], blobs: Mapping[str, bytes | bytearray | memoryview],
                      key: CheckpointKey) -> Checkpoint:
    """Rebuild a checkpoint after checking the metadata, the key and every blob.

    Args:
        meta: the metadata written by :func:`encode_checkpoint`.
        blobs: blob name -> bytes.
        key: the key the caller asked for.

    Returns:
        A :class:`Checkpoint` with fresh CPU tensors.

    Raises:
        CorruptCheckpoint: damaged metadata, a missing blob, a wrong length or a checksum mismatch.
        ForeignCheckpoint: the entry belongs to another key.
    """
    check_meta(meta, key)
    arrays = {}
    for spec in meta["blobs"]:
        raw = blobs.get(spec["name"])
        if raw is None:
            raise CorruptCheckpoint(f"blob {spec['name']} of {key.describe()} is missing")
        arrays[spec["name"]] = _build(spec, raw)
    token_ids = arrays["token_ids"]
    if ids_hash(token_ids) != key.ids_hash or meta["fingerprint"] != key.fingerprint:
        raise ForeignCheckpoint(f"refused: the token ids or model stored for {key.describe()} are not the key's")
    n = int(meta["n_layers"])
    mixed = None
    if meta["mixed"] is not None:
        mm = meta["mixed"]
        payloads = []
        for i, layer in enumerate(mm["headers"]):
            payloads.append({tag: RunPayload(**hdr, **{f: arrays[f"p.{i}.{tag}.{f}"] for f in
                                                      ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero")
                                                      if f"p.{i}.{tag}.{f}" in arrays})
                             for tag, hdr in layer.items()})
        mixed = MixedKV(block_size=int(mm["block_size"]), tags=arrays["mixed.tags"],
                        runs=tuple(Run(Tag(t), int(a), int(b)) for t, a, b in mm["runs"]),
                        tag_rows={tag: arrays[f"mixed.rows.{tag}"] for tag in mm["tags"]},
                        payloads=payloads, checksums=[{t: int(c) for t, c in layer.items()}
                                                      for layer in mm["checksums"]])
    return Checkpoint(token_ids=token_ids, keys=[arrays[f"k.{i}"] for i in range(n)],
                      values=[arrays[f"v.{i}"] for i in range(n)], fingerprint=meta["fingerprint"],
                      scores=arrays.get("scores"), stats=dict(meta["stats"]), mixed=mixed)


def verify_blobs(meta: Mapping[str, Any], blobs: Mapping[str, np.ndarray], key: CheckpointKey) -> None:
    """Check in-memory blobs against the checksums taken when they were stored (no copies).

    Raises:
        CorruptCheckpoint: a blob changed length or content since it was stored.
    """
    check_meta(meta, key)
    for spec in meta["blobs"]:
        raw = blobs.get(spec["name"])
        if raw is None:
            raise CorruptCheckpoint(f"blob {spec['name']} of {key.describe()} is missing")
        if raw.nbytes != spec["nbytes"]:
            raise CorruptCheckpoint(f"blob {spec['name']} has {raw.nbytes} bytes, expected {spec['nbytes']}")
        if xxhash.xxh3_64_hexdigest(raw) != spec["xxh3"]:
            raise CorruptCheckpoint(f"blob {spec['name']} failed its checksum (flipped bytes)")
