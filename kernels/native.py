"""The native CPU kernels: ``native.c`` compiled on first use and called through ctypes.

The torch references of ``dequantize_scatter`` and ``quantize_gather`` make several elementwise
passes over each piece of a run; ``native.c`` decodes, rotates and stores each row in one pass
(``pkv_restore``) and computes scales and codes block by block (``pkv_quantize``), bit-identical
to the references (``tests/test_native.py`` checks this over the odd shapes). It needs a C compiler
(``cc``, or ``$CC``) at first use.

Trust: the library is built into, and loaded only from, a *private* directory (``native-private/`` under
``$PATCHKV_CACHE_DIR``, default ``$XDG_CACHE_HOME/patchkv-agent``): created with mode 0700, and refused
unless it is a real directory (not a symlink) owned by this user with no access for group or others.
Each build is published as ``patchkv_restore_<key>-<sha>.so`` (the key hashes the source, flags,
compiler and CPU) with a record ``patchkv_restore_<key>.json`` naming the file and the SHA-256 of the
bytes the compiler produced (both published atomically, so concurrent processes can build at once).
:func:`load` opens the file without following links, checks it is a regular file owned by this user and
not writable by others, hashes the open file and loads exactly that file (through ``/proc/self/fd``)
only when the hash equals the record's. A planted or modified file, a file without a record, or a
directory with the wrong owner or permissions is refused (:class:`UntrustedLibrary`): the dispatcher
then uses the torch reference and :func:`status` says why. Without a compiler, or with
``PATCHKV_NATIVE=0``, :func:`available` is False likewise.

Arguments: every size and stride is checked twice. The wrappers raise ``ValueError`` for what the C jobs
cannot hold or describe (fp32 destinations and unit inner strides only, heads, head_dim, block size and
value group as int32 below 2^31: ctypes would wrap 2^32 + 1 to 1), and ``native.c`` checks every buffer
against the element counts it is handed (sources and destinations to the end of their storage, every output
of a quantize job, products in int64 with overflow checks) and returns an error code instead of touching
memory outside them (:data:`ERRORS`).

``pkv_reader_scan`` (:func:`reader_scan_native`) is the planner's one pass over the context: the lexical
reader signal's occurrence scan, equal to its numpy twin in ``core/plan.py``, which runs where the library is
unavailable.

Knows tensors, payloads and int64 arrays, nothing about models or checkpoints. CPU only: CUDA runs Triton.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .formats import (
    FP16,
    K4V4,
    K8V4,
    K8V8,
    K_BITS,
    V_BITS,
    RunPayload,
    check_destination,
    check_payload,
    check_quantize_args,
    check_scatter_args,
    effective_v_group,
)
from .torch_restore import _angle_tables

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math"]
MAX_HEAD_DIM = 1024

_TAGS = {FP16: 0, K8V8: 1, K8V4: 2, K4V4: 3}  # native.c's TAG_* codes
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class _Job(ctypes.Structure):
    _fields_ = [
        ("tag", ctypes.c_int32), ("src_dtype", ctypes.c_int32), ("H", ctypes.c_int32), ("D", ctypes.c_int32),
        ("block_size", ctypes.c_int32), ("v_group", ctypes.c_int32), ("rot", ctypes.c_int32),
        ("interleaved", ctypes.c_int32), ("R", ctypes.c_int64), ("M", ctypes.c_int64),
        ("k_data", ctypes.c_void_p), ("v_data", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p), ("k_zero", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p), ("v_zero", ctypes.c_void_p),
        ("src_rows", ctypes.c_void_p), ("dst_rows", ctypes.c_void_p), ("angle_idx", ctypes.c_void_p),
        ("ctab", ctypes.c_void_p), ("stab", ctypes.c_void_p),
        ("dst_k", ctypes.c_void_p), ("dst_v", ctypes.c_void_p),
        ("dk_sh", ctypes.c_int64), ("dk_sr", ctypes.c_int64), ("dv_sh", ctypes.c_int64), ("dv_sr", ctypes.c_int64),
        ("n_dst", ctypes.c_int64), ("n_angles", ctypes.c_int64), ("n_k_data", ctypes.c_int64),
        ("n_v_data", ctypes.c_int64), ("n_k_scale", ctypes.c_int64), ("n_k_zero", ctypes.c_int64),
        ("n_v_scale", ctypes.c_int64), ("n_v_zero", ctypes.c_int64),
        ("n_dst_k", ctypes.c_int64), ("n_dst_v", ctypes.c_int64),
    ]


class _QJob(ctypes.Structure):
    _fields_ = [
        ("tag", ctypes.c_int32), ("src_dtype", ctypes.c_int32), ("H", ctypes.c_int32), ("D", ctypes.c_int32),
        ("block_size", ctypes.c_int32), ("v_group", ctypes.c_int32), ("R", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("k_sh", ctypes.c_int64), ("k_sn", ctypes.c_int64), ("v_sh", ctypes.c_int64), ("v_sn", ctypes.c_int64),
        ("rows", ctypes.c_void_p), ("k_data", ctypes.c_void_p), ("v_data", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p), ("k_zero", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
        ("v_zero", ctypes.c_void_p), ("N", ctypes.c_int64),
        ("n_k", ctypes.c_int64), ("n_v", ctypes.c_int64),
        ("n_k_data", ctypes.c_int64), ("n_v_data", ctypes.c_int64), ("n_k_scale", ctypes.c_int64),
        ("n_k_zero", ctypes.c_int64), ("n_v_scale", ctypes.c_int64), ("n_v_zero", ctypes.c_int64),
    ]


# native.c's PKV_E_* codes: the library checks its own arguments (defence in depth behind the Python checks)
ERRORS = {
    -2: "unknown tag or source dtype",
    -3: "heads, head_dim (1..1024, even for 4-bit codes), rotated channels or strides out of range",
    -4: "block size or value group < 1",
    -5: "a buffer is smaller than the job's shape needs",
    -6: "a source row outside the payload (or the source)",
    -7: "a destination row outside the destination",
    -8: "an angle index outside the cos/sin tables",
    -9: "a buffer the job needs is missing",
    -10: "changed words not strictly increasing, or suffix blocks not increasing non-empty runs in the context",
}


def error_text(rc: int) -> str | None:
    """What a negative return code of a ``native.c`` entry point means (None: not an argument error)."""
    return ERRORS.get(int(rc))


INT32_MAX = (1 << 31) - 1  # the C jobs hold heads, head_dim, block size and value group as int32
_UNIT = {0: 4, 1: 2, 2: 2}  # bytes per element native.c reads of a raw (FP16-tag) run, by src_dtype code


def extent(t: torch.Tensor | None, unit: int | None = None) -> int:
    """Elements of ``unit`` bytes (default: ``t``'s own) from ``t.data_ptr()`` to the end of its storage:
    the most any index from that pointer may reach, whatever shape and strides ``t`` claims (0 for None)."""
    if t is None:
        return 0
    unit = unit or t.element_size()
    return max(0, t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()) // unit


_PAYLOAD_BUFFERS = ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero")


def _set_sizes(j: _Job, p: RunPayload, *, dst_rows: int, angles: int, dst_k: torch.Tensor | None = None,
               dst_v: torch.Tensor | None = None, buffers: dict | None = None) -> None:
    """Fill a restore job's buffer bounds from the tensors as they are (never from the payload's header):
    the payload's (or ``buffers``', the contiguous copies the job points at) in the units ``native.c`` reads
    them in, the fp32 destinations to the end of their storage (0 when not given: nothing may be written)."""
    j.n_dst, j.n_angles = dst_rows, angles
    raw = _UNIT.get(int(j.src_dtype), 4) if int(j.tag) == _TAGS[FP16] else None
    for name in _PAYLOAD_BUFFERS:
        t = (buffers or {}).get(name, getattr(p, name)) if buffers is not None else getattr(p, name)
        unit = (raw or 1) if name.endswith("data") else 2  # codes are bytes, scales and zeros fp16
        n = 0 if t is None or not t.is_contiguous() else t.numel() * t.element_size() // unit
        setattr(j, f"n_{name}", n)
    j.n_dst_k, j.n_dst_v = extent(dst_k, 4), extent(dst_v, 4)


def _int32(name: str, v, lo: int = 0) -> int:
    """``v`` as an int in ``[lo, 2^31)``, the range of the jobs' int32 fields (ctypes would wrap anything else)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= INT32_MAX:
        raise ValueError(f"{name} must be an int in [{lo}, 2^31), got {str(v)[:40]}")
    return int(v)


