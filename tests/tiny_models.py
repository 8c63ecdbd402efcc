"""Test-only helpers over the one factory of tiny models and engines, :mod:`benchmarks.tiny` (no downloads).

Tests build their engines with :func:`benchmarks.tiny.tiny_engine` (default: the tiny llama, 8-token
blocks and dirty window, no profile; its keywords give every variant: family, seed, sizes, blocks, tokenizer,
engine options), mostly through conftest.py's module-scoped ``engine`` fixture (a module's ``ENGINE`` names its
variant). This module adds presets over that factory:

- :func:`chat_engine`: the engine the LangGraph / chat-model tests share: the tiny llama with 4096 positions
  (char-level chat contexts run ~1k tokens; the model built once per seed) and the char-level tokenizer;
- :func:`family_engine`: one engine per family and keywords for the whole session (tests parametrized over
  families that only read the engine);
- :func:`tiny_profile`: a minimal calibration profile of an engine.
"""

from __future__ import annotations

import functools

from benchmarks.tiny import CHATML, tiny_engine, tiny_model


@functools.lru_cache(maxsize=None)
def chat_model(seed: int = 0):
    """The tiny llama with 4096 positions, built once per seed (shared by every :func:`chat_engine`)."""
    return tiny_model("llama", seed, max_positions=4096)


def chat_engine(template: str = CHATML, **kwargs):
    """A :class:`~patchkv_agent.PatchKVEngine` over :func:`chat_model` and a char-level tokenizer with
    ``template`` (16-token blocks and dirty window; ``kwargs``: more engine keywords)."""
    opts = dict(block_size=16, dirty_window=16, profile="auto")
    opts.update(kwargs)
    return tiny_engine(model=chat_model(), chat_template=template, **opts)


@functools.lru_cache(maxsize=None)
def family_engine(family: str = "llama", **kwargs):
    """``tiny_engine(family, **kwargs)``, built once per arguments and shared: only for tests that do not
    change the engine (settings, weights)."""
    return tiny_engine(family, **kwargs)


def tiny_profile(engine, *, readers: tuple[str, ...] = ("none",), model_name: str = "tiny") -> dict:
    """A profile dict from a minimal calibration of ``engine`` (four synthetic one-edit episodes, one grid cell,
    no precision stage): the base the opt-in stages' wiring tests add to."""
    import numpy as np

    from patchkv_agent.calibration.config import CalibConfig, Episode
    from patchkv_agent.calibration.profile import run_calibration

    rng = np.random.default_rng(0)
    eps = []
    for t in range(4):
        old = rng.integers(3, 211, 120)
        new = np.concatenate([old[:40], rng.integers(3, 211, 8), old[50:]])
        eps.append(Episode(id=f"syn/{t}", task=f"syn/{t}", workload="syn",
                           versions=(tuple(old.tolist()), tuple(new.tolist()))))
    cfg = CalibConfig(kappas=(0.0,), blocks=(8,), readers=readers, ref_tokens=2, val_share=0.5, policy_grid=(),
                      precision_target=None)
    return run_calibration(engine, eps, cfg, model_name=model_name, command="pytest")[0]
