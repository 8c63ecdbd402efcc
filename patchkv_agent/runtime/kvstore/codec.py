"""Checkpoint <-> (metadata dict + named binary blobs), every blob checksummed, and the checkpoint key.

A :class:`~patchkv_agent.core.checkpoint.Checkpoint` becomes a JSON-safe metadata dict (the key it was stored
under, the fingerprint, its provenance under ``stats`` (:meth:`CheckpointProvenance.to_json
<patchkv_agent.core.provenance.CheckpointProvenance.to_json>`; entries written before it was typed hold the
same keys), the mixed-precision layout, and per blob its dtype, shape, length and
xxh3-64) plus one raw byte blob per tensor: ``token_ids``, ``scores``, ``k.<layer>``, ``v.<layer>``,
``mixed.tags``, ``mixed.rows.<tag>``, ``p.<layer>.<tag>.<field>`` (the :class:`RunPayload` tensors).
:func:`decode_checkpoint` checks every blob's length and checksum, the metadata's own checksum, and
that the content belongs to the requested key (thread, version, fingerprint, token-ids hash) before
it builds a single tensor; a failure raises :class:`~patchkv_agent.core.checkpoint.CorruptCheckpoint` (or its
subclass :class:`ForeignCheckpoint`) naming what failed.

Nothing read back is trusted before it is verified: :func:`parse_meta` turns stored metadata bytes into a
dict or a ``CorruptCheckpoint`` (never a ``UnicodeDecodeError`` or ``JSONDecodeError``; metadata over
:data:`MAX_META_BYTES` bytes or :data:`MAX_META_VALUES` values is refused unparsed, so parsing costs a small
multiple of the stored bytes);
:func:`check_meta` verifies the metadata checksum and then every field's type and range (blob names, dtypes,
shapes, lengths); :func:`entry_nbytes` derives an entry's size from the verified shapes and dtypes (what the
budgets count), never from a stored size field.

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
from ...core.provenance import CheckpointProvenance

SCHEMA = 1
_PAYLOAD_HEADER = ("tag", "n_rows", "num_kv_heads", "head_dim", "block_size", "v_group")
_PAYLOAD_FIELDS = ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero")
MAX_META_BYTES = 4 << 20   # stored metadata larger than this is refused unread (a real entry's is a few KiB)
MAX_META_VALUES = 1 << 18   # JSON values stored metadata may hold (each costs ~70 B parsed): more is refused unparsed
MAX_LAYERS = 4096
MAX_DIMS = 8
MAX_ENTRY_BYTES = 1 << 42   # 4 TiB: a size beyond this is damage, not data
MAX_HEADS = MAX_HEAD_DIM = 1 << 16  # K/V heads and head_dim (a zero-row blob can claim any, so they are bounded)
MAX_GROUP = 1 << 30  # block size and value group (the kernels hold them as int32)
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}
_NUMPY_DTYPES = frozenset(_ITEMSIZE) - {"bfloat16"}
_HEX16 = frozenset("0123456789abcdef")


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
                            "n_layers": len(ckpt.keys), "stats": ckpt.provenance.to_json(), "blobs": table,
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


def parse_meta(raw: bytes | bytearray | memoryview | str, what: str = "stored metadata") -> dict[str, Any]:
    """Stored metadata bytes -> the metadata dict (not yet verified: pass it to :func:`check_meta`).

    What parsing may cost is bounded before anything is parsed: more than :data:`MAX_META_BYTES` bytes, or
    more than :data:`MAX_META_VALUES` JSON values (counted as the commas, colons and brackets in the bytes,
    an upper bound), is refused unparsed, so no stored metadata costs more than a small multiple of its
    length in memory.

    Args:
        raw: the stored bytes (or text).
        what: what they are, for the message.

    Returns:
        The parsed JSON object.

    Raises:
        CorruptCheckpoint: too large, too many values, not UTF-8, not JSON, or not a JSON object.
    """
    if len(raw) > MAX_META_BYTES:
        raise CorruptCheckpoint(f"{what} has {len(raw)} bytes (more than {MAX_META_BYTES}: damaged, refused unread)")
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    values = 1 + sum(data.count(c) for c in (b",", b":", b"[", b"{"))
    if values > MAX_META_VALUES:
        raise CorruptCheckpoint(f"{what} holds up to {values} JSON values (more than {MAX_META_VALUES}: damaged, "
                                "refused unparsed)")
    try:
        text = raw if isinstance(raw, str) else data.decode("utf-8")
        meta = json.loads(text)
    except UnicodeDecodeError:
        raise CorruptCheckpoint(f"{what} is not UTF-8 (damaged bytes)") from None
    except (ValueError, RecursionError):
        raise CorruptCheckpoint(f"{what} is not valid JSON (damaged bytes)") from None
    if not isinstance(meta, dict):
        raise CorruptCheckpoint(f"{what} is not a JSON object (damaged)")
    return meta


def _is_int(x: Any, lo: int = 0, hi: int | None = None) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo and (hi is None or x <= hi)


def _blob_size(spec: Any, names: set[str]) -> int:
    """Check one blob-table row; returns its byte length derived from shape and dtype."""
    if not isinstance(spec, dict) or set(spec) != {"name", "kind", "dtype", "shape", "nbytes", "xxh3"}:
        raise CorruptCheckpoint("a blob-table row has the wrong fields")
    name, kind, dtype, shape = spec["name"], spec["kind"], spec["dtype"], spec["shape"]
    if not isinstance(name, str) or name not in names:
        raise CorruptCheckpoint(f"unexpected blob name {str(name)[:40]!r} in the blob table")
    names.discard(name)  # each name once
    if kind not in ("torch", "numpy") or dtype not in (_ITEMSIZE if kind == "torch" else _NUMPY_DTYPES):
        raise CorruptCheckpoint(f"blob {name} has an unknown kind or dtype ({str(kind)[:10]!r}, {str(dtype)[:10]!r})")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d, 0, MAX_ENTRY_BYTES) for d in shape):
        raise CorruptCheckpoint(f"blob {name} has a malformed shape")
    n = _ITEMSIZE[dtype]
    for d in shape:
        n *= d
    if n > MAX_ENTRY_BYTES or spec["nbytes"] != n or not _is_int(spec["nbytes"]):
        raise CorruptCheckpoint(f"blob {name} says {str(spec['nbytes'])[:24]} bytes; its shape and dtype make {n}")
    x = spec["xxh3"]
    if not isinstance(x, str) or len(x) != 16 or not set(x) <= _HEX16:
        raise CorruptCheckpoint(f"blob {name} has a malformed checksum field")
    return n


def _check_layout(meta: Mapping[str, Any]) -> int:
    """Check every field's type and range after the checksum matched; returns the entry's blob bytes."""
    n_layers, mixed, stats = meta.get("n_layers"), meta.get("mixed"), meta.get("stats")
    if not _is_int(n_layers, 1, MAX_LAYERS):
        raise CorruptCheckpoint(f"n_layers {str(n_layers)[:24]} is out of range")
    if not isinstance(meta.get("fingerprint"), str) or not isinstance(stats, dict):
        raise CorruptCheckpoint("fingerprint or stats field has the wrong type")
    try:  # the provenance (an old entry's stats dict reads the same): unknown keys and bad values are refused
        CheckpointProvenance.from_json(stats)
    except ValueError as e:
        raise CorruptCheckpoint(f"stats field: {e}") from None
    if "store" in meta and not (isinstance(meta["store"], dict)
                                and all(isinstance(v, str) for v in meta["store"].values())):
        raise CorruptCheckpoint("the store field has the wrong type")
    names = {"token_ids", "scores", *(f"{kv}.{i}" for i in range(n_layers) for kv in "kv")}
    tags: list[str] = []
    if mixed is not None:
        if not isinstance(mixed, dict) or set(mixed) != {"block_size", "runs", "tags", "headers", "checksums"}:
            raise CorruptCheckpoint("the mixed-precision layout has the wrong fields")
        tags = mixed["tags"]
        if (not isinstance(tags, list) or len(tags) > len(Tag) or not all(t in Tag.__members__ for t in tags)
                or len(set(tags)) != len(tags) or not _is_int(mixed["block_size"], 1)):
            raise CorruptCheckpoint("the mixed-precision tags or block size are malformed")
        runs, headers, sums = mixed["runs"], mixed["headers"], mixed["checksums"]
        codes = {int(t) for t in Tag}  # stored tag codes (K4V4 is -1: checked by membership, not range)
        if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 3 and _is_int(r[0], min(codes))
                                                 and r[0] in codes and _is_int(r[1]) and _is_int(r[2]) for r in runs):
            raise CorruptCheckpoint("the mixed-precision runs are malformed")
        for seq in (headers, sums):
            if not isinstance(seq, list) or len(seq) != n_layers or not all(
                    isinstance(layer, dict) and set(layer) <= set(tags) for layer in seq):
                raise CorruptCheckpoint("the mixed-precision headers or checksums are malformed")
        for layer, sums_layer in zip(headers, sums):
            if set(layer) != set(sums_layer) or not all(_is_int(c) for c in sums_layer.values()):
                raise CorruptCheckpoint("the mixed-precision checksums are malformed")
            for tag, hdr in layer.items():
                if (not isinstance(hdr, dict) or set(hdr) != set(_PAYLOAD_HEADER) or hdr["tag"] != tag
                        or not all(_is_int(hdr[f]) for f in _PAYLOAD_HEADER[1:])):
                    raise CorruptCheckpoint("a run payload header is malformed")
        names |= {"mixed.tags", *(f"mixed.rows.{t}" for t in tags)}
        names |= {f"p.{i}.{t}.{f}" for i in range(n_layers) for t in tags for f in _PAYLOAD_FIELDS}
    table = meta.get("blobs")
    if not isinstance(table, list) or len(table) > len(names):
        raise CorruptCheckpoint("the blob table is malformed")
    total = sum(_blob_size(spec, names) for spec in table)
    missing = {"token_ids", *(f"{kv}.{i}" for i in range(n_layers) for kv in "kv")} & names
    if mixed is not None:
        missing |= {"mixed.tags", *(f"mixed.rows.{t}" for t in tags)} & names
    if missing:
        raise CorruptCheckpoint(f"the blob table lacks {sorted(missing)[0]}")
    _check_structure(meta, {spec["name"]: spec for spec in table})
    return total


_FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})


def _payload_specs(tag: str, h: int, r: int, d: int, bs: int, g: int, kv_dtype: str) -> dict[str, tuple[list, str]]:
    """The blob (shape, dtype) of each field of a run payload with this header (``kernels.formats.RunPayload``)."""
    if tag == "FP16":
        return {"k_data": ([h, r, d], kv_dtype), "v_data": ([h, r, d], kv_dtype)}
    kdiv, vdiv = (2 if tag == "K4V4" else 1), (1 if tag == "K8V8" else 2)
    nb, ng = -(-r // bs), -(-d // g)
    return {"k_data": ([h, r, d // kdiv], "uint8"), "v_data": ([h, r, d // vdiv], "uint8"),
            "k_scale": ([h, nb, d], "float16"), "k_zero": ([h, nb, d], "float16"),
            "v_scale": ([h, r, ng], "float16"), "v_zero": ([h, r, ng], "float16")}


def _check_structure(meta: Mapping[str, Any], specs: Mapping[str, Mapping[str, Any]]) -> None:
    """Every header field against the (checksum-covered) blob table, before any blob is read.

    Token ids int64 ``[N]``; per layer K and V torch blobs of one float dtype and shape ``[H, N, D]``; scores
    ``[N]``; block tags int8 ``[ceil(N / block_size)]``; runs covering the blocks in order, of the listed
    tags; per (layer, tag) a header whose rows, heads, head_dim and block size are those of the blobs, a
    value group that is a power of two, a head_dim even for 4-bit codes, and exactly the payload blobs that
    format has, each of the shape and dtype the header makes (so K4V4 data cannot pass as K8V4, a scale
    blob cannot be short, a count cannot exceed its blob).
    """
    tok = specs["token_ids"]
    if tok["kind"] != "numpy" or tok["dtype"] != "int64" or len(tok["shape"]) != 1:
        raise CorruptCheckpoint("token_ids is not an int64 vector")
    n = tok["shape"][0]
    sc = specs.get("scores")
    if sc is not None and (sc["kind"] != "numpy" or sc["dtype"] not in _FLOATS or sc["shape"] != [n]):
        raise CorruptCheckpoint(f"scores are not a float vector of the {n} tokens")
    layers = []
    for i in range(meta["n_layers"]):
        k, v = specs[f"k.{i}"], specs[f"v.{i}"]
        if (k["kind"] != "torch" or v["kind"] != "torch" or k["dtype"] not in _FLOATS or v["dtype"] != k["dtype"]
                or len(k["shape"]) != 3 or v["shape"] != k["shape"] or k["shape"][1] != n
                or not 1 <= k["shape"][0] <= MAX_HEADS or not 1 <= k["shape"][2] <= MAX_HEAD_DIM):
            raise CorruptCheckpoint(f"K/V of layer {i} are not float [H, {n}, D] tensors of one shape and dtype")
        layers.append((k["shape"][0], k["shape"][2], k["dtype"]))
    mixed = meta["mixed"]
    if mixed is None:
        extra = sorted(x for x in specs if x.startswith(("p.", "mixed.")))
        if extra:
            raise CorruptCheckpoint(f"blob {extra[0]} belongs to no mixed-precision layout")
        return
    bs, tags = mixed["block_size"], mixed["tags"]
    if bs > MAX_GROUP:
        raise CorruptCheckpoint(f"the block size {bs} is out of range")
    nb = -(-n // bs)
    t = specs["mixed.tags"]
    if t["kind"] != "numpy" or t["dtype"] != "int8" or t["shape"] != [nb]:
        raise CorruptCheckpoint(f"the block tags are not int8 [{nb}] ({n} tokens in blocks of {bs})")
    first, seen = 0, set()
    for code, a, m in mixed["runs"]:
        if a != first or m < 1:
            raise CorruptCheckpoint("the mixed-precision runs do not cover the blocks in order")
        first += m
        seen.add(Tag(code).name)
    if first != nb or seen != set(tags):
        raise CorruptCheckpoint(f"the runs cover {first} blocks of tags {sorted(seen)}; the layout has {nb} of {sorted(tags)}")
    rows = {}
    for tag in tags:
        spec = specs[f"mixed.rows.{tag}"]
        if spec["kind"] != "numpy" or spec["dtype"] != "int64" or len(spec["shape"]) != 1 or spec["shape"][0] > n:
            raise CorruptCheckpoint(f"the {tag} rows are not an int64 vector of at most {n} positions")
        rows[tag] = spec["shape"][0]
    for i, ((h, d, kv_dtype), layer, sums) in enumerate(zip(layers, mixed["headers"], mixed["checksums"])):
        if set(layer) != set(tags) or not all(c < 1 << 64 for c in sums.values()):
            raise CorruptCheckpoint(f"layer {i} has payloads of tags {sorted(layer)}, the layout {sorted(tags)}")
        for tag, hdr in layer.items():
            g = hdr["v_group"]
            if (hdr["n_rows"], hdr["num_kv_heads"], hdr["head_dim"], hdr["block_size"]) != (rows[tag], h, d, bs):
                raise CorruptCheckpoint(
                    f"the {tag} payload header of layer {i} says {hdr['n_rows']} rows, {hdr['num_kv_heads']} heads, "
                    f"head_dim {hdr['head_dim']}, block {hdr['block_size']}; its blobs have {rows[tag]}, {h}, {d}, {bs}")
            if g < 1 or g & (g - 1) or g > MAX_GROUP or (tag != "FP16" and tag != "K8V8" and d % 2):
                raise CorruptCheckpoint(f"the {tag} payload of layer {i} has value group {g} / head_dim {d}")
            want = _payload_specs(tag, h, rows[tag], d, bs, g, kv_dtype)
            have = {f for f in _PAYLOAD_FIELDS if f"p.{i}.{tag}.{f}" in specs}
            if have != set(want):
                raise CorruptCheckpoint(f"the {tag} payload of layer {i} has blobs {sorted(have)}, its format "
                                        f"needs {sorted(want)}")
            for f, (shape, dtype) in want.items():
                spec = specs[f"p.{i}.{tag}.{f}"]
                if spec["kind"] != "torch" or spec["shape"] != shape or spec["dtype"] != dtype:
                    raise CorruptCheckpoint(f"blob p.{i}.{tag}.{f} is {spec['dtype']} {spec['shape']}; the {tag} "
                                            f"header makes it {dtype} {shape}")


@dataclass(frozen=True, kw_only=True)
class EntryLimits:
    """What the model asking for an entry can need: an entry of another shape is damage, not data.

    Checked against the verified metadata before any blob is read or allocated (:meth:`check_meta`), and
    against a decoded checkpoint (:meth:`check_checkpoint`, for tiers that hold checkpoints in memory).

    Attributes:
        num_layers: the model's decoder layers (the entry must have exactly these).
        num_kv_heads: its K/V heads (every layer's K/V must have exactly these).
        head_dim: its head dimension (likewise).
        max_positions: the longest context it takes (the entry's token count must not exceed it).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int

    @classmethod
    def of(cls, spec: Any) -> "EntryLimits":
        """The limits of a :class:`~patchkv_agent.core.models.ModelSpec` (or anything with its four fields)."""
        return cls(num_layers=int(spec.num_layers), num_kv_heads=int(spec.num_kv_heads),
                   head_dim=int(spec.head_dim), max_positions=int(spec.max_positions))

    def _misfit(self, n_layers: int, n_tokens: int, shapes) -> str | None:
        if n_layers != self.num_layers:
            return f"{n_layers} layers, the model has {self.num_layers}"
        if n_tokens > self.max_positions:
            return f"{n_tokens} positions, the model takes at most {self.max_positions}"
        want = (self.num_kv_heads, self.head_dim)
        for i, (h, d) in enumerate(shapes):
            if (h, d) != want:
                return f"layer {i} holds {h} heads x {d} channels, the model {want[0]} x {want[1]}"
        return None

    def check_meta(self, meta: Mapping[str, Any], what: str) -> None:
        """Refuse verified metadata (:func:`check_meta` passed) of an entry this model cannot have written.

        Args:
            meta: metadata :func:`check_meta` accepted.
            what: the entry, for the message (e.g. ``key.describe()``).

        Raises:
            CorruptCheckpoint: layers, K/V heads, head_dim or token count differ from the model's (the
                message says "does not fit this model").
        """
        specs = {s["name"]: s for s in meta["blobs"]}
        n = int(meta["n_layers"])
        misfit = self._misfit(n, specs["token_ids"]["shape"][0],
                              ((specs[f"k.{i}"]["shape"][0], specs[f"k.{i}"]["shape"][2]) for i in range(n)))
        if misfit is not None:
            raise CorruptCheckpoint(f"the entry of {what} does not fit this model: {misfit}")

    def check_checkpoint(self, ckpt: Checkpoint, what: str) -> None:
        """As :meth:`check_meta`, on a checkpoint already in memory.

        Raises:
            CorruptCheckpoint: it does not fit this model.
        """
        misfit = self._misfit(len(ckpt.keys), len(ckpt.token_ids), ((k.shape[0], k.shape[2]) for k in ckpt.keys))
        if misfit is not None:
            raise CorruptCheckpoint(f"the entry of {what} does not fit this model: {misfit}")


def entry_nbytes(meta: Mapping[str, Any]) -> int:
    """Total blob bytes of an entry whose metadata :func:`check_meta` accepted (what budgets count),
    derived from the verified shapes and dtypes."""
    return _check_layout(meta)


def blob_nbytes(meta: Mapping[str, Any]) -> int:
    """Total blob bytes of metadata built by :func:`encode_checkpoint` in this process."""
    return sum(int(b["nbytes"]) for b in meta["blobs"])


def _stored_key(meta: Mapping[str, Any]) -> CheckpointKey:
    k = meta.get("key")
    types = {"deployment": str, "thread_id": str, "checkpoint_ns": str, "version": int, "fingerprint": str,
             "ids_hash": str}
    if (not isinstance(k, dict) or set(k) != set(types) or isinstance(k["version"], bool)
            or not all(isinstance(k[f], t) for f, t in types.items())):
        raise CorruptCheckpoint("the stored key is malformed")
    return CheckpointKey(**k)


def check_meta(meta: Any, key: CheckpointKey | None) -> CheckpointKey:
    """Refuse metadata that is damaged, malformed, of another schema, or of another key.

    The checksum is checked first; then every field's type and range (:func:`entry_nbytes`), so no field
    the checksum does not cover, and no malformed one, is used.

    Args:
        meta: the parsed metadata (:func:`parse_meta`).
        key: the key the caller asked for (None: any key; the stored one is returned).

    Returns:
        The key stored in the metadata.

    Raises:
        CorruptCheckpoint: checksum, schema or field mismatch.
        ForeignCheckpoint: the entry belongs to another thread, version, model or token ids.
    """
    what = key.describe() if key is not None else "a stored entry"
    if not isinstance(meta, Mapping) or not isinstance(meta.get("meta_xxh3"), str) or "key" not in meta:
        raise CorruptCheckpoint(f"metadata of {what} is unreadable")
    if meta_checksum(meta) != meta["meta_xxh3"]:
        raise CorruptCheckpoint(f"metadata checksum mismatch for {what}")
    if meta.get("schema") != SCHEMA or isinstance(meta.get("schema"), bool):
        raise CorruptCheckpoint(f"stored schema {str(meta.get('schema'))[:24]} is not {SCHEMA}")
    try:
        stored = _stored_key(meta)
        _check_layout(meta)
    except CorruptCheckpoint as e:
        raise CorruptCheckpoint(f"metadata of {what} is malformed: {e}") from None
    if key is None or stored == key:
        return stored
    for field, what in (("deployment", "deployment"), ("thread_id", "thread"), ("checkpoint_ns", "namespace"),
                        ("version", "version"), ("fingerprint", "model"), ("ids_hash", "token ids")):
        a, b = getattr(stored, field), getattr(key, field)
        if a != b:
            raise ForeignCheckpoint(f"refused: the entry found for {key.describe()} belongs to another "
                                    f"{what} ({field} {str(a)[:40]!r}, requested {str(b)[:40]!r})")
    raise ForeignCheckpoint(f"refused: the entry found for {key.describe()} belongs to another key")


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
        CorruptCheckpoint: damaged or malformed metadata, a missing blob, a wrong length, a checksum
            mismatch, or tensors whose shapes do not fit together; never another exception type for
            anything stored.
        ForeignCheckpoint: the entry belongs to another key.
    """
    check_meta(meta, key)
    try:
        return _decode(meta, blobs, key)
    except CorruptCheckpoint:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError) as e:
        raise CorruptCheckpoint(f"entry of {key.describe()} cannot be decoded: {type(e).__name__}: "
                                f"{str(e)[:200]}") from None


def _decode(meta: Mapping[str, Any], blobs: Mapping[str, bytes | bytearray | memoryview],
            key: CheckpointKey) -> Checkpoint:
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
    keys, values = [arrays[f"k.{i}"] for i in range(n)], [arrays[f"v.{i}"] for i in range(n)]
    n_tok = token_ids.shape[0] if token_ids.ndim == 1 and token_ids.dtype == np.int64 else -1
    for k, v in zip(keys, values):
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 3
                and k.shape == v.shape and k.shape[1] == n_tok and k.dtype == v.dtype):
            raise CorruptCheckpoint(f"K/V shapes of {key.describe()} do not fit its {n_tok} token ids")
    scores = arrays.get("scores")
    if scores is not None and scores.shape != (n_tok,):
        raise CorruptCheckpoint(f"attention scores of {key.describe()} do not fit its token ids")
    mixed = None
    if meta["mixed"] is not None:
        mm = meta["mixed"]
        payloads = []
        for i, layer in enumerate(mm["headers"]):
            payloads.append({tag: RunPayload(**hdr, **{f: arrays[f"p.{i}.{tag}.{f}"] for f in _PAYLOAD_FIELDS
                                                      if f"p.{i}.{tag}.{f}" in arrays})
                             for tag, hdr in layer.items()})
        tags = arrays["mixed.tags"]
        if (not isinstance(tags, np.ndarray) or tags.ndim != 1
                or not set(np.unique(tags).tolist()) <= {int(t) for t in Tag}):
            raise CorruptCheckpoint(f"the mixed-precision block tags of {key.describe()} hold unknown tag codes")
        runs = np.repeat([r[0] for r in mm["runs"]], [r[2] for r in mm["runs"]])
        if not np.array_equal(runs.astype(np.int64), tags.astype(np.int64)):
            raise CorruptCheckpoint(f"the block tags of {key.describe()} disagree with its runs")
        block_tag = tags[np.arange(n_tok) // int(mm["block_size"])]
        for tag in mm["tags"]:  # each tag's rows are exactly its blocks' rows: in range, sorted, distinct
            if not np.array_equal(arrays[f"mixed.rows.{tag}"], np.flatnonzero(block_tag == int(Tag[tag]))):
                raise CorruptCheckpoint(f"the {tag} rows of {key.describe()} are not the rows of its {tag} blocks")
        for i, layer in enumerate(payloads):
            for tag, p in layer.items():
                for f in ("k_scale", "v_scale", "k_zero", "v_zero"):
                    x = getattr(p, f)
                    if x is not None and x.numel() and not bool(torch.isfinite(x).all() and (
                            f.endswith("zero") or (x > 0).all())):
                        raise CorruptCheckpoint(f"the {tag} {f} of layer {i} of {key.describe()} holds non-finite "
                                                "or non-positive values")
        mixed = MixedKV(block_size=int(mm["block_size"]), tags=tags,
                        runs=tuple(Run(Tag(t), int(a), int(b)) for t, a, b in mm["runs"]),
                        tag_rows={tag: arrays[f"mixed.rows.{tag}"] for tag in mm["tags"]},
                        payloads=payloads, checksums=[{t: int(c) for t, c in layer.items()}
                                                      for layer in mm["checksums"]])
    return Checkpoint(token_ids=token_ids, keys=keys, values=values, fingerprint=meta["fingerprint"],
                      scores=scores, provenance=CheckpointProvenance.from_json(meta["stats"]), mixed=mixed)


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
