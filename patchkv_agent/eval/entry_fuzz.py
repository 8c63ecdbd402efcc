"""A structure-aware fuzzer of stored checkpoint entries: hostile headers under consistent checksums.

A store entry is a metadata dict and named blobs (:mod:`patchkv_agent.runtime.kvstore.codec`). A writer with
access to a shared tier can store any entry whose checksums it computed itself, so checksums prove
nothing about intent. This module builds such entries: it starts from a genuine entry holding every
format (K4V4 included), applies random structural edits (header fields, blob shapes and dtypes, row
indices, block tags, runs, format labels, missing or extra blobs) and :func:`reseal` s the result (every
blob's length and xxh3, every run payload checksum, the metadata checksum), so only the codec's structural
checks stand between the entry and the kernels.

:func:`check_entry` is the oracle of one example: the codec refuses the entry with
:class:`~patchkv_agent.core.checkpoint.CorruptCheckpoint`, or it accepts it and then every (layer, format)
run restores on the torch and native paths without an exception and with bit-identical results; and the
native library, handed the raw hostile header with honest buffer sizes (no Python check in between),
returns 0 or an error code. Anything else (another exception, a difference, a crash, a sanitizer report)
is a failure. :func:`run_fuzz` drives it with Hypothesis; :func:`run_fuzz_asan` runs the same in a
subprocess whose native library is built with AddressSanitizer (``tests/test_entry_fuzz.py`` in CI,
``patchkv-agent stress --fuzz`` for longer runs).

Needs the test extra (``pip install 'patchkv-agent[test]'``) for Hypothesis; knows the codec, the
kernels and the native library; nothing about engines or models.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import xxhash

from ..runtime.kvstore.codec import CheckpointKey, encode_checkpoint, meta_checksum

_PAYLOAD_FIELDS = ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero")


def editable(ckpt, key: CheckpointKey) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The entry of ``ckpt`` under ``key`` as a deep-copied metadata dict and private uint8 blob arrays.

    Returns:
        ``(meta, blobs)`` to edit in place, then :func:`reseal`.
    """
    meta, blobs = encode_checkpoint(ckpt, key)
    return json.loads(json.dumps(meta)), {k: np.array(v, dtype=np.uint8, copy=True) for k, v in blobs.items()}


def _payload_sum(hdr: dict, blobs: dict[str, np.ndarray], layer: int, tag: str) -> int:
    """What ``core.checkpoint.payload_checksum`` gives for the payload these header and blobs decode to."""
    h = xxhash.xxh3_64()
    h.update(f"{hdr.get('tag')}:{hdr.get('n_rows')}:{hdr.get('num_kv_heads')}:{hdr.get('head_dim')}:"
             f"{hdr.get('block_size')}:{hdr.get('v_group')}".encode())
    for f in _PAYLOAD_FIELDS:
        raw = blobs.get(f"p.{layer}.{tag}.{f}")
        if raw is not None:
            h.update(f.encode())
            h.update(raw.tobytes())
    return h.intdigest()


def reseal(meta: dict[str, Any], blobs: dict[str, np.ndarray]) -> None:
    """Make an edited entry's checksums consistent again (in place), as a hostile writer would.

    Every blob-table row gets its blob's xxh3 (its ``nbytes`` stays what its shape and dtype make, so a
    blob whose bytes disagree with its row is still refused as a wrong length), every run payload its
    checksum, and the metadata its own checksum.
    """
    for spec in meta.get("blobs", []):
        raw = blobs.get(spec.get("name")) if isinstance(spec, dict) else None
        if raw is not None:
            spec["xxh3"] = xxhash.xxh3_64_hexdigest(raw.tobytes())
            if isinstance(spec.get("nbytes"), int):
                spec["nbytes"] = int(raw.nbytes)
    m = meta.get("mixed")
    if isinstance(m, dict) and isinstance(m.get("headers"), list) and isinstance(m.get("checksums"), list):
        for i, (layer, sums) in enumerate(zip(m["headers"], m["checksums"])):
            if isinstance(layer, dict) and isinstance(sums, dict):
                for tag, hdr in layer.items():
                    if tag in sums and isinstance(hdr, dict):
                        sums[tag] = _payload_sum(hdr, blobs, i, tag)
    meta["meta_xxh3"] = meta_checksum(meta)


def deep_copy(meta: dict[str, Any], blobs: dict[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Independent copies of an editable entry."""
    return copy.deepcopy(meta), {k: v.copy() for k, v in blobs.items()}
