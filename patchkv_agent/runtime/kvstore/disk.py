"""The local disk tier: one directory per checkpoint, published by write-then-rename, survives restarts.

Layout under ``root/<deployment>/``::

    <key digest>/meta.json   the codec's metadata (key, fingerprint, blob table with xxh3 per blob)
    <key digest>/data.bin    the blobs back to back, in the table's order
    .tmp-<digest>-<uuid>/    an entry being written (never read; stale ones are removed on open)
    .gone/<key digest>       why an entry is gone (evicted, deleted, too large)

``put`` writes both files into a temporary directory, fsyncs them, and renames the directory into
place: a reader (in this or another process) sees the whole entry or none. Replacing an entry of the
same key renames the old one aside first; a reader in another process may then briefly miss it and
falls back to exact recomputation. Recency survives a restart through ``meta.json``'s mtime (touched on
every ``get``). The budget is enforced per store instance over the entries it knows (those present
when it opened, those it wrote, and those of other processes it has read).

Knows the codec and the file system; nothing about engines or Redis.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from ...core.checkpoint import Checkpoint, CorruptCheckpoint
from .base import CheckpointMissing, KVStore, StoreUnavailable
from .codec import CheckpointKey, blob_nbytes, check_meta, decode_checkpoint

STALE_TMP_S = 600.0


def _dir_name(deployment: str) -> str:
    """A file-safe directory name, unique per deployment (the hash tells apart names that sanitize alike)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", deployment)[:64]
    return f"{safe}-{hashlib.blake2b(deployment.encode(), digest_size=4).hexdigest()}"


class DiskStore(KVStore):
    """Checkpoints as files under ``root``.

    Args:
        root: the directory (created if missing); several processes may share it.
        deployment: the namespace (a subdirectory).
        budget_bytes: blob bytes held at most (None: unbounded).
        fsync: fsync files and directories on publish (off only for throwaway stores).

    Raises:
        StoreUnavailable: ``root`` cannot be created or listed.
    """

    tier = "disk"

    def __init__(self, root: str | os.PathLike, *, deployment: str = "default", budget_bytes: int | None = None,
                 fsync: bool = True):
        super().__init__(deployment=deployment, budget_bytes=budget_bytes)
        self.root = Path(root)
        self.dir = self.root / _dir_name(self.deployment)
        self.fsync = fsync
        self._clock = 0  # last recency stamp (ns)
        try:
            (self.dir / ".gone").mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            raise StoreUnavailable(f"disk store at {self.dir} cannot be opened: {e}") from e

    def path_of(self, key: CheckpointKey) -> Path:
        """The entry directory of ``key`` (for inspection and fault-injection tests)."""
        return self.dir / key.digest

    # ------------------------------------------------------------------ restart

    def _scan(self) -> None:
        found = []
        now = time.time()
        for p in self.dir.iterdir():
            if p.name.startswith(".tmp-") and now - p.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)  # an interrupted put: never published
            if p.name.startswith(".") or not p.is_dir():
                continue
            entry = self._load_index_entry(p)
            if entry is not None:
                found.append(entry)
        for mtime, key, n in sorted(found, key=lambda e: e[0]):
            self._lru[key] = n

    def _load_index_entry(self, p: Path):
        try:
            meta_path = p / "meta.json"
            meta = json.loads(meta_path.read_text())
            key = CheckpointKey(**meta["key"])
            return meta_path.stat().st_mtime_ns, key, blob_nbytes(meta)
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable: get() reports it as corrupt if asked for by key

    def _index_get(self, key: CheckpointKey) -> int | None:
        n = super()._index_get(key)
        if n is None and (self.path_of(key) / "meta.json").exists():  # written by another process
            entry = self._load_index_entry(self.path_of(key))
            n = entry[2] if entry is not None else 0
            self._index_put(key, n)
        return n

    # ------------------------------------------------------------------ hooks

    def _write(self, key, meta, blobs, ckpt) -> None:
        tmp = self.dir / f".tmp-{key.digest}-{uuid.uuid4().hex}"
        final = self.path_of(key)
        try:
            tmp.mkdir()
            with open(tmp / "data.bin", "wb") as f:
                for spec in meta["blobs"]:
                    f.write(memoryview(blobs[spec["name"]]))
                self._sync(f)
            with open(tmp / "meta.json", "w") as f:
                json.dump(meta, f)
                self._sync(f)
            if final.exists():
                trash = self.dir / f".tmp-{key.digest}-{uuid.uuid4().hex}-old"
                os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
            self._stamp(final / "meta.json")
            if self.fsync:
                fd = os.open(self.dir, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StoreUnavailable(f"disk store at {self.dir} cannot write {key.describe()}: {e}") from e

    def _stamp(self, path: Path) -> None:
        # explicit nanosecond stamps: the kernel's own mtimes are jiffy-coarse and would tie
        self._clock = max(time.time_ns(), self._clock + 1)
        os.utime(path, ns=(self._clock, self._clock))

    def _sync(self, f) -> None:
        if self.fsync:
            f.flush()
            os.fsync(f.fileno())

    def _read(self, key) -> Checkpoint:
        p = self.path_of(key)
        try:
            text = (p / "meta.json").read_text()
            data = (p / "data.bin").read_bytes()
            self._stamp(p / "meta.json")  # recency survives a restart
        except FileNotFoundError:
            self._index_pop(key)
            raise CheckpointMissing(key, self._tomb_get(key) or f"checkpoint of {key.describe()} was removed "
                                    "from the disk store (evicted or replaced by another process)") from None
        except OSError as e:
            raise StoreUnavailable(f"disk store at {self.dir} cannot read {key.describe()}: {e}") from e
        try:
            meta = json.loads(text)
        except ValueError:
            raise CorruptCheckpoint(f"metadata of {key.describe()} is not valid JSON (damaged file)") from None
        check_meta(meta, key)  # before the blob table is trusted
        view, blobs, off = memoryview(data), {}, 0
        for spec in meta["blobs"]:
            blobs[spec["name"]] = view[off:off + spec["nbytes"]]
            off += spec["nbytes"]
        if len(data) > off:  # a shorter file shows up as a short blob in decode_checkpoint
            raise CorruptCheckpoint(f"data file of {key.describe()} has {len(data)} bytes, expected {off} "
                                    "(wrong length)")
        return decode_checkpoint(meta, blobs, key)

    def _remove(self, key) -> None:
        p = self.path_of(key)
        if p.exists():
            trash = self.dir / f".tmp-{key.digest}-{uuid.uuid4().hex}-del"
            try:
                os.rename(p, trash)  # atomic unpublish, then delete at leisure
            except FileNotFoundError:
                return
            shutil.rmtree(trash, ignore_errors=True)

    # tombstones persist so another process (or a restart) can say why a key is gone

    def _tomb_put(self, key, reason: str) -> None:
        super()._tomb_put(key, reason)
        try:
            (self.dir / ".gone" / key.digest).write_text(reason)
        except OSError:
            pass

    def _tomb_get(self, key) -> str | None:
        reason = super()._tomb_get(key)
        if reason is None:
            try:
                reason = (self.dir / ".gone" / key.digest).read_text() or None
            except OSError:
                reason = None
        return reason

    def _tomb_pop(self, key) -> None:
        super()._tomb_pop(key)
        try:
            (self.dir / ".gone" / key.digest).unlink()
        except OSError:
            pass
