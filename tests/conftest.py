import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton kernels are tested on CPU through the interpreter. Triton reads TRITON_INTERPRET when a
# @triton.jit function is created, so it must be set before any test module imports the kernels.
try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread (and do not stall on shared, busy cores); per module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(request):
    """The test module's engine, built once per module by the one tiny-engine factory,
    :func:`benchmarks.tiny.tiny_engine`: with the module's ``ENGINE`` keywords (a dict), or by the
    module's ``ENGINE`` builder (a callable, e.g. :func:`tiny_models.chat_engine`); without ``ENGINE``, the
    default tiny engine (the tiny llama, 8-token blocks and dirty window, no profile)."""
    from benchmarks.tiny import tiny_engine

    spec = getattr(request.module, "ENGINE", {})
    return spec() if callable(spec) else tiny_engine(**spec)


@pytest.fixture(scope="module")
def redis_server():
    """A throwaway redis-server on loopback (persistence off) for a test module; skips without redis."""
    from kv_helpers import start_redis

    srv = start_redis()
    yield srv
    srv.stop()


@pytest.fixture
def no_model(monkeypatch):
    """Every way a command loads a model raises (a bad argument must be caught before it loads one)."""
    from patchkv_agent import cli, engine
    from patchkv_agent import loading as models
    from benchmarks import stress_cli

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "_engine", boom)
    monkeypatch.setattr(engine.PatchKVEngine, "from_pretrained", classmethod(boom))
    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(stress_cli, "tiny_engine", boom)
