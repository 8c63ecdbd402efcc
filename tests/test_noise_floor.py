"""The noise floor: emulated bf16 / int8 / fp8 KV caches and bf16 weights, scored beside the strategies."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from patchkv_agent.eval.noise_floor import FLOORS, fake_quant, parse_floors, run_floor


def test_fake_quant_rounds_as_each_format_stores():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 33, 16) * 3
    assert torch.equal(fake_quant(x, "kv-fp16"), x.half().float())
    assert torch.equal(fake_quant(x, "kv-bf16"), x.bfloat16().float())
    q = fake_quant(x, "kv-int8")
    step = x.abs().amax(-1, keepdim=True) / 127
    assert float(((q - x).abs() / step).max()) <= 0.5 + 1e-4  # half a step per element
    assert int(torch.unique(torch.round(q / step)).numel()) <= 255
    f8 = fake_quant(x, "kv-fp8")
    s = x.abs().amax(-1, keepdim=True) / 448.0
    assert torch.equal(f8, (x / s).to(torch.float8_e4m3fn).float() * s)
    assert float((fake_quant(x, "kv-fp8-tensor") - x).abs().max()) >= float((f8 - x).abs().max())
    with pytest.raises(ValueError, match="unknown KV format"):
        fake_quant(x, "kv-int3")


def test_a_floor_cache_stores_rounded_rows_and_scores_against_exact(engine, one_torch_thread):
    eng = engine
    ids = np.random.default_rng(3).integers(0, eng.spec.vocab_size, 120)
    ref = eng.resume(None, ids, strategy="exact", max_new_tokens=6)
    seen = []
    from patchkv_agent.eval import noise_floor

    orig = noise_floor.fake_quant
    noise_floor.fake_quant = lambda t, kind: seen.append(orig(t, kind)) or seen[-1]
    try:
        fr = run_floor(eng.model, ids, "kv-bf16", max_new_tokens=6, eos_ids=eng.eos_ids, ref_ids=ref.output_ids)
    finally:
        noise_floor.fake_quant = orig
    assert seen and all(torch.equal(t, t.bfloat16().float()) for t in seen)  # what the cache got is bf16
    assert 0 < float((fr.logits - ref.logits).abs().max()) < 0.1  # rounded, and close
    # its own continuation, teacher-forced, agrees with itself
    again = run_floor(eng.model, ids, "kv-bf16", max_new_tokens=6, eos_ids=eng.eos_ids, ref_ids=fr.output_ids)
    assert again.tf_agree == 1.0 and again.output_ids == fr.output_ids
    wb = run_floor(eng.model, ids, "weights-bf16", max_new_tokens=2, eos_ids=eng.eos_ids)
    assert wb.logits.dtype == torch.float32 and next(eng.model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="unknown noise floor"):
        run_floor(eng.model, ids, "kv-int4", max_new_tokens=1, eos_ids=set())


def test_parse_floors():
    assert parse_floors("default") == ("kv-bf16", "kv-int8", "kv-fp8", "weights-bf16")
    assert parse_floors("all") == FLOORS and parse_floors(None) == () and parse_floors("kv-int8,kv-int8") == ("kv-int8",)
    with pytest.raises(ValueError, match="choose from"):
        parse_floors("kv-bf16,fp4")


def test_bench_reports_floors_beside_the_strategies(engine, tmp_path, one_torch_thread):
    from benchmarks.bench import run_bench

    eng = engine
    rng = np.random.default_rng(0)
    v0 = rng.integers(0, eng.spec.vocab_size, 150).tolist()
    v1 = v0[:60] + rng.integers(0, eng.spec.vocab_size, 8).tolist() + v0[70:]
    trace = {"id": "e0", "workload": "agent-clear", "edit": "clear",
             "versions": [{"token_ids": v0}, {"token_ids": v1}]}
    summary = run_bench(eng, [trace], ["exact", "prefix", "patchkv"], tmp_path, max_new_tokens=4,
                        progress=False, floors=("kv-bf16", "kv-fp8"))
    g = summary["by_workload"]["agent-clear"]
    assert g["kv-bf16"]["floor"] and g["kv-bf16"]["ttft_s_median"] is None and not g["patchkv"]["floor"]
    assert g["prefix"]["next_action"] == 1.0  # prefix is exact: its action is exact's
    assert g["kv-bf16"]["next_action"] is not None and g["kv-bf16"]["top1_agree"] is not None
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    floor_rows = [r for r in rows if r.get("floor")]
    assert {r["strategy"] for r in floor_rows} == {"kv-bf16", "kv-fp8"} and all(r["ttft_s"] is None for r in floor_rows)
    assert all(r["action_kind"] in ("call", "text") for r in rows if r["strategy"] != "exact")
    assert (tmp_path / "agreement_agent-clear.png").stat().st_size > 0
    # resuming skips what is done (floors included)
    again = run_bench(eng, [trace], ["exact", "prefix", "patchkv"], tmp_path, resume=True, progress=False,
                      floors=("kv-bf16", "kv-fp8"))
    assert again["n_rows"] == summary["n_rows"]


def test_noise_floor_flag_is_checked_before_a_model_loads(no_model, capsys):
    from patchkv_agent.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--noise-floor", "kv-bf16,fp4", "--n", "1"])
    assert e.value.code == 2 and "--noise-floor" in capsys.readouterr().err