def _threads(n_threads: int | None) -> int:
    return min(64, max(1, int(n_threads or torch.get_num_threads())))


class _RJob(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_void_p), ("L", ctypes.c_int32), ("H", ctypes.c_int32), ("D", ctypes.c_int32),
                ("v_group", ctypes.c_int32), ("N", ctypes.c_int64), ("err", ctypes.c_void_p), ("ref", ctypes.c_void_p)]


def value_residual_sq_native(values: Sequence[torch.Tensor], group: int, n_threads: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual.value_residual_sq`` of the stacked layers in one native pass, without stacking them.

    Element errors and squares are the reference's fp32 operations (same scale, zero and codes); the sums
    over layers, heads and channels run in double, so they agree with the reference's fp32 sums to ~1e-7
    relative (``tests/test_host_path.py`` checks the residual and the precision tags it gives).

    Args:
        values: per layer ``[H, N, D]`` contiguous float32 CPU tensors of one shape.
        group: value group size (as in the K8V4 format).
        n_threads: worker threads (default ``torch.get_num_threads()``).

    Returns:
        ``(err_sq, ref_sq)``, float32 ``[N]`` each.

    Raises:
        RuntimeError: the library is unavailable (check :func:`available` first).
        ValueError: layers of other shapes, dtypes or devices, or not contiguous.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"native value residual {status()}")
    if not values:
        raise ValueError("values must hold at least one layer")
    shape = tuple(values[0].shape)
    for v in values:
        if (v.dim() != 3 or tuple(v.shape) != shape or v.dtype != torch.float32 or v.device.type != "cpu"
                or not v.is_contiguous()):
            raise ValueError("native value residual needs contiguous float32 CPU layers [H, N, D] of one shape")
    h, n, d = shape
    err, ref = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    ptrs = (ctypes.c_void_p * len(values))(*[v.data_ptr() for v in values])
    j = _RJob(layers=ctypes.cast(ptrs, ctypes.c_void_p), L=len(values), H=h, D=d,
              v_group=effective_v_group(d, group), N=n, err=err.data_ptr(), ref=ref.data_ptr())
    starts = (ctypes.c_int64 * 2)()
    rc = lib.pkv_value_residual(ctypes.byref(j), _threads(n_threads), starts)
    if rc < -1:
        raise ValueError(f"native value residual refused its arguments: {error_text(rc) or rc}")
    return err, ref


