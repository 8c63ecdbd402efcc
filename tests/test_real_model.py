"""Slow tests on the embedded SmolLM2-135M (downloaded once into the user cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def eng():
    from patchkv_agent import PatchKVEngine

    return PatchKVEngine.from_pretrained("smollm2-135m")


def _episode(eng):
    from patchkv_agent.eval.workloads import load_qa

    ex = load_qa("hotpotqa")[0]
    other = load_qa("hotpotqa")[1]["passages"]
    ps = ex["passages"][:6]

    def ctx(passages):
        body = "\n\n".join(f"Passage {i + 1}: {p['title']}\n{p['text']}" for i, p in enumerate(passages))
        return [{"role": "system", "content": "Answer from the passages."},
                {"role": "user", "content": f"{body}\n\nQuestion: {ex['input']}"}]

    old = eng.encode(ctx(ps))
    new = eng.encode(ctx(ps[:1] + [other[0]] + ps[2:]))
    return old, new


def test_embedded_model_spec(eng):
    s = eng.spec
    assert (s.model_type, s.num_layers, s.num_kv_heads, s.head_dim) == ("llama", 30, 3, 64)
    assert s.rope_supported and s.rope["full_attention"].kind == "default"


def test_drift_is_concentrated_after_the_edit(eng):
    """Value cosine similarity (restored vs exact) is lower in the first suffix block than in the last."""
    old, new = _episode(eng)
    res = eng.resume(eng.checkpoint(old), new, strategy="direct", max_new_tokens=1)
    fresh = eng.checkpoint(new)
    newp = np.array(res.edit.suffix_new_positions[:-1])
    assert len(newp) >= 96
    sims = []
    for layer in range(eng.spec.num_layers):
        a = res.values[layer][0][:, newp]  # [H, S, D]
        b = fresh.values[layer][:, newp]
        sims.append(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean(0))  # [S]
    sim = torch.stack(sims).mean(0).numpy()
    first, last = float(np.mean(sim[:32])), float(np.mean(sim[-32:]))
    assert first < last, (first, last)
    # and exact is exact on the real model too
    ex = eng.resume(None, new, strategy="exact", max_new_tokens=0)
    pre = eng.resume(eng.checkpoint(old), new, strategy="prefix", max_new_tokens=0)
    assert (ex.logits - pre.logits).abs().max().item() <= 1e-3
