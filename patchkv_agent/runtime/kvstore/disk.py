"""The local disk tier: one file per checkpoint, replaced by one atomic rename, survives restarts and crashes.

Layout under ``root/<deployment>/``::

    <key digest>.kv              an entry: header, metadata (the codec's JSON), the blobs back to back
    .tmp-<digest>-<uuid>.kv      an entry being written (never read; removed by recovery)
    .gone/<key digest>           why an entry is gone (evicted, deleted, too large, quarantined)
    .quarantine/<digest>-<ns>.kv entries that failed a check, moved aside (the newest few are kept)
    .lock                        shared by writers during a put, exclusive during recovery

An entry file is ``MAGIC`` (8 bytes), the metadata length (u64, little endian), the xxh3-64 of the
metadata bytes (u64), the metadata, then the blobs in the blob table's order. Every byte read back is
verified before use: the header's metadata checksum, the codec's checksum over the metadata record and
its field types, the file length against the length derived from the verified blob table, and each
blob's xxh3. A check that fails quarantines the entry (moved to ``.quarantine/``, counted, its reason
recorded) so the next call sees a plain miss; nothing that is not a regular file is ever opened for
reading (a FIFO or a directory in place of an entry is skipped, never waited on). Sizes are checked before
anything is allocated: the length the verified blob table makes must be the file's, within the budget and
this host's memory, and (for a ``get`` with :class:`~.codec.EntryLimits`) what the requesting model can
need; an entry failing that is quarantined unread, so a sparse file declaring terabytes costs nothing. A
file whose allocated blocks hold less than half its length (mostly holes, which the store never writes) is
verified in bounded chunks before its data is allocated, so what a read allocates before verification is
never more than twice the bytes the file really holds; metadata is bounded by the header check and
:func:`~.codec.parse_meta` (:data:`~.codec.MAX_META_BYTES`, :data:`~.codec.MAX_META_VALUES`).

No path inside the store is followed through a symbolic link: the deployment directory, ``.gone`` and
``.quarantine`` are checked with ``lstat`` when the store opens (a link is refused with an error naming the
fix), and the deployment directory is opened once then (``O_NOFOLLOW | O_DIRECTORY``): every later file
operation (entries written, swapped, read, stamped, removed, quarantined; tombstones; the lock) is relative
to that descriptor, so a directory swapped for a link (or another directory) after the store checked it is
never written or read through; the swap itself is refused at the next ``put`` or ``get`` (the name no longer
leads to the directory the store opened: reopen the store). Pruning removes only names the store writes.

``put`` writes the new entry to a temporary file, fsyncs it, and swaps it into place with one
``rename(2)`` (which drops the old copy in the same atomic step), then fsyncs the directory: at every
instant the old complete entry or the new complete entry is published, never neither, and a reader
holding the old file keeps reading a consistent copy. A crash before the swap leaves a temporary file
that recovery on open rolls back (removes) while the old entry stays; a crash after it leaves the new
entry. Recovery runs under an exclusive lock on ``.lock`` (taken only when no put of any process is in
flight; otherwise only temporaries older than ``STALE_TMP_S`` are removed); it also migrates entries of
the previous layout (``<digest>/meta.json`` + ``data.bin``), finishing a replace of that layout that a
crash interrupted between its two renames (the renamed-aside old copy is restored).

Recency survives a restart through the entry file's mtime (stamped on every ``put`` and ``get``). The
budget is enforced per store instance over the entries it knows (those present and verified when it
opened, those it wrote, and those of other processes it has read), with sizes derived from verified
metadata only.

Knows the codec and the file system; nothing about engines or Redis.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import struct
import time
import uuid
import weakref
from pathlib import Path
from typing import Iterator

import xxhash

from ...core.checkpoint import Checkpoint, CorruptCheckpoint
from .base import DECODE_ERRORS, CheckpointMissing, KVStore, StoreUnavailable
from .codec import (MAX_META_BYTES, CheckpointKey, ForeignCheckpoint, check_meta, decode_checkpoint, entry_nbytes,
                    parse_meta)
from .files import NOFOLLOW as _NOFOLLOW
from .files import LinkedDirectory, NotRegular, read_small_text
from .files import ensure_dir as _ensure_dir
from .files import ident as _ident
from .files import lexists as _lexists
from .files import open_dir as _open_dir
from .files import open_regular as _open_regular
from .files import read_fd as _read_fd

log = logging.getLogger(__name__)

STALE_TMP_S = 600.0
MAGIC = b"PKVKV\x001\n"
HEADER = struct.Struct("<8sQQ")  # magic, metadata length, xxh3-64 of the metadata bytes
SUFFIX = ".kv"
KEEP_QUARANTINED = 16
_DIGEST = re.compile(r"[0-9a-f]{32}")
_QUARANTINED = re.compile(r"[0-9a-f]{32}-[0-9]{1,24}\.kv")  # what _quarantine_file names (the only names pruned)
_TMP = re.compile(r"\.tmp-[0-9a-f]{32}-[0-9A-Za-z]{1,64}(?:\.kv|-old)?")  # put / previous-layout temporaries
SPECIAL_DIRS = (".gone", ".quarantine")


def _dir_name(deployment: str) -> str:
    """A file-safe directory name, unique per deployment (the hash tells apart names that sanitize alike)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", deployment)[:64]
    return f"{safe}-{hashlib.blake2b(deployment.encode(), digest_size=4).hexdigest()}"


