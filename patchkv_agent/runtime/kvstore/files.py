"""File-system primitives of the disk tier that never follow a symbolic link and never block on a FIFO:
directories opened with ``O_NOFOLLOW | O_DIRECTORY``, regular files opened with ``O_NOFOLLOW | O_NONBLOCK``
and checked with ``fstat``, every call relative to a directory descriptor when one is given.

Boundary: ``os`` calls only; nothing about entries, codecs or budgets (:mod:`.disk` builds the store on these).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Iterator

__all__ = ["NOFOLLOW", "OPEN_FLAGS", "DIR_FLAGS", "NotRegular", "LinkedDirectory", "refuse_link", "ensure_dir",
           "open_dir", "open_regular", "lexists", "ident", "read_fd", "read_small_text"]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
OPEN_FLAGS = os.O_RDONLY | NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW


class NotRegular(OSError):
    """A path that should be a regular file is something else (FIFO, directory, device, symlink)."""


class LinkedDirectory(OSError):
    """A directory of the store is a symbolic link (or not a directory): refused, never followed."""


def refuse_link(path: Path) -> LinkedDirectory:
    try:
        target = f" (to {os.readlink(path)!r})"
    except OSError:
        target = ""
    return LinkedDirectory(f"{path} is a symbolic link{target}; a disk store never follows links inside its "
                           f"directory: remove the link (rm {path}) and reopen the store (to keep the store "
                           "elsewhere, pass that location as root)")


def ensure_dir(path: Path, dir_fd: int | None = None) -> None:
    """Create ``path`` (relative to ``dir_fd`` when given: its name) if missing; refuse it when it is a
    symbolic link or not a directory."""
    name = path.name if dir_fd is not None else path
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, dir_fd=dir_fd)
    st = os.lstat(name, dir_fd=dir_fd)
    if stat.S_ISLNK(st.st_mode):
        raise refuse_link(path)
    if not stat.S_ISDIR(st.st_mode):
        raise LinkedDirectory(f"{path} is not a directory; remove it (rm {path}) and reopen the store")


def open_dir(name: str | os.PathLike, dir_fd: int | None = None) -> int:
    """A descriptor of a directory opened without following a symbolic link (LinkedDirectory if it is one)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LinkedDirectory(f"{name} is a symbolic link or not a directory (refused)") from None
        raise


@contextlib.contextmanager
def open_regular(path: Path | str, dir_fd: int | None = None) -> Iterator[tuple[int, os.stat_result]]:
    """Open ``path`` (relative to ``dir_fd`` when given) for reading without following a symlink or blocking
    on a FIFO; refuse non-regular files."""
    try:
        fd = os.open(path, OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink in place of the file
            raise NotRegular(f"{path} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{path} is not a regular file")
        yield fd, st
    finally:
        os.close(fd)


def lexists(name: str, dir_fd: int) -> bool:
    """Whether ``name`` exists in the directory ``dir_fd`` (a link counts; it is never followed)."""
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def ident(path: Path | str, dir_fd: int | None = None) -> tuple[int, int]:
    """(device, inode) of ``path`` itself (relative to ``dir_fd`` when given; not following a link)."""
    st = os.lstat(path, dir_fd=dir_fd)
    return st.st_dev, st.st_ino


def read_fd(fd: int, n: int, offset: int = 0) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = os.pread(fd, min(n - got, 1 << 26), offset + got)
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_small_text(path: Path | str, limit: int = 4096, *, dir_fd: int | None = None) -> str | None:
    """A short regular file's text (undecodable bytes replaced), or None when absent, not regular or unreadable.

    Args:
        path: the file (relative to ``dir_fd`` when given); a link is never followed.
        limit: bytes read at most.
        dir_fd: a directory descriptor ``path`` is relative to (None: the working directory).
    """
    try:
        with open_regular(path, dir_fd) as (fd, _):
            return read_fd(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
