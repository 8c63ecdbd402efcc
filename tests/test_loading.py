"""Model loading (``patchkv_agent/loading.py``): sources resolved before loading (clear, immediate errors), the
GGUF dequantization cache key, and the trust boundary of the dequantized-weights cache: hashed when
written, verified on load, rebuilt with a log line when tampered with, replaced, truncated or unreadable."""

from __future__ import annotations

import json
import sys
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


# --------------------------------------------------------------------------- the dequantized-weights cache


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A ``.gguf`` path whose "dequantization" saves a tiny llama + char tokenizer (no real model);
    the list records each build."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from benchmarks.tiny import tiny_chat_tokenizer, tiny_model

    from patchkv_agent import loading as models

    monkeypatch.setenv("PATCHKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really, but hashed like one")
    builds = []

    def build(src, out, attn):
        builds.append(src)
        tiny_model("llama", seed=0).save_pretrained(out, safe_serialization=True)
        tiny_chat_tokenizer().save_pretrained(out)

    monkeypatch.setattr(models, "_build_dequantized", build)
    models._VERIFIED.clear()
    torch.manual_seed(0)
    return gguf, builds


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cache_dir(gguf: Path) -> Path:
    from patchkv_agent.loading import gguf_cache_path

    return gguf_cache_path(gguf)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def _other_model(path: Path) -> None:
    from safetensors.torch import save_file
    from benchmarks.tiny import tiny_model

    save_file({k: v.contiguous() for k, v in tiny_model("llama", seed=1).state_dict().items()
               if k != "lm_head.weight"}, str(path), metadata={"format": "pt"})


def _unreadable(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("tamper,reason", [
    (lambda d: _flip(d / "model.safetensors", -100), "does not match its recorded sha256"),
    (lambda d: _other_model(d / "model.safetensors"), "does not match its recorded sha256|bytes, the manifest"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]), "truncated"),
    (lambda d: _unreadable(d / "model.safetensors"), "not a regular file"),
    (lambda d: (d / "patchkv_manifest.json").unlink(), "no patchkv_manifest.json"),
    (lambda d: (d / "patchkv_manifest.json").write_text("{not json"), "unreadable patchkv_manifest.json"),
    (lambda d: (d / "pytorch_model.bin").write_bytes(b"pickle"), "unexpected \\['pytorch_model.bin'\\]"),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("64", "65", 1)),
     "config.json does not match"),
])
def test_a_tampered_weight_cache_is_rebuilt_with_a_log_line(fake_gguf, tamper, reason, caplog):
    from patchkv_agent.loading import load_model

    gguf, builds = fake_gguf
    model, _ = load_model(str(gguf))
    good = _weights(model)
    assert len(builds) == 1 and (_cache_dir(gguf) / "patchkv_manifest.json").is_file()
    tamper(_cache_dir(gguf))
    with caplog.at_level("WARNING", logger="patchkv_agent.core.models"):
        again, _ = load_model(str(gguf))
    assert len(builds) == 2, "the tampered cache was loaded instead of rebuilt"
    assert _same(_weights(again), good)
    lines = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(lines) == 1 and __import__("re").search(reason, lines[0]), lines
    assert not list(_cache_dir(gguf).parent.glob("*.bad-*"))  # the bad copy is gone


def test_an_intact_cache_is_hashed_once_per_process(fake_gguf, monkeypatch):
    from patchkv_agent import loading as models

    gguf, builds = fake_gguf
    first, _ = models.load_model(str(gguf))
    hashed = []
    real = models._sha256
    monkeypatch.setattr(models, "_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    for _ in range(2):
        again, _ = models.load_model(str(gguf))
        assert _same(_weights(again), _weights(first))
    assert len(builds) == 1
    assert hashed == ["tiny.gguf", "tiny.gguf"]  # the source's own key; no cached file hashed again
    files = sorted(p.name for p in _cache_dir(gguf).iterdir() if p.name != "patchkv_manifest.json")
    del hashed[:]
    models._VERIFIED.clear()  # a new process: every cached file hashed once
    models.load_model(str(gguf))
    assert hashed == ["tiny.gguf", *files] and len(builds) == 1


def test_a_forged_manifest_over_a_broken_file_is_rebuilt_when_loading_fails(fake_gguf, caplog):
    from patchkv_agent.loading import load_model, write_cache_manifest

    gguf, builds = fake_gguf
    good = _weights(load_model(str(gguf))[0])
    d = _cache_dir(gguf)
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    write_cache_manifest(d, json.loads((d / "patchkv_manifest.json").read_text())["source_sha256"])
    with caplog.at_level("WARNING", logger="patchkv_agent.core.models"):
        again, _ = load_model(str(gguf))
    assert len(builds) == 2 and _same(_weights(again), good)
    assert any("loading it failed" in r.getMessage() for r in caplog.records)