def _int64_vector(a: np.ndarray, name: str) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype != np.int64 or a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D int64 array, got {a.dtype} with shape {a.shape}")
    return a


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def reader_scan_native(words: np.ndarray, changed: np.ndarray, ctx_block: int, starts: np.ndarray,
                       ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lexical reader signal's occurrence scan in one native pass (``pkv_reader_scan``).

    The twin of ``patchkv_agent.core.readers._reader_scan_numpy``, which it equals (``tests/test_native.py``).

    Args:
        words: int64 ``[n]`` word id per position of the new context.
        changed: int64 ``[m]`` the changed words, strictly increasing.
        ctx_block: the block size the document frequency counts in (blocks cut from position 0), ``>= 1``.
        starts, ends: int64 ``[nb]`` the suffix blocks ``[starts[b], ends[b])``: non-empty, increasing,
            disjoint, within ``[0, n)``.

    Returns:
        ``(df, pair_blk, pair_tok)``: int64 ``[m]`` blocks holding each changed word's first tokens, and the
        distinct (suffix block, changed-word rank) pairs ordered by block, then rank.

    Raises:
        RuntimeError: the library is unavailable (check :func:`available` first).
        ValueError: arrays of another dtype or rank, or arguments the library refuses (the message says which).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"native reader scan {status()}")
    words, changed = _int64_vector(words, "words"), _int64_vector(changed, "changed")
    starts, ends = _int64_vector(starts, "starts"), _int64_vector(ends, "ends")
    if starts.shape != ends.shape:
        raise ValueError(f"starts and ends differ in length ({starts.shape[0]} != {ends.shape[0]})")
    n, m, nb = words.shape[0], changed.shape[0], starts.shape[0]
    out = np.empty(2 * n + 3 * m, dtype=np.int64)  # [pair_blk n | pair_tok n | df m | scratch 2m]: one pointer
    base = _ptr(out)
    count = ctypes.c_int64(0)
    rc = lib.pkv_reader_scan(_ptr(words), n, _ptr(changed), m, int(ctx_block), _ptr(starts), _ptr(ends), nb,
                             base + 16 * n, base, base + 8 * n, n, base + 16 * n + 8 * m, ctypes.byref(count))
    if rc != 0:
        raise ValueError(f"native reader scan refused its arguments: {error_text(rc) or rc}")
    k = count.value
    return out[2 * n:2 * n + m], out[:k], out[n:n + k]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # reason the library is unavailable (None: not tried yet or loaded)
