"""Test-only helpers over the one factory of tiny models, :mod:`patchkv_agent.eval.tiny` (no downloads).

Tests build their models and engines with :func:`patchkv_agent.eval.tiny.tiny_model` /
:func:`~patchkv_agent.eval.tiny.tiny_engine`; this module only shares one chat model between the
LangGraph / chat-model tests: :func:`chat_engine`, an engine over the tiny llama with 4096 positions
(char-level chat contexts run ~1k tokens) and the char-level tokenizer.
"""

from __future__ import annotations

import functools

from patchkv_agent.eval.tiny import CHATML, tiny_engine, tiny_model


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
