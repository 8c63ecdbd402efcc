"""The native library's trust checks: built into and loaded from a private directory, verified against the
SHA-256 recorded at build time; anything else is refused and the torch reference is used, with the reason in
``native.status()``.

Guards against a file planted at a predictable path in the user cache being loaded (and run) at import.
"""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch

from patchkv_agent.kernels import backend, dequantize_scatter, native
from patchkv_agent.kernels import formats as KF, reference as KR

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A clean slate for native._library(): its cache dir under tmp_path, nothing loaded yet."""
    monkeypatch.setenv("PATCHKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PATCHKV_NATIVE", raising=False)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_why", None)
    return tmp_path / "cache" / "native-private"


def _scatter_path():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 20, 64, generator=g), torch.randn(2, 20, 64, generator=g)
    p = KR.reference_quantize_gather(k, v, torch.arange(20), KF.K8V8, 32, 32)
    dk, dv = torch.zeros(2, 30, 64), torch.zeros(2, 30, 64)
    return dequantize_scatter(p, dk, dv, torch.arange(20), torch.full((20,), 3), None)


def test_builds_into_a_private_directory_and_records_the_hash(fresh):
    assert native.available(), native.status()
    st = os.lstat(fresh)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    (so,) = fresh.glob("*.so")
    (rec,) = fresh.glob("*.json")
    import hashlib
    import json

    assert json.loads(rec.read_text())["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
    assert _scatter_path() == "native"


def test_a_modified_library_is_refused_and_torch_is_used(fresh):
    so = native.build()
    raw = bytearray(so.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # the file a planter replaced (or a disk flipped)
    so.write_bytes(bytes(raw))
    with pytest.raises(native.UntrustedLibrary, match="SHA-256 recorded"):
        native.load(so)
    assert not native.available() and "SHA-256 recorded when it was built" in native.status()
    assert _scatter_path() == "torch"
    with backend("native"), pytest.raises(RuntimeError, match="refused"):
        _scatter_path()


def test_a_planted_library_without_a_build_record_is_never_loaded(fresh):
    real = native.build()
    planted = fresh / "patchkv_restore_0123456789abcdef-0123456789abcdef.so"
    shutil.copy(real, planted)  # even a working library: it was not built by this process's build()
    os.chmod(planted, 0o700)
    with pytest.raises(native.UntrustedLibrary, match="no build record"):
        native.load(planted)
    assert native.available() and native.build() == real  # the recorded build is the one used


@pytest.mark.parametrize("fault", ["group_writable", "symlink", "other_owner"])
def test_a_directory_that_is_not_private_is_refused(fresh, tmp_path, fault):
    if fault == "group_writable":
        fresh.mkdir(parents=True)
        os.chmod(fresh, 0o775)
        want = "mode 775"
    elif fault == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        fresh.parent.mkdir(parents=True)
        fresh.symlink_to(tmp_path / "elsewhere")
        want = "not a directory"
    else:
        if os.getuid() != 0:
            pytest.skip("chown to another user needs root")
        fresh.mkdir(parents=True, mode=0o700)
        os.chown(fresh, 65534, 65534)
        want = "owned by uid 65534"
    assert not native.available()
    assert "refused" in native.status() and want in native.status()
    assert not list(fresh.glob("*.so"))  # nothing was built into (or loaded from) it
    assert _scatter_path() == "torch"