def _read_exact(fd: int, n: int, offset: int) -> bytearray:
    """``n`` bytes at ``offset`` into one preallocated buffer (no second copy); CorruptCheckpoint if short."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = os.preadv(fd, [view[got:got + (1 << 26)]], offset + got)
        if k <= 0:
            raise CorruptCheckpoint(f"entry file ended after {got} of its {n} data bytes (truncated)")
        got += k
    return buf


def _verified_chunks(fd: int, specs: list, offset: int = 0) -> Iterator[bytes]:
    """The blobs of a data file in bounded chunks (16 MiB at most), each blob's xxh3 checked at its end.

    Args:
        fd: the open file.
        specs: the verified blob table (the blobs lie back to back in its order).
        offset: where the first blob starts.

    Returns:
        An iterator of the chunks.

    Raises:
        CorruptCheckpoint: the data ends early or a blob fails its checksum.
    """
    off = offset
    for spec in specs:
        h, left = xxhash.xxh3_64(), spec["nbytes"]
        while left:
            b = os.pread(fd, min(left, 1 << 24), off)
            if not b:
                raise CorruptCheckpoint(f"data ended inside blob {spec['name']} (truncated)")
            h.update(b)
            off += len(b)
            left -= len(b)
            yield b
        if h.hexdigest() != spec["xxh3"]:
            raise CorruptCheckpoint(f"blob {spec['name']} failed its checksum")


def _parse_header(head: bytes, size: int) -> tuple[int, int]:
    """(metadata length, metadata xxh3) from an entry's header; CorruptCheckpoint when it is damaged."""
    if len(head) < HEADER.size:
        raise CorruptCheckpoint(f"entry file has {len(head)} bytes, shorter than its header (truncated)")
    magic, meta_len, meta_xxh = HEADER.unpack(head[:HEADER.size])
    if magic != MAGIC:
        raise CorruptCheckpoint("entry file does not start with the entry magic (damaged header)")
    if meta_len > min(MAX_META_BYTES, size - HEADER.size):
        raise CorruptCheckpoint(f"entry header gives a metadata length of {meta_len} bytes (damaged header)")
    return meta_len, meta_xxh


def _read_meta(fd: int, size: int) -> tuple[dict, int]:
    """The verified-checksum metadata dict of an open entry file and the offset of its data."""
    meta_len, meta_xxh = _parse_header(_read_fd(fd, HEADER.size), size)
    raw = _read_fd(fd, meta_len, HEADER.size)
    if len(raw) != meta_len or xxhash.xxh3_64_intdigest(raw) != meta_xxh:
        raise CorruptCheckpoint("entry metadata failed its header checksum (damaged bytes)")
    return parse_meta(raw, "entry metadata"), HEADER.size + meta_len


