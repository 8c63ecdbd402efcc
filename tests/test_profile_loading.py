"""Junk in a profile folder cannot break, hang or exhaust an engine built with the default
``profile="auto"``.

The junk: a non-UTF-8 file (UnicodeDecodeError), deep nesting (RecursionError), ``d_min: Infinity`` /
``d_max: 1e30`` (OverflowError) in ``$PATCHKV_PROFILE_DIR`` or the cache's profiles, a FIFO, a link to
/dev/zero, and ``block_size: 2^32`` (which the native quantizer would truncate to int32). Profile files are
read only as regular files, size-capped and without blocking; undecodable or out-of-range files are skipped
with a warning naming the file (an explicit path raises ValueError naming it), and every numeric field is
range-checked.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patchkv_agent.core.length_model import LengthModel
from patchkv_agent.core.settings import RecoverySettings
from patchkv_agent.profiles import PROFILE_MAX_BYTES, SHIPPED_PROFILE_DIR, Profile, load_profile, read_profile


def _profile(fp: str, **fields) -> dict:
    base = {"schema": 1, "model": "tiny", "fingerprint": fp, "kappa": 0.0, "block_size": 16,
            "length_model": LengthModel.fixed(24).to_dict()}
    return {**base, **fields}


def _lm(**fields) -> dict:
    return {**LengthModel.fixed(24).to_dict(), **fields}


def _nested(depth: int) -> list:
    v: list = [1]
    for _ in range(depth - 1):
        v = [v]
    return v


def _hostile_texts(fp: str) -> dict[str, str | bytes]:
    """File name -> content: junk that once broke (or was silently accepted by) every profile search."""
    return {
        "a-latin1.json": b'{"schema": 1, "model": "caf\xe9"}',                     # UnicodeDecodeError
        "b-deep.json": "[" * 100_000 + "]" * 100_000,                               # RecursionError
        "c-deep-but-parses.json": json.dumps(_profile(fp, x=_nested(70))),       # parses; nested past the cap
        "d-dmin-inf.json": json.dumps(_profile(fp, length_model=_lm(d_min=float("inf")))),  # OverflowError
        "e-dmax-huge.json": json.dumps(_profile(fp, length_model=_lm(d_max=1e30))),
        "f-block-2-32.json": json.dumps(_profile(fp, block_size=2 ** 32)),         # was accepted
        "g-block-huge.json": json.dumps(_profile(fp, block_size=10 ** 30)),
        "h-recent-huge.json": json.dumps(_profile(fp, recent_window=2 ** 31)),
        "i-weights-huge.json": json.dumps(_profile(fp, length_model=_lm(weights=[1e300] + [0] * 6))),
        "j-policy-inf.json": '{"schema": 1, "model": "tiny", "fingerprint": "%s", "kappa": 0, "block_size": 16, '
                             '"length_model": %s, "precision_policy": {"tau_H": Infinity}}' % (fp, json.dumps(_lm())),
        "k-schema-99.json": json.dumps(_profile(fp, schema=99)),
        "l-bigint.json": '{"schema": 1, "block_size": ' + "9" * 5000 + "}",
    }


def _write(folder: Path, files: dict[str, str | bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())


def test_an_engine_with_profile_auto_skips_hostile_files_and_uses_the_valid_one(tmp_path, monkeypatch, caplog):
    from patchkv_agent.engine import PatchKVEngine
    from benchmarks.tiny import tiny_model

    model = tiny_model("llama")
    fp = PatchKVEngine(model, None, profile=None).spec.fingerprint
    hostile = _hostile_texts(fp)
    _write(tmp_path / "junk", hostile)
    _write(tmp_path / "good", {"z-good.json": json.dumps(_profile(fp, block_size=24, kappa=0.05))})
    monkeypatch.setenv("PATCHKV_PROFILE_DIR", os.pathsep.join([str(tmp_path / "junk"), str(tmp_path / "good")]))
    with caplog.at_level(logging.WARNING, logger="patchkv_agent.profiles"):
        eng = PatchKVEngine(model, None)
    assert eng.profile_path == str(tmp_path / "good" / "z-good.json")
    assert (eng.settings.block_size, eng.settings.kappa) == (24, 0.05)
    for name in hostile:
        assert name in caplog.text, name  # each skipped file is named in a warning
    for needle in ("not UTF-8", "nests deeper", "d_min=inf", "d_max=1e+30", "block_size must be an int in [1, 2^31), got 4294967296",
                   "recent_window must be an int in [0, 2^31), got 2147483648", "weights", "tau_H=inf", "schema=99"):
        assert needle in caplog.text, needle
    with caplog.at_level(logging.WARNING, logger="patchkv_agent.profiles"):  # junk alone: no profile, no error
        monkeypatch.setenv("PATCHKV_PROFILE_DIR", str(tmp_path / "junk"))
        assert load_profile(fp, dirs=[tmp_path / "junk"]) is None


@pytest.mark.parametrize("name", list(_hostile_texts("llama:0")))
def test_an_explicit_hostile_profile_raises_a_value_error_naming_it(tmp_path, name):
    _write(tmp_path, {name: _hostile_texts("llama:0")[name]})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as e:
        read_profile(tmp_path / name)
    assert "calibrate" in str(e.value)


def test_special_files_are_never_read_and_big_files_are_capped(tmp_path):
    """A FIFO (hung the search), a link to /dev/zero (read without bound), a directory and a sparse file past
    the cap: the search skips each, naming it; read_profile refuses each. Run in a child process with a memory
    limit, so the unfixed code fails (hangs are cut by the timeout) instead of taking the test run down."""
    folder = tmp_path / "junk"
    folder.mkdir()
    os.mkfifo(folder / "fifo.json")
    os.symlink("/dev/zero", folder / "zero.json")
    (folder / "dir.json").mkdir()
    with open(folder / "big.json", "wb") as f:
        f.truncate(PROFILE_MAX_BYTES + 1)
    fp = "llama:" + "0" * 32
    (folder / "ok.json").write_text(json.dumps(_profile(fp)))
    os.symlink(folder / "ok.json", folder / "ok-link.json")  # a link to a regular file is read
    code = textwrap.dedent(f"""
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))
        from patchkv_agent.profiles import iter_profiles, read_profile
        folder = {str(folder)!r}
        print(json.dumps(sorted(p.name for p, _ in iter_profiles([folder]))))
        for name in ("fifo.json", "zero.json", "dir.json", "big.json"):
            try:
                read_profile(folder + "/" + name)
                print("accepted", name)
            except ValueError as e:
                print("refused", name, str(e).replace(chr(10), " "))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert json.loads(lines[0]) == ["ok-link.json", "ok.json"]
    for name in ("fifo.json", "zero.json", "dir.json", "big.json"):
        assert name in proc.stderr, name  # the search's warning names it
        (line,) = [ln for ln in lines[1:] if f" {name} " in ln]
        assert line.startswith("refused") and name in line.split(" ", 2)[2], line
    assert "not a regular file" in proc.stdout and "more than a profile holds" in proc.stdout


