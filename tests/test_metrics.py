"""Fidelity metrics (patchkv_agent.eval.metrics) against independent oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from patchkv_agent.eval.metrics import (fidelity, first_token_kl, normalize_answer, teacher_forced_agreement, token_f1,
                                        top1_agree)
from patchkv_agent.strategies import get_strategy


def test_first_token_kl_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=g), torch.randn(50, generator=g)
    p = np.exp(a.double().numpy()) / np.exp(a.double().numpy()).sum()
    q = np.exp(b.double().numpy()) / np.exp(b.double().numpy()).sum()
    assert first_token_kl(a, b) == pytest.approx(float((p * np.log(p / q)).sum()), rel=1e-12)
    assert first_token_kl(a, a) == 0.0 and first_token_kl(a, a + 3.0) == pytest.approx(0.0, abs=1e-12)
    assert top1_agree(a, a + 1.0) and top1_agree(a, b) == (int(a.argmax()) == int(b.argmax()))


@pytest.mark.parametrize("pred,answers,f1", [
    ("The Eiffel Tower!", ["eiffel tower"], 1.0),
    ("Paris, France", ["Paris"], 2 * 0.5 * 1.0 / 1.5),
    ("London", ["Paris", "london"], 1.0),
    ("nothing here", ["Paris"], 0.0),
    ("", ["Paris"], 0.0),
    ("the", ["a"], 1.0),  # both normalise to empty
    ("x", [], 0.0),
])
def test_token_f1(pred, answers, f1):
    assert token_f1(pred, answers) == pytest.approx(f1)


def test_normalize_answer():
    assert normalize_answer("  The  U.S.A., an  Apple ") == "usa apple"


@torch.no_grad()
def _oracle_tf(model, context: list[int], ref: list[int]) -> float:
    """Teacher forcing by one full forward of context + ref[:-1]: argmax at each step vs ref."""
    ids = torch.tensor([context + ref[:-1]])
    logits = model(input_ids=ids, use_cache=False).logits[0]
    preds = logits[len(context) - 1:].argmax(-1).tolist()
    return sum(int(a == b) for a, b in zip(preds, ref)) / len(ref)


def test_teacher_forced_agreement_equals_a_full_forward(engine):
    rng = np.random.default_rng(1)
    old = rng.integers(3, 211, 70).tolist()
    new = old[:20] + rng.integers(3, 211, 6).tolist() + old[24:]
    ckpt = engine.checkpoint(old)
    ref = engine.resume(None, new, strategy="exact", max_new_tokens=6)
    # the exact result fed its own greedy continuation agrees at every step
    assert teacher_forced_agreement(engine, ref, ref.output_ids) == 1.0 == _oracle_tf(engine.model, new, list(ref.output_ids))
    # against an arbitrary reference, the exact path equals the full-forward oracle step by step
    arbitrary = rng.integers(3, 211, 8).tolist()
    arbitrary[0] = int(ref.logits.argmax())
    assert teacher_forced_agreement(engine, ref, arbitrary) == _oracle_tf(engine.model, new, arbitrary)
    assert teacher_forced_agreement(engine, ref, []) == 1.0
    # a patchkv resume with a window over the whole suffix is exact: its fidelity to exact is perfect
    full = engine.resume(ckpt, new, strategy=get_strategy("patchkv", {"dirty_window": 10_000}), max_new_tokens=6)
    f = fidelity(engine, full, ref)
    assert f["top1_agree"] and f["exact_continuation"] and f["tf_agree"] == 1.0
    assert f["first_token_kl"] < 1e-8
    direct = engine.resume(ckpt, new, strategy="direct", max_new_tokens=6)
    d = fidelity(engine, direct, ref)
    assert d["first_token_kl"] == first_token_kl(ref.logits, direct.logits) > 0
    assert d["tf_agree"] == teacher_forced_agreement(engine, direct, ref.output_ids)
    assert not math.isnan(d["tf_agree"])