_tried = False


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


class UntrustedLibrary(RuntimeError):
    """The native library or its directory failed a trust check (owner, permissions, link, hash)."""


def default_dir() -> Path:
    """``native-private/`` under ``$PATCHKV_CACHE_DIR`` (default ``$XDG_CACHE_HOME/patchkv-agent``)."""
    base = os.environ.get("PATCHKV_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "patchkv-agent"
    return Path(base) / "native-private"


def private_dir(path: Path, *, create: bool = True) -> Path:
    """Create ``path`` with mode 0700 (parents as needed) or check an existing one.

    Returns:
        The path.

    Raises:
        UntrustedLibrary: it is a symlink or not a directory, owned by another user, or open to group or
            others (the message names the fix).
    """
    path = Path(path)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UntrustedLibrary(f"{path} is not a directory (a link or a file): native library refused; remove it")
    if st.st_uid != os.getuid():
        raise UntrustedLibrary(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}): native "
                               "library refused; remove it or set PATCHKV_CACHE_DIR to a directory of your own")
    if st.st_mode & 0o077:
        raise UntrustedLibrary(f"{path} has mode {stat.S_IMODE(st.st_mode):o} (group or others have access): "
                               f"native library refused; chmod 700 {path} and delete the files in it")
    return path


def _record_path(lib: Path) -> Path:
    return lib.with_name(lib.name.rsplit("-", 1)[0] + ".json")


