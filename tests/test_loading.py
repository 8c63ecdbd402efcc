"""Model sources resolved before loading: clear, immediate errors; the GGUF dequantization cache key."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchkv_agent.loading import gguf_cache_path, load_model, resolve_source


def test_missing_local_paths_fail_at_once_naming_the_path(tmp_path):
    for name in (str(tmp_path / "nope"), "./no-such-model-dir", "~/no/such/model.gguf", str(tmp_path / "m.gguf")):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            resolve_source(name)
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not a .gguf"):
        resolve_source(str(f))
    assert resolve_source(str(tmp_path)) == ("dir", tmp_path.resolve())


def test_hub_ids_fail_fast_when_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty HF cache
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set.*smollm2-135m"):  # decided before any hub request
        load_model("some-org/some-model")


def test_gguf_cache_key_has_the_sha256_and_transformers_version(tmp_path):
    import transformers

    p = gguf_cache_path(Path("/x/model.Q4.gguf"), "ab" * 32)
    assert p.name == f"model.Q4-{'ab' * 8}-tf{transformers.__version__}" and p.parent.name == "dequantized"
