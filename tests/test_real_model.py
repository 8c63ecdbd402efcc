"""Slow tests on the embedded SmolLM2-135M (downloaded once into the user cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow


def smollm2():
    from patchkv_agent import PatchKVEngine

    return PatchKVEngine.from_pretrained("smollm2-135m")


ENGINE = smollm2  # the `engine` fixture (conftest.py)


def _episode(engine):
    from patchkv_agent.eval.workloads import load_qa

    ex = load_qa("hotpotqa")[0]
    other = load_qa("hotpotqa")[1]["passages"]
    ps = ex["passages"][:6]

    def ctx(passages):
        body = "\n\n".join(f"Passage {i + 1}: {p['title']}\n{p['text']}" for i, p in enumerate(passages))
        return [{"role": "system", "content": "Answer from the passages."},
                {"role": "user", "content": f"{body}\n\nQuestion: {ex['input']}"}]

    old = engine.encode(ctx(ps))
    new = engine.encode(ctx(ps[:1] + [other[0]] + ps[2:]))
    return old, new


def test_embedded_model_spec(engine):
    s = engine.spec
    assert (s.model_type, s.num_layers, s.num_kv_heads, s.head_dim) == ("llama", 30, 3, 64)
    assert s.rope_supported and s.rope["full_attention"].kind == "default"


def test_drift_is_concentrated_after_the_edit(engine):
    """Value cosine similarity (restored vs exact) is lower in the first suffix block than in the last."""
    old, new = _episode(engine)
    res = engine.resume(engine.checkpoint(old), new, strategy="direct", max_new_tokens=1)
    fresh = engine.checkpoint(new)
    newp = np.array(res.edit.suffix_new_positions[:-1])
    assert len(newp) >= 96
    sims = []
    for layer in range(engine.spec.num_layers):
        a = res.values[layer][0][:, newp]  # [H, S, D]
        b = fresh.values[layer][:, newp]
        sims.append(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean(0))  # [S]
    sim = torch.stack(sims).mean(0).numpy()
    first, last = float(np.mean(sim[:32])), float(np.mean(sim[-32:]))
    assert first < last, (first, last)
    # and exact is exact on the real model too
    ex = engine.resume(None, new, strategy="exact", max_new_tokens=0)
    pre = engine.resume(engine.checkpoint(old), new, strategy="prefix", max_new_tokens=0)
    assert (ex.logits - pre.logits).abs().max().item() <= 1e-3


def test_reader_stage_scores_a_two_hop_episode_as_direct_resumes_do(engine):
    """The reader stage on SmolLM2 (decoded answers, answer_match): each rule's follows / stale equal those of a
    resume run here with the same rule; a rule without readers plans fewer recomputed rows."""
    from patchkv_agent.calibration.reader_stage import OFF, rule_grid, select_reader_rule
    from patchkv_agent.eval.follow import build_follow_traces
    from patchkv_agent.eval.metrics import answer_match
    from patchkv_agent.eval.traces import version_ids
    from patchkv_agent.strategies.builtin import PatchKVStrategy

    traces = build_follow_traces("follow-twohop", n=3, split="eval")[2:]  # the first one exact answers (greedy, fp32)
    rules = [{"name": OFF}] + rule_grid(min_shares=(0.1,), min_blocks=(3,), attention_blocks=(2,), budgets=(0.25,),
                                        off=False)
    rows: list[dict] = []
    out = select_reader_rule(engine, traces, rules=rules, progress=False, rows=rows)
    assert out["n_exact_follows"] == 1
    said = lambda ids, gold: answer_match(engine.tokenizer.decode(list(ids), skip_special_tokens=True), gold)  # noqa: E731
    for tr, row in zip(traces, rows):
        ids = [version_ids(engine, v) for v in tr["versions"]]
        ckpt = engine.checkpoint(ids[0])
        for rule in rules:
            kw = ({"readers": "none"} if rule["name"] == OFF else
                  {"readers": "lexical", "reader_min_share": 0.1, "reader_min_blocks": 3, "reader_attention_blocks": 2})
            got = engine.resume(ckpt, ids[1], strategy=PatchKVStrategy(recent_window=0, **kw), max_new_tokens=12)
            cell = row["results"][rule["name"]]
            assert cell["follows"] == said(got.output_ids, tr["versions"][1]["answers"])
            assert cell["stale"] == said(got.output_ids, tr["versions"][0]["answers"])
            assert cell["recompute_tokens"] == got.stats["recompute_tokens"]
        assert row["results"][OFF]["recompute_tokens"] < row["results"][rules[1]["name"]]["recompute_tokens"]
    assert out["n_scored"] == 1 and out["chosen"] in out["grid"]
