"""Precision policy: exact tags on hand-made inputs, run clustering, defaults on peaked attention."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from patchkv_agent.core.precision import (
    PrecisionPolicy,
    Run,
    Tag,
    assign_tags,
    block_risk,
    cluster_runs,
    normalized_attention,
)

POLICY = PrecisionPolicy(alpha=0.5, tau_L=0.2, tau_H=1.0, g4=0.15)


def test_precision_does_not_import_torch():
    code = "import sys, patchkv_agent.core.precision; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_policy_is_frozen_and_validated():
    p = PrecisionPolicy()
    assert (p.alpha, p.tau_L, p.tau_H, p.g4) == (0.7, 1.0, 8.0, 0.15)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.alpha = 0.1
    for bad in (dict(alpha=1.5), dict(tau_L=2.0, tau_H=1.0), dict(tau_L=-0.1), dict(g4=0.0)):
        with pytest.raises(ValueError):
            PrecisionPolicy(**bad)


def _hand_made():
    # 14 tokens, blocks of 4 (last block 2 tokens); attention already has mean 1
    attn = np.array([1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 4, 0, 0, 0, 3.5, 0.5])
    resid = np.array([0.1] * 7 + [0.2] + [0.1] * 4 + [0.5, 0.1])
    return attn, resid


def test_assign_tags_exact():
    attn, resid = _hand_made()
    # block 0: r = 0.1, G4 passes           -> K8V4
    # block 1: r = 0.08125, max e 0.2 > g4  -> K8V8 (G4 fails)
    # block 2: r = 0.5 * 0.4 + 0.5 * 0.1    -> K8V8 (0.25 in [tau_L, tau_H))
    # block 3: r = 0.5 * 1.75 + 0.5 * 0.9   -> FP16 (1.325 >= tau_H)
    np.testing.assert_allclose(block_risk(attn, resid, 4, 0.5), [0.1, 0.08125, 0.25, 1.325])
    tags = assign_tags(attn, resid, 4, POLICY)
    assert tags.dtype == np.int8
    assert [Tag(t) for t in tags] == [Tag.K8V4, Tag.K8V8, Tag.K8V8, Tag.FP16]
    # the attention's own normalization does not matter
    assert np.array_equal(assign_tags(attn * 7.3e-4, resid, 4, POLICY), tags)


def test_thresholds_are_inclusive_from_below():
    ones = np.ones(4)
    pol = PrecisionPolicy(alpha=0.7, tau_L=0.25, tau_H=2.0, g4=0.15)
    assert assign_tags(ones, np.full(4, 0.25), 4, pol).tolist() == [Tag.K8V8]  # r == tau_L
    assert assign_tags(ones, np.full(4, 0.125), 4, pol).tolist() == [Tag.K8V4]
    assert assign_tags(ones, np.full(4, 2.0), 4, pol).tolist() == [Tag.FP16]  # r == tau_H


def test_alpha_weighs_max_against_mean():
    attn, resid = np.array([4.0, 0, 0, 0]), np.full(4, 0.5)  # p = [2, 0, 0, 0]
    assert assign_tags(attn, resid, 4, dataclasses.replace(POLICY, alpha=1.0)).tolist() == [Tag.FP16]
    assert assign_tags(attn, resid, 4, dataclasses.replace(POLICY, alpha=0.0)).tolist() == [Tag.K8V8]


def test_degenerate_inputs():
    assert assign_tags(np.zeros(0), np.zeros(0), 32).shape == (0,)
    assert assign_tags(np.zeros(5), np.full(5, 0.1), 2).tolist() == [Tag.K8V4] * 3  # no attention at all
    assert np.array_equal(normalized_attention(np.zeros(3)), np.zeros(3))
    for attn, resid, bs in ((np.ones(3), np.ones(4), 2), (np.array([1, -1.0]), np.ones(2), 2),
                            (np.ones(2), np.array([np.nan, 0]), 2), (np.ones(2), np.ones(2), 0)):
        with pytest.raises(ValueError):
            assign_tags(attn, resid, bs)


def test_cluster_runs():
    tags = np.array([0, 0, 2, 2, 2, 1, 0], dtype=np.int8)
    assert cluster_runs(tags) == [Run(Tag.K8V4, 0, 2), Run(Tag.FP16, 2, 3), Run(Tag.K8V8, 5, 1), Run(Tag.K8V4, 6, 1)]
    assert cluster_runs(np.array([1])) == [(Tag.K8V8, 0, 1)]
    assert cluster_runs(np.zeros(0, dtype=np.int8)) == []
    with pytest.raises(ValueError):
        cluster_runs(np.array([0, 3]))
    with pytest.raises(ValueError):
        cluster_runs(np.zeros((2, 2)))


def test_defaults_on_peaked_attention():
    """Typical decode-facing attention: a sink, a recency tail, a few spikes, a low bulk."""
    rng = np.random.default_rng(0)
    n = 1024
    attn = rng.lognormal(mean=np.log(0.13), sigma=1.0, size=n)
    attn[0] = 300.0  # attention sink
    attn[[97, 400, 700]] = [46.0, 30.0, 12.0]  # spikes
    attn[-16:] += np.linspace(1, 20, 16)  # recency
    resid = rng.normal(0.083, 0.004, size=n).clip(0.05)
    tags = assign_tags(attn, resid, 32)
    counts = {t: int((tags == t).sum()) for t in Tag}  # no key residuals: no K4V4 (bincount: K4V4 is -1)
    assert counts[Tag.K4V4] == 0 and counts[Tag.K8V4] >= 0.75 * tags.size
    assert 1 <= counts[Tag.FP16] <= 0.1 * tags.size and tags[0] == Tag.FP16
    runs = cluster_runs(tags)
    assert sum(r.n_blocks for r in runs) == tags.size and len(runs) < tags.size