def _read_record(path: Path) -> dict | None:
    """The build record at ``path`` (a regular file of this user), or None when absent or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > 4096:
            return None
        rec = json.loads(os.read(fd, 4096))
        return rec if isinstance(rec, dict) and isinstance(rec.get("file"), str) and isinstance(rec.get("sha256"), str) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def build(out_dir: Path | None = None, extra_flags: Sequence[str] = (), *, native_arch: bool = True) -> Path:
    """Compile ``native.c`` into a shared library (or reuse the recorded build) and return its path.

    Args:
        out_dir: the private build folder (default :func:`default_dir`; created 0700, or checked).
        extra_flags: more compiler flags (the tests build a variant with ``-DPKV_NO_FLOAT16``).
        native_arch: add ``-march=native`` (retried without it if the compiler refuses).

    Returns:
        The path of the ``.so`` (pass it to :func:`load`, which verifies it against its build record).

    Raises:
        RuntimeError: no compiler, or compilation failed (the message carries the compiler's output).
        UntrustedLibrary: ``out_dir`` is not a private directory of this user.
    """
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH (install gcc, or set CC); the torch reference is used")
    out_dir = private_dir(Path(out_dir) if out_dir is not None else default_dir())
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    errors = []
    for arch in (["-march=native"], []) if native_arch else ([],):
        flags = [*FLAGS, *arch, *extra_flags]
        key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(),
                                         platform.machine().encode(), _cpu_id().encode()])).hexdigest()[:16]
        record = out_dir / f"patchkv_restore_{key}.json"
        rec = _read_record(record)
        if rec is not None and (out_dir / rec["file"]).name == rec["file"] and (out_dir / rec["file"]).exists():
            return out_dir / rec["file"]  # load() checks the bytes against the record
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        proc = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode == 0:
            os.chmod(tmp, 0o700)
            with open(tmp, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            target = out_dir / f"patchkv_restore_{key}-{digest[:16]}.so"
            os.replace(tmp, target)  # atomic; a concurrent builder publishes its own file
            fd, rtmp = tempfile.mkstemp(suffix=".json", dir=out_dir)
            with os.fdopen(fd, "w") as f:
                json.dump({"file": target.name, "sha256": digest, "flags": flags}, f)
            os.replace(rtmp, record)  # the record last: it only ever names a complete file
            return target
        os.unlink(tmp)
        errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-2000:]}")
    raise RuntimeError("compiling kernels/native.c failed:\n" + "\n".join(errors))


def load(path: Path) -> ctypes.CDLL:
    """Open a library built by :func:`build`, after checking it, and declare its entry points.

    The file must sit in a private directory (:func:`private_dir`), be a regular file (not a link) owned by
    this user and writable by nobody else, and hash to the SHA-256 its build record holds; the open file
    itself is what gets loaded, so it cannot be swapped between the check and the load.

    Raises:
        UntrustedLibrary: any check failed (the message names which and the fix).
        OSError: the library cannot be loaded.
    """
    path = Path(path)
    private_dir(path.parent, create=False)
    rec = _read_record(_record_path(path))
    if rec is None or rec["file"] != path.name:
        raise UntrustedLibrary(f"{path} has no build record of patchkv-agent (a planted or foreign file?): "
                               "native library refused; delete it to rebuild")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise UntrustedLibrary(f"{path} is not a regular file of this user writable only by it: native "
                                   "library refused; delete it to rebuild")
        h, off = hashlib.sha256(), 0
        while chunk := os.pread(fd, 1 << 20, off):
            h.update(chunk)
            off += len(chunk)
        if h.hexdigest() != rec["sha256"]:
            raise UntrustedLibrary(f"{path} does not match the SHA-256 recorded when it was built (modified or "
                                   "planted): native library refused; delete it to rebuild")
        via = f"/proc/self/fd/{fd}"
        lib = ctypes.CDLL(via if os.path.exists(via) else str(path))
    finally:
        os.close(fd)
    for name, job in (("pkv_restore", _Job), ("pkv_quantize", _QJob)):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.POINTER(job), ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
        fn.restype = ctypes.c_int
    lib.pkv_value_residual.argtypes = [ctypes.POINTER(_RJob), ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.pkv_value_residual.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pkv_reader_scan.argtypes = [p, i64, p, i64, i64, p, p, i64, p, p, p, i64, p, p]
    lib.pkv_reader_scan.restype = ctypes.c_int
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _why, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("PATCHKV_NATIVE", "1") == "0":
                _why = "disabled by PATCHKV_NATIVE=0"
            else:
                try:
                    _lib = load(build())
                except (RuntimeError, OSError) as exc:
                    _why = str(exc)
                    if isinstance(exc, UntrustedLibrary):
                        logging.getLogger(__name__).warning("native kernels: %s; using the torch reference", exc)
            _tried = True
    return _lib


def available() -> bool:
    """True when the native kernels are built (building them on first call) and not disabled."""
    return _library() is not None


def ready() -> bool:
    """True when the library is already loaded. Never builds, loads or waits: for callers on a latency path
    (the planner), which use their numpy twin until then."""
    return _lib is not None


def status() -> str:
    """``"native"`` when available, else why not (no compiler, disabled, build error, refused by a trust check)."""
    return "native" if available() else f"unavailable: {_why}"


@dataclass
class ScatterCall:
    """One ``dequantize_scatter`` call: ``payload`` rows ``src_rows`` (default: all, in order) to
    ``dst[:, dst_rows]`` with keys rotated by ``delta`` (see ``dispatch.dequantize_scatter``)."""

    payload: RunPayload
    dst_k: torch.Tensor
    dst_v: torch.Tensor
    dst_rows: torch.Tensor
    delta: torch.Tensor
    inv_freq: torch.Tensor | None
    interleaved: bool = False
    src_rows: torch.Tensor | None = None


def supports(call: ScatterCall) -> bool:
    """Whether the native path takes this call: CPU tensors, fp32 destinations with unit inner
    stride, head_dim <= 1024, a known tag and (raw runs) source dtype."""
    p, dk, dv = call.payload, call.dst_k, call.dst_v
    return (dk.device.type == "cpu" and p.k_data.device.type == "cpu"
            and dk.dtype == torch.float32 and dv.dtype == torch.float32
            and dk.stride(-1) == 1 and dv.stride(-1) == 1 and p.head_dim <= MAX_HEAD_DIM
            and (p.tag != FP16 or (p.k_data.dtype in _DTYPES and p.v_data.dtype == p.k_data.dtype)))


def _check_call(call: ScatterCall) -> None:
    """What :func:`supports` requires, as a ``ValueError`` naming the argument (a direct caller of
    :func:`scatter_native` gets an error, never a write of fp32 rows into a narrower buffer)."""
    p, dk, dv = call.payload, call.dst_k, call.dst_v
    for name, t in (("dst_k", dk), ("dst_v", dv)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != torch.float32:
            raise ValueError(f"native restore writes fp32 CPU destinations; {name} is "
                             f"{getattr(t, 'dtype', type(t).__name__)} on {getattr(t, 'device', '?')} "
                             "(use the torch backend for other destinations)")
        if t.dim() != 3 or t.stride(-1) != 1 or min(t.stride()) < 0:
            raise ValueError(f"native restore needs {name} [H, N, D] with unit inner stride, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")
    for name in ("k_data", "v_data"):
        t = getattr(p, name)
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise ValueError(f"native restore reads CPU payloads; {name} is on {t.device}")
    if p.tag == FP16 and (p.k_data.dtype not in _DTYPES or p.v_data.dtype != p.k_data.dtype):
        raise ValueError(f"native restore reads raw runs in fp32, fp16 or bf16, got {p.k_data.dtype}, {p.v_data.dtype}")
    for name in ("dst_rows", "delta", "src_rows", "inv_freq"):
        t = getattr(call, name)
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise ValueError(f"native restore needs {name} on the CPU, got {t.device}")
    _int32("payload heads", p.num_kv_heads, 1)
    _int32("payload head_dim", p.head_dim, 1)
    if p.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"native restore takes head_dim <= {MAX_HEAD_DIM}, got {p.head_dim}")


def _c(t: torch.Tensor | None) -> tuple[torch.Tensor | None, int | None]:
    if t is None:
        return None, None
    t = t.contiguous()
    return t, t.data_ptr()


def supports_quantize(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the native quantizer takes these sources: CPU fp32/fp16/bf16 tensors of one dtype
    with unit inner stride and head_dim <= 1024 (other arguments are checked as in the reference)."""
    return (k.device.type == "cpu" and v.device.type == "cpu" and k.dtype in _DTYPES and v.dtype == k.dtype
            and k.dim() == 3 and k.shape == v.shape and k.stride(-1) == 1 and v.stride(-1) == 1
            and k.shape[-1] <= MAX_HEAD_DIM)


def quantize_native(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, tag: object, block_size: int,
                    v_group: int, n_threads: int | None = None) -> RunPayload:
    """``quantize_gather`` through ``native.c``: the same payload as the reference, bit for bit.

    Args:
        k, v: ``[num_kv_heads, N, head_dim]`` sources satisfying :func:`supports_quantize`.
        rows, tag, block_size, v_group: as :func:`~patchkv_agent.kernels.quantize_gather`.
        n_threads: worker threads (default ``torch.get_num_threads()``).

    Returns:
        A :class:`RunPayload` on the CPU.

    Raises:
        RuntimeError: the library is unavailable.
        ValueError: bad arguments, as the reference raises them (``block_size`` and ``v_group`` below 2^31
            included); sources the native path cannot read (not CPU fp32/fp16/bf16 of one dtype with unit
            inner stride, head_dim > 1024), or rows not on the CPU.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"native kernels {status()}")
    tag = check_quantize_args(k, v, rows, tag, block_size, v_group)
    if not supports_quantize(k, v) or min(k.stride()) < 0 or min(v.stride()) < 0:
        raise ValueError(f"native quantize reads CPU fp32/fp16/bf16 sources of one dtype, [H, N, D] with unit "
                         f"inner stride and head_dim <= {MAX_HEAD_DIM}; got {k.dtype} {tuple(k.shape)} strides "
                         f"{k.stride()} on {k.device}, {v.dtype} strides {v.stride()} on {v.device} (use the "
                         "torch backend, or .contiguous())")
    if rows.device.type != "cpu":
        raise ValueError(f"native quantize needs rows on the CPU, got {rows.device}")
    h, _, d = k.shape
    _int32("num_kv_heads", h, 1)
    block_size = _int32("block_size", block_size, 1)
    r, group = rows.numel(), effective_v_group(d, v_group)
    meta = dict(tag=tag, n_rows=r, num_kv_heads=h, head_dim=d, block_size=block_size, v_group=group)
    if tag == FP16:
        out = dict(k_data=k.new_empty((h, r, d)), v_data=v.new_empty((h, r, d)))
    else:
        nb, ng, u8 = -(-r // block_size), -(-d // group), torch.uint8
        out = dict(k_data=torch.empty((h, r, d // (2 if K_BITS[tag] == 4 else 1)), dtype=u8),
                   v_data=torch.empty((h, r, d // (2 if V_BITS[tag] == 4 else 1)), dtype=u8),
                   k_scale=torch.empty((h, nb, d), dtype=torch.float16), k_zero=torch.empty((h, nb, d), dtype=torch.float16),
                   v_scale=torch.empty((h, r, ng), dtype=torch.float16), v_zero=torch.empty((h, r, ng), dtype=torch.float16))
    if r:
        rows = rows.contiguous()
        j = _QJob(tag=_TAGS[tag], src_dtype=_DTYPES[k.dtype], H=h, D=d, block_size=block_size, v_group=group, R=r,
                  k=k.data_ptr(), v=v.data_ptr(), k_sh=k.stride(0), k_sn=k.stride(1), v_sh=v.stride(0),
                  v_sn=v.stride(1), rows=rows.data_ptr())
        unit = _UNIT[_DTYPES[k.dtype]] if tag == FP16 else 1
        for name, t in out.items():
            setattr(j, name, t.data_ptr())
            setattr(j, f"n_{name}", extent(t, unit if name.endswith("data") else 2))
        j.N = k.shape[1]
        j.n_k, j.n_v = extent(k), extent(v)
        starts = (ctypes.c_int64 * 2)()
        rc = lib.pkv_quantize(ctypes.byref(j), 1, _threads(n_threads), starts)
        if rc < -1:
            raise ValueError(f"native quantize refused its arguments: {error_text(rc) or rc}")
    return RunPayload(**meta, **out)


def scatter_native(calls: Sequence[ScatterCall], n_threads: int | None = None) -> None:
    """Run ``calls`` through ``native.c``'s ``pkv_restore`` in one multithreaded pass.

    Args:
        calls: each must satisfy :func:`supports` (arguments are checked as in the reference).
        n_threads: worker threads (default ``torch.get_num_threads()``).

    Raises:
        RuntimeError: the library is unavailable (check :func:`available` first).
        ValueError: bad shapes or rows, as the reference would raise; a call :func:`supports` would refuse
            (destinations not fp32 CPU tensors of unit inner stride, tensors off the CPU, head_dim > 1024).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"native restore {status()}")
    jobs = (_Job * len(calls))()
    keep: list = []  # tensors whose pointers the jobs hold, alive until the call returns
    checked: set = set()  # the layers of a restore share their row tensors: check and tabulate once
    angles: dict = {}
    n = 0
    for call in calls:
        p = call.payload
        tag = check_payload(p)  # every call: O(1), and a payload's tensors are not part of the signature below
        _check_call(call)
        m = p.n_rows if call.src_rows is None else call.src_rows.numel()
        sig = (id(call.src_rows), id(call.dst_rows), id(call.delta), id(call.inv_freq), p.n_rows, p.num_kv_heads,
               p.head_dim, tuple(call.dst_k.shape), tuple(call.dst_v.shape))
        if sig not in checked:  # the same tensors and shapes pass or fail the same checks
            if call.src_rows is None:
                check_scatter_args(p, call.dst_k, call.dst_v, call.dst_rows, call.delta, call.inv_freq)
            else:
                _check_selected(call, m)
            checked.add(sig)
        if m == 0:
            continue
        akey = (id(call.delta), id(call.inv_freq), call.interleaved)
        if akey not in angles:
            delta = call.delta.cpu().numpy()
            if call.inv_freq is not None and delta.any():
                shifts, inverse = np.unique(delta, return_inverse=True)
                ctab, stab = _angle_tables(shifts, call.inv_freq, call.interleaved, torch.device("cpu"))
                angles[akey] = (2 * call.inv_freq.shape[0], torch.from_numpy(inverse.astype(np.int32).reshape(-1)),
                                ctab, stab)
            else:
                angles[akey] = (0, None, None, None)
        rot, ang_idx, ctab, _ = angles[akey]
        j = jobs[n]
        n += 1
        j.tag, j.H, j.D, j.block_size, j.R, j.M = _TAGS[tag], p.num_kv_heads, p.head_dim, p.block_size, p.n_rows, m
        j.v_group = p.v_group
        j.src_dtype = _DTYPES.get(p.k_data.dtype, 0)
        j.interleaved = int(call.interleaved)
        j.rot, *angle = angles[akey]
        tensors = [p.k_data, p.v_data, p.k_scale, p.k_zero, p.v_scale, p.v_zero, call.src_rows, call.dst_rows, *angle]
        ptrs = []
        for t in tensors:
            t, ptr = _c(t)
            keep.append(t)
            ptrs.append(ptr)
        (j.k_data, j.v_data, j.k_scale, j.k_zero, j.v_scale, j.v_zero,
         j.src_rows, j.dst_rows, j.angle_idx, j.ctab, j.stab) = ptrs
        j.dst_k, j.dst_v = call.dst_k.data_ptr(), call.dst_v.data_ptr()
        j.dk_sh, j.dk_sr = call.dst_k.stride(0), call.dst_k.stride(1)
        j.dv_sh, j.dv_sr = call.dst_v.stride(0), call.dst_v.stride(1)
        _set_sizes(j, p, dst_rows=min(call.dst_k.shape[1], call.dst_v.shape[1]),
                   angles=0 if ctab is None else ctab.shape[0], dst_k=call.dst_k, dst_v=call.dst_v,
                   buffers=dict(zip(_PAYLOAD_BUFFERS, keep[-len(tensors):])))
    if n == 0:
        return
    starts = (ctypes.c_int64 * (n + 1))()
    rc = lib.pkv_restore(jobs, n, _threads(n_threads), starts)
    if rc < -1:  # the checks above passed, so this is a caller bug, not hostile data: say which job
        raise ValueError(f"native restore refused payload {int(starts[0])} of {n}: {error_text(rc) or rc}")


def _check_selected(call: ScatterCall, m: int) -> None:
    """Argument checks for a call restoring only ``src_rows`` of its payload."""
    p, s = call.payload, call.src_rows
    if s.dim() != 1 or s.dtype != torch.int64:
        raise ValueError(f"src_rows must be int64 [M], got {s.dtype} {tuple(s.shape)}")
    if m and (int(s.min()) < 0 or int(s.max()) >= p.n_rows):
        raise ValueError(f"src_rows span [{int(s.min())}, {int(s.max())}] outside the run's [0, {p.n_rows})")
    check_payload(p)
    check_destination(p.num_kv_heads, p.head_dim, m, call.dst_k, call.dst_v, call.dst_rows, call.delta, call.inv_freq)
