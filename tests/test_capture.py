"""Attention capture: sdpa-identical outputs, and scores equal to an eager ``output_attentions`` oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchkv_agent.core.capture import AttentionCapture, default_layers

N_TOKENS = 48


@pytest.fixture(scope="module")
def model():
    from benchmarks.tiny import tiny_model

    # five layers (the default layer sample differs from "all"), the plain random init
    return tiny_model("llama", 0, vocab_size=128, intermediate_size=128, layers=5, max_positions=256,
                      scale=1.0)


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (1, N_TOKENS), generator=g)


def eager_reference(model, ids, *, layers, window, attention_mask=None) -> np.ndarray:
    """Oracle: eager attention with output_attentions, last `window` query rows, summed, normalised."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=attention_mask, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")
    acc = sum(out.attentions[i][0, :, -window:, :].double().sum(dim=(0, 1)) for i in layers)
    return (acc / acc.sum()).float().numpy()


def test_default_layers():
    assert default_layers(5) == (0, 4)
    assert default_layers(30) == (0, 4, 8, 12, 16, 20, 24, 28, 29)
    assert default_layers(1) == (0,)


def test_logits_identical_and_implementation_restored(model, ids):
    with torch.no_grad():
        plain = model(ids).logits
        with AttentionCapture(model) as cap:
            assert model.config._attn_implementation == "patchkv_capture"
            captured = model(ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert (captured - plain).abs().max().item() <= 1e-5
    assert cap.layers == (0, 4) and cap.n_records == 2


@pytest.mark.parametrize("layers,window", [(None, 32), ([1, 2], 8), ([3], 1), (None, 100)])
def test_scores_match_eager_oracle(model, ids, layers, window):
    with torch.no_grad(), AttentionCapture(model, window=window, layers=layers) as cap:
        model(ids)
    scores = cap.scores()
    assert scores.dtype == np.float32 and scores.shape == (N_TOKENS,)
    assert abs(float(scores.sum()) - 1.0) < 1e-5
    ref = eager_reference(model, ids, layers=cap.layers, window=window)
    np.testing.assert_allclose(scores, ref, atol=1e-5, rtol=0)


def _custom_bool_mask(n: int) -> torch.Tensor:
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    mask[:, 5:9] = False  # keys 5..8 hidden from every query
    mask[torch.arange(n), torch.arange(n)] = True  # a query always sees itself
    return mask[None, None]


def test_explicit_4d_boolean_mask(model, ids):
    mask = _custom_bool_mask(N_TOKENS)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        with AttentionCapture(model, window=16) as cap:
            captured = model(ids, attention_mask=mask).logits
    assert (captured - plain).abs().max().item() <= 1e-5
    scores = cap.scores()
    assert np.all(scores[5:9] == 0)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    ref = eager_reference(model, ids, layers=cap.layers, window=16, attention_mask=additive)
    np.testing.assert_allclose(scores, ref, atol=1e-5, rtol=0)


def test_explicit_4d_additive_mask(model, ids):
    mask = _custom_bool_mask(N_TOKENS)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad(), AttentionCapture(model, window=16) as cap:
        model(ids, attention_mask=additive)
    ref = eager_reference(model, ids, layers=cap.layers, window=16, attention_mask=additive)
    np.testing.assert_allclose(cap.scores(), ref, atol=1e-5, rtol=0)


def test_passes_accumulate_and_reset(model, ids):
    with torch.no_grad(), AttentionCapture(model, window=8, layers=[0]) as cap:
        out = model(ids[:, :-1], use_cache=True)
        model(ids[:, -1:], cache=out.past_key_values, use_cache=True)  # a decode step: one more key
        assert cap.n_records == 2 and cap.raw_scores().shape == (1, N_TOKENS)
        assert cap.raw_scores().sum().item() == pytest.approx(4 * (8 + 1), rel=1e-5)  # heads x rows
        cap.reset()
        model(ids)
    ref = eager_reference(model, ids, layers=[0], window=8)
    np.testing.assert_allclose(cap.scores(), ref, atol=1e-5, rtol=0)


def test_restored_on_error_and_bad_arguments(model, ids):
    with pytest.raises(RuntimeError, match="boom"):
        with AttentionCapture(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="window"):
        AttentionCapture(model, window=0)
    with pytest.raises(ValueError, match="out of range"):
        AttentionCapture(model, layers=[7])
    with pytest.raises(RuntimeError, match="no attention"):
        AttentionCapture(model).scores()


def test_batch_with_left_padding(model, ids):
    batch = torch.cat([ids, ids.roll(3, dims=1)])
    pad = torch.ones_like(batch)
    pad[1, :6] = 0  # row 1 is left-padded: its first 6 keys are invisible
    with torch.no_grad(), AttentionCapture(model, window=8) as cap:
        model(batch, attention_mask=pad)
    assert cap.raw_scores().shape == (2, N_TOKENS)
    np.testing.assert_allclose(cap.scores(0), eager_reference(model, ids, layers=cap.layers, window=8), atol=1e-5)
    assert np.all(cap.scores(1)[:6] == 0) and abs(float(cap.scores(1).sum()) - 1) < 1e-5


def test_the_active_table_holds_a_model_only_inside_its_block(model, ids):
    from patchkv_agent.core.capture import ACTIVE

    before = len(ACTIVE)
    first = AttentionCapture(model)
    with first:
        assert len(ACTIVE) == before + len(first._modules)
        with pytest.raises(RuntimeError, match="already inside another"):
            with AttentionCapture(model):
                pass
        assert len(ACTIVE) == before + len(first._modules)  # the refused block took nothing over
        model(ids)
    assert len(ACTIVE) == before and first.n_records > 0