def test_settings_and_length_models_range_check_every_count():
    for field, bad in (("block_size", 2 ** 31), ("block_size", 2 ** 32), ("recent_window", 2 ** 31),
                       ("capture_window", 2 ** 40), ("reader_min_blocks", 2 ** 31)):
        with pytest.raises(ValueError, match=rf"{field} must be an int in \[\d, 2\^31\)"):
            RecoverySettings(**{field: bad})
    assert RecoverySettings(block_size=2 ** 31 - 1).block_size == 2 ** 31 - 1
    for d_min, d_max in ((float("inf"), None), (0, 10 ** 30), (-1, None), (2 ** 31, None), (1.5, None)):
        with pytest.raises(ValueError, match="d_m"):
            LengthModel(weights=(0.0,) * 7, d_min=d_min, d_max=d_max)
        with pytest.raises(ValueError, match="d_m"):
            LengthModel.from_dict(_lm(d_min=d_min, d_max=d_max))
    with pytest.raises(ValueError, match="finite weights"):
        LengthModel(weights=(10 ** 400,) + (0.0,) * 6)
    with pytest.raises(ValueError, match="quantile"):
        LengthModel.from_dict(_lm(quantile=float("nan")))


def test_the_shipped_profile_still_loads():
    prof = read_profile(SHIPPED_PROFILE_DIR / "smollm2-135m.json")
    assert isinstance(prof, Profile) and prof.block_size == 32 and prof.recent_window == 1024


def test_a_profile_sets_settings_through_the_one_schema():
    prof = read_profile(SHIPPED_PROFILE_DIR / "smollm2-135m.json")
    # what it sets is the settings' own fields, checked there; the attributes read them
    assert set(prof.overrides) <= set(RecoverySettings.field_names())
    assert prof.settings() == RecoverySettings().replace(**prof.overrides)
    assert prof.kappa == prof.overrides["kappa"] and prof.head_tokens is None  # left to the base settings
    with pytest.raises(TypeError):
        prof.overrides["kappa"] = 0.5  # read-only
    with pytest.raises(AttributeError, match="kapa"):
        prof.kapa
    # every planner field a strategy may override is a top-level profile field, in the file's range check
    data = {"schema": 1, "model": "m", "fingerprint": "f", "length_model": _lm(), "kappa": 0.1, "block_size": 16,
            "head_tokens": 8, "rewrite_share": 0.5}
    got = Profile.from_dict(data)
    assert (got.head_tokens, got.rewrite_share, got.settings().head_tokens) == (8, 0.5, 8)
    with pytest.raises(ValueError, match="head_tokens"):
        Profile.from_dict({**data, "head_tokens": -1})