class DiskStore(KVStore):
    """Checkpoints as files under ``root``.

    Args:
        root: the directory (created if missing); several processes may share it.
        deployment: the namespace (a subdirectory).
        budget_bytes: blob bytes held at most (None: unbounded).
        fsync: fsync files and directories on publish (off only for throwaway stores).

    Raises:
        StoreUnavailable: ``root`` cannot be created or listed, or the deployment directory, ``.gone`` or
            ``.quarantine`` is a symbolic link or not a directory (the message names the path and the fix).
    """

    tier = "disk"

    def __init__(self, root: str | os.PathLike, *, deployment: str = "default", budget_bytes: int | None = None,
                 fsync: bool = True):
        super().__init__(deployment=deployment, budget_bytes=budget_bytes)
        self.root = Path(root)
        self.dir = self.root / _dir_name(self.deployment)
        self.fsync = fsync
        self._clock = 0  # last recency stamp (ns)
        self.recovered: dict[str, int] = {"tmp_removed": 0, "legacy_migrated": 0, "legacy_restored": 0}
        self._dfd: int | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)  # root itself may be a link: the caller chose it
            _ensure_dir(self.dir)
            self._dfd = _open_dir(self.dir)  # every later operation is relative to this descriptor
            self._finalizer = weakref.finalize(self, os.close, self._dfd)
            st = os.fstat(self._dfd)
            self._dir_id = (st.st_dev, st.st_ino)
            for sub in SPECIAL_DIRS:
                _ensure_dir(self.dir / sub, dir_fd=self._dfd)
            self._recover()
            self._scan()
        except LinkedDirectory as e:
            self.close()
            raise StoreUnavailable(f"disk store at {self.dir} cannot be opened: {e}") from None
        except OSError as e:
            self.close()
            raise StoreUnavailable(f"disk store at {self.dir} cannot be opened: {e}") from e

    def close(self) -> None:
        """Close the store's directory descriptor (the entries stay; a closed store refuses every call)."""
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()  # closes the descriptor once
        self._dfd = None

    def _d(self) -> int:
        """The store directory's descriptor, after checking that its name still leads to it.

        Raises:
            StoreUnavailable: the store is closed, or its directory was replaced (by a link or another
                directory) since it opened.
        """
        if self._dfd is None:
            raise StoreUnavailable(f"disk store at {self.dir} is closed; open a new DiskStore")
        try:
            now = _ident(self.dir)
        except OSError:
            now = None
        if now != self._dir_id:
            raise StoreUnavailable(f"disk store at {self.dir}: the directory was replaced (removed, or swapped for "
                                   "a link or another directory) since the store opened it; nothing is read or "
                                   "written through the new one: check the path and open a new DiskStore")
        return self._dfd

    @staticmethod
    def _name(key: CheckpointKey) -> str:
        return f"{key.digest}{SUFFIX}"

    def path_of(self, key: CheckpointKey) -> Path:
        """The entry file of ``key`` (for inspection and fault-injection tests)."""
        return self.dir / f"{key.digest}{SUFFIX}"

    def data_offset(self, key: CheckpointKey) -> int:
        """Byte offset of the first blob in ``key``'s entry file (for fault-injection tests).

        Raises:
            CorruptCheckpoint: the header is damaged.
        """
        with _open_regular(self._name(key), self._d()) as (fd, st):
            return HEADER.size + _parse_header(_read_fd(fd, HEADER.size), st.st_size)[0]

    # ------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def _dir_lock(self, exclusive: bool = False, blocking: bool = True) -> Iterator[bool]:
        """Hold ``.lock``: shared by every put of every process, exclusive for recovery; yields whether held."""
        fd = os.open(".lock", os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK, 0o600, dir_fd=self._dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegular(f"{self.dir / '.lock'} is not a regular file; remove it")
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    @contextlib.contextmanager
    def _subdir(self, name: str) -> Iterator[int]:
        """A descriptor of the special directory ``name`` (``.gone``, ``.quarantine``), opened relative to
        the store's directory without following a link at either step (LinkedDirectory otherwise)."""
        if self._dfd is None:
            raise StoreUnavailable(f"disk store at {self.dir} is closed; open a new DiskStore")
        sfd = _open_dir(name, dir_fd=self._dfd)  # relative to the directory the store opened, whatever its name
        try:
            yield sfd
        finally:
            os.close(sfd)

    # ------------------------------------------------------------------ restart

    def _recover(self) -> None:
        """Roll back interrupted puts and migrate (or restore) entries of the previous layout."""
        with self._dir_lock(exclusive=True, blocking=False) as alone:
            now = time.time()
            for e in list(os.scandir(self._dfd)):
                if not _TMP.fullmatch(e.name):
                    continue  # only the temporaries the store itself names
                try:
                    old = now - e.stat(follow_symlinks=False).st_mtime > STALE_TMP_S
                except OSError:
                    continue
                if e.name.endswith("-old") and e.is_dir(follow_symlinks=False):
                    if alone:  # a replace of the previous layout interrupted between its two renames
                        self._migrate_legacy(e.name, e.name[5:37], restored=True)
                    continue
                if alone or old:  # never published; with the exclusive lock no put of any process is running
                    self._rm(e.name)
                    self.recovered["tmp_removed"] += 1
            if alone:
                for e in list(os.scandir(self._dfd)):
                    if _DIGEST.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
                        self._migrate_legacy(e.name, e.name)

    def _rm(self, name: str) -> None:
        """Remove ``name`` in the store's directory (a directory tree fd-relative, never through a link)."""
        try:
            if stat.S_ISDIR(os.lstat(name, dir_fd=self._dfd).st_mode):
                shutil.rmtree(name, dir_fd=self._dfd, ignore_errors=True)
            else:
                os.unlink(name, dir_fd=self._dfd)
        except OSError:
            pass

    def _migrate_legacy(self, src: str, digest: str, restored: bool = False) -> None:
        """An entry of the previous layout (a directory of meta.json + data.bin) -> an entry file.

        The data is checked against its verified size (within the budget and this host's memory) before a
        byte of it is read, then streamed (never held whole) with every blob's checksum verified before the
        entry is published; a directory that fails any of this is removed with a warning and never breaks
        opening the store.
        """
        final = f"{digest}{SUFFIX}"
        sfd = None
        try:
            if not _lexists(final, self._dfd) and _DIGEST.fullmatch(digest):
                sfd = _open_dir(src, dir_fd=self._dfd)
                with _open_regular("meta.json", sfd) as (fd, st):
                    raw_meta = _read_fd(fd, min(st.st_size, MAX_META_BYTES + 1))
                meta = parse_meta(raw_meta, "legacy metadata")
                stored = check_meta(meta, None)
                n = entry_nbytes(meta)
                over = self._oversize(n)
                if stored.digest != digest or over:
                    raise CorruptCheckpoint(f"legacy entry {over or 'does not match its name'}")
                with _open_regular("data.bin", sfd) as (fd, st):
                    if st.st_size != n:
                        raise CorruptCheckpoint(f"legacy data.bin has {st.st_size} bytes, its metadata makes {n}")
                    if st.st_blocks * 512 < st.st_size // 2:  # the previous layout wrote its data densely
                        raise CorruptCheckpoint(f"legacy data.bin declares {n} bytes but holds mostly holes "
                                                f"({st.st_blocks * 512} bytes allocated): not written by this store")
                    self._publish(final, raw_meta, _verified_chunks(fd, meta["blobs"]), recovering=True)
                self.recovered["legacy_restored" if restored else "legacy_migrated"] += 1
        except (OSError, MemoryError, CorruptCheckpoint, *DECODE_ERRORS) as e:
            log.warning("disk store %s: legacy entry %s not migrated (removed): %s", self.dir, src,
                        str(e)[:200] or type(e).__name__)
        finally:
            if sfd is not None:
                os.close(sfd)
        self._rm(src)

    def _scan(self) -> None:
        found = []
        for e in os.scandir(self._dfd):
            name = e.name
            if name.startswith(".") or not name.endswith(SUFFIX) or not _DIGEST.fullmatch(name[:-len(SUFFIX)]):
                continue
            if not e.is_file(follow_symlinks=False):
                continue  # a FIFO, directory or link in place of an entry: never opened
            entry = self._load_index_entry(name, name[:-len(SUFFIX)])
            if entry is not None:
                found.append(entry)
        for mtime, key, n in sorted(found, key=lambda e: e[0]):
            self._lru[key] = n

    def _load_index_entry(self, name: str, digest: str, quarantine: bool = True):
        """(mtime, key, verified size) of the entry file ``name``, or None (absent, unreadable, or damaged:
        quarantined when ``quarantine``, else returned as ``(0, None, 0)``)."""
        p = Path(name)
        try:
            with _open_regular(name, self._dfd) as (fd, st):
                meta, data_off = _read_meta(fd, st.st_size)
                key = check_meta(meta, None)
                n = entry_nbytes(meta)
                if key.digest != digest or key.deployment != self.deployment:
                    raise ForeignCheckpoint(f"entry file {p.name} holds {key.describe()} (another key)")
                if st.st_size != data_off + n:
                    raise CorruptCheckpoint(f"entry file {p.name} has {st.st_size} bytes, its metadata makes "
                                            f"{data_off + n} (truncated or wrong length)")
                over = self._oversize(n)
                if over:  # never indexed at its declared size: it would evict every valid entry
                    raise CorruptCheckpoint(f"entry file {p.name} {over}")
                return st.st_mtime_ns, key, n
        except FileNotFoundError:
            return None
        except (OSError, CorruptCheckpoint, *DECODE_ERRORS) as e:
            if isinstance(e, OSError) and not isinstance(e, NotRegular):
                return None  # unreadable now (permissions, I/O): a get reports it
            if not quarantine:
                return 0, None, 0
            self._quarantine_file(p, digest, str(e), found_by_scan=True)
            return None

    def _index_get(self, key: CheckpointKey) -> int | None:
        n = super()._index_get(key)
        if n is None and _lexists(self._name(key), self._d()):  # written by another process
            entry = self._load_index_entry(self._name(key), key.digest, quarantine=False)
            if entry is not None:
                # a damaged or foreign file is indexed at size 0: get() reads it, says what is wrong and
                # quarantines it
                n = entry[2] if entry[1] == key else 0
                self._index_put(key, n)
        return n

    # ------------------------------------------------------------------ hooks

    def _write(self, key, meta, blobs, ckpt) -> None:
        raw_meta = json.dumps(meta).encode()
        self._d()  # the directory the store opened, still under its name
        try:
            self._publish(self._name(key), raw_meta, [memoryview(blobs[s["name"]]) for s in meta["blobs"]])
            self._stamp(self._name(key))
        except OSError as e:
            raise StoreUnavailable(f"disk store at {self.dir} cannot write {key.describe()}: {e}") from e

    def _publish(self, final: str, raw_meta: bytes, chunks, *, recovering: bool = False) -> None:
        """Write new, fsync, swap atomically (the old copy is dropped in the same rename), fsync the directory;
        every step relative to the store's directory descriptor (``final``: the entry's file name).

        ``recovering``: called by recovery, which already holds the exclusive lock.
        """
        dfd = self._dfd
        tmp = f".tmp-{final[:32]}-{uuid.uuid4().hex}{SUFFIX}"
        with contextlib.nullcontext(True) if recovering else self._dir_lock():
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=dfd)
                try:
                    with os.fdopen(fd, "wb", closefd=False) as f:
                        f.write(HEADER.pack(MAGIC, len(raw_meta), xxhash.xxh3_64_intdigest(raw_meta)))
                        f.write(raw_meta)
                        for c in chunks:
                            f.write(c)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                self._swap((dfd, tmp), (dfd, final))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
        if self.fsync:
            os.fsync(dfd)

    @staticmethod
    def _swap(tmp: tuple[int, str], final: tuple[int, str]) -> None:
        """``rename(2)`` of ``(dir_fd, name)`` onto ``(dir_fd, name)``: the atomic step (a seam for crash tests)."""
        os.replace(tmp[1], final[1], src_dir_fd=tmp[0], dst_dir_fd=final[0])

    def _stamp(self, name: str) -> None:
        # explicit nanosecond stamps: the kernel's own mtimes are jiffy-coarse and would tie
        self._clock = max(time.time_ns(), self._clock + 1)
        with contextlib.suppress(OSError):
            os.utime(name, ns=(self._clock, self._clock), dir_fd=self._dfd, follow_symlinks=False)

    def _read(self, key) -> Checkpoint:
        p, dfd = self._name(key), self._d()
        self._suspect = None
        try:
            self._suspect = (key.digest, *_ident(p, dfd))
        except OSError:
            pass
        try:
            with _open_regular(p, dfd) as (fd, st):
                self._suspect = (key.digest, st.st_dev, st.st_ino)  # the file whose bytes are judged
                meta, data_off = _read_meta(fd, st.st_size)
                check_meta(meta, key)  # before the blob table is trusted
                n = self._admit(meta, key)  # the model's shape, the budget, this host: before any allocation
                if st.st_size != data_off + n:
                    raise CorruptCheckpoint(f"entry file of {key.describe()} has {st.st_size} bytes, expected "
                                            f"{data_off + n} (truncated or wrong length)")
                if n and st.st_blocks * 512 < n // 2:  # mostly holes: verified in bounded chunks before allocating
                    for _ in _verified_chunks(fd, meta["blobs"], data_off):
                        pass
                data = _read_exact(fd, n, data_off)
        except FileNotFoundError:
            self._index_pop(key)
            raise CheckpointMissing(key, self._tomb_get(key) or f"checkpoint of {key.describe()} was removed "
                                    "from the disk store (evicted or replaced by another process)") from None
        except NotRegular as e:
            raise CorruptCheckpoint(f"entry of {key.describe()}: {e}") from None
        except OSError as e:
            raise StoreUnavailable(f"disk store at {self.dir} cannot read {key.describe()}: {e}") from e
        self._stamp(p)  # recency survives a restart
        view, blobs, off = memoryview(data), {}, 0
        for spec in meta["blobs"]:
            blobs[spec["name"]] = view[off:off + spec["nbytes"]]
            off += spec["nbytes"]
        return decode_checkpoint(meta, blobs, key)

    def _remove(self, key) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._name(key), dir_fd=self._d())  # atomic unpublish; a reader keeps its copy

    def _quarantine(self, key, reason: str) -> bool:
        p = Path(self._name(key))
        suspect, self._suspect = getattr(self, "_suspect", None), None
        try:
            now = _ident(p.name, self._d())
        except OSError:
            return True  # already gone
        if suspect is not None and suspect[0] == key.digest and suspect[1:] != now:
            return False  # replaced by another writer since it was read: the new entry is not the damaged one
        self._quarantine_file(p, key.digest, reason)
        return True

    def _quarantine_file(self, p: Path, digest: str, reason: str, found_by_scan: bool = False) -> None:
        """Move a damaged entry aside (the newest ``KEEP_QUARANTINED`` are kept for inspection).

        Works relative to the store's own directory descriptors: the entry is renamed into ``.quarantine``
        opened without following a link (when that fails, e.g. ``.quarantine`` became a link, the entry is
        removed instead), and only names this method writes, of regular files, are pruned there.

        ``found_by_scan``: found on open or by an index lookup, not by ``get`` (which counts and records its own).
        """
        dfd = self._dfd
        if dfd is None:
            return
        try:
            qfd = _open_dir(".quarantine", dir_fd=dfd)
        except OSError as e:  # a link (refused), or missing: the entry is removed instead of moved
            qfd = None
            log.warning("disk store %s: .quarantine unusable (%s); removing %s instead of moving it aside",
                        self.dir, e, p.name)
        try:
            if qfd is None:
                raise OSError(errno.ENOENT, "no usable .quarantine")
            os.rename(p.name, f"{digest}-{time.time_ns()}{SUFFIX}", src_dir_fd=dfd, dst_dir_fd=qfd)
            self._prune_quarantine(qfd)
        except OSError:
            try:
                st = os.lstat(p.name, dir_fd=dfd)
            except FileNotFoundError:
                if qfd is not None:
                    return  # already gone (another process took it out)
                st = None
            with contextlib.suppress(OSError):
                if st is not None and stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(p.name, dir_fd=dfd)
                elif st is not None:
                    os.unlink(p.name, dir_fd=dfd)
        finally:
            if qfd is not None:
                os.close(qfd)
        log.warning("disk store %s: quarantined %s: %s", self.dir, p.name, (reason.splitlines() or [""])[0][:300])
        if found_by_scan:
            self.stats.quarantined += 1
            for k in [k for k in self._lru if k.digest == digest]:
                self._lru.pop(k, None)
            self._tomb_put_digest(digest, f"entry {p.name} was quarantined as corrupt ({reason[:300]})")

    @staticmethod
    def _prune_quarantine(qfd: int) -> None:
        """Remove all but the newest ``KEEP_QUARANTINED`` quarantined entries: only names the store writes
        there (``<digest>-<ns>.kv``), never a link; anything else in the directory is left alone."""
        mine = []
        for name in os.listdir(qfd):
            if _QUARANTINED.fullmatch(name):
                with contextlib.suppress(OSError):
                    mode = os.lstat(name, dir_fd=qfd).st_mode
                    if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISFIFO(mode):  # what was moved here
                        mine.append((int(name[33:-len(SUFFIX)]), name, stat.S_ISDIR(mode)))
        mine.sort()
        for _, name, is_dir in mine[:-KEEP_QUARANTINED]:
            with contextlib.suppress(OSError):
                if is_dir:
                    shutil.rmtree(name, dir_fd=qfd)  # fd-based: never follows a link inside it
                else:
                    os.unlink(name, dir_fd=qfd)

    # tombstones persist so another process (or a restart) can say why a key is gone

    def _tomb_put(self, key, reason: str) -> None:
        super()._tomb_put(key, reason)
        self._tomb_put_digest(key.digest, reason)

    def _tomb_put_digest(self, digest: str, reason: str) -> None:
        """Write ``.gone/<digest>`` through the directory's descriptor (never through a link)."""
        tmp = f".{digest}-{uuid.uuid4().hex}"
        try:
            with self._subdir(".gone") as gfd:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=gfd)
                try:
                    data = memoryview(reason.encode("utf-8", "replace"))
                    while data:
                        data = data[os.write(fd, data):]
                finally:
                    os.close(fd)
                try:
                    os.replace(tmp, digest, src_dir_fd=gfd, dst_dir_fd=gfd)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=gfd)
                    raise
        except LinkedDirectory as e:
            log.warning("disk store %s: tombstone of %s not written: %s", self.dir, digest, e)
        except OSError:
            pass

    def _tomb_get(self, key) -> str | None:
        reason = super()._tomb_get(key)
        if reason is None:
            try:
                with self._subdir(".gone") as gfd:
                    reason = read_small_text(key.digest, dir_fd=gfd) or None
            except OSError:
                reason = None
        return reason

    def _tomb_pop(self, key) -> None:
        super()._tomb_pop(key)
        try:
            with self._subdir(".gone") as gfd:
                os.unlink(key.digest, dir_fd=gfd)
        except OSError:
            pass
