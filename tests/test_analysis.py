"""Analysis figures (calibration/analysis/, one module per figure) on a tiny random llama: values against oracles."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from patchkv_agent.calibration.analysis import (
    SELECTORS,
    AnalysisConfig,
    BlockSetStrategy,
    Context,
    ablation_grid,
    block_scores,
    block_sensitivity,
    build_parser,
    concentration,
    drift_spans,
    evaluate_selection,
    position_cosines,
    prepare_context,
    quantized_rows,
    run_analysis,
    selection_masks,
    summarize_drift,
    summarize_precision,
    write_outputs,
)
from patchkv_agent.core.plan import LengthModel, _prep, plan_repair
from kv_helpers import plan_settings

VOCAB = 211
ENGINE = dict(block_size=16, dirty_window=None, mixed_precision=False)  # the `engine` fixture (conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _other(tokens: np.ndarray) -> np.ndarray:
    """Different tokens of the same count (never equal to the originals, never special)."""
    return (tokens - 3 + 7) % (VOCAB - 3) + 3


def _context(kind: str, length: int = 200, seed: int = 0) -> Context:
    rng = np.random.default_rng(seed)
    old = rng.integers(3, VOCAB, length)
    if kind == "same-length":  # replace 10 tokens by 10 others: the segment after it keeps its positions
        new = old.copy()
        new[60:70] = _other(old[60:70])
    elif kind == "shift":  # replace 10 tokens by 14: everything after moves by +4
        new = np.concatenate([old[:60], _other(old[60:74]), old[70:]])
    elif kind == "two-spans":
        new = np.concatenate([old[:40], _other(old[40:52]), old[48:150], _other(old[150:155]), old[160:]])
    else:
        raise KeyError(kind)
    return Context(id=f"tiny/{kind}/{seed}", workload="tiny", edit=kind, old_ids=tuple(old.tolist()),
                   new_ids=tuple(new.tolist()))


@pytest.fixture(scope="module")
def shifted(engine):
    return prepare_context(engine, _context("shift", 300, seed=1), max_new_tokens=8)


# ---------------------------------------------------------------------------------------------- (a) drift


def test_zero_shift_raw_and_corrected_keys_agree_and_the_prefix_is_exact(engine):
    prep = prepare_context(engine, _context("same-length"), max_new_tokens=0)
    e = prep.edit
    assert e.prefix_len == 60 and [s.delta for s in e.segments] == [0]
    args = (engine.spec, prep.ckpt.keys, prep.ckpt.values, prep.ref.keys, prep.ref.values, e)
    head = np.arange(60)
    pre = position_cosines(*args, head, head)
    for name in ("value", "key_raw", "key_corrected"):
        np.testing.assert_allclose(pre[name], 1.0, atol=1e-6)
    suf = position_cosines(*args, e.suffix_old_positions, e.suffix_new_positions)
    assert np.array_equal(suf["key_raw"], suf["key_corrected"])  # nothing to rotate
    assert suf["value"].min() < 0.9999  # the later layer drifts after the edit
    (span,) = drift_spans(*args, bin_size=32)
    assert span["shift"] == 0 and span["S"] == 130 and len(span["value"]) == 5
    assert span["key_raw"] == span["key_corrected"]
    # bins are the token means
    np.testing.assert_allclose(span["value"][0], suf["value"][:32].mean(), rtol=0, atol=1e-12)


def test_shifted_keys_are_exact_at_layer_0_only_after_the_rope_correction(engine, shifted):
    e = shifted.edit
    assert [s.delta for s in e.segments] == [4]
    args = (engine.spec, shifted.ckpt.keys, shifted.ckpt.values, shifted.ref.keys, shifted.ref.values, e)
    l0 = position_cosines(*args, e.suffix_old_positions, e.suffix_new_positions, layers=[0])
    np.testing.assert_allclose(l0["key_corrected"], 1.0, atol=1e-5)  # layer-0 keys depend on the token only
    np.testing.assert_allclose(l0["value"], 1.0, atol=1e-5)
    assert l0["key_raw"].max() < 0.999  # the stored rotation is 4 positions off
    (span,) = drift_spans(*args, layers=[0], bin_size=32)
    assert span["shift"] == 4 and min(span["key_corrected"]) > 1 - 1e-5 and max(span["key_raw"]) < 0.999
    both = drift_spans(*args, bin_size=32)[0]
    assert np.mean(both["key_corrected"]) > np.mean(both["key_raw"])


def test_drift_summary_is_the_median_over_the_spans_reaching_each_bin():
    spans = [{"value": [1.0, 0.9], "key_raw": [0.5, 0.4], "key_corrected": [1.0, 1.0]},
             {"value": [0.8], "key_raw": [0.3], "key_corrected": [0.9]},
             {"value": [0.6, 0.7], "key_raw": [0.1, 0.2], "key_corrected": [0.8, 0.7]}]
    s = summarize_drift(spans, 16)
    assert s["bin_start"] == [0, 16] and s["n_spans"] == [3, 2]
    assert s["value"]["p50"] == pytest.approx([0.8, 0.8])
    assert s["key_raw"]["p50"] == pytest.approx([0.3, 0.3])
    assert s["key_corrected"]["p10"][0] == pytest.approx(0.82)  # numpy's linear percentile of (0.8, 0.9, 1.0)


# ------------------------------------------------------------------------------------------ (b) selection


def test_selectors_pick_the_blocks_they_promise(engine, shifted):
    e, scores = shifted.edit, shifted.ckpt.scores
    sel = selection_masks(e, scores, window=16, block_size=16, budget_blocks=3, seed=5)
    base = plan_repair(e, None, plan_settings(length_model=LengthModel.fixed(16), kappa=0.0, block_size=16))
    d = np.zeros(sel["n_blocks"], dtype=bool)
    d[base.repair_blocks] = True
    assert np.array_equal(sel["masks"]["D-only"], d) and sel["budget_blocks"] == 3
    _, blocks = _prep(e, 16)
    cand = np.flatnonzero(~d)
    # attention: brute force over the candidate blocks' max token score
    per_block = {b: max(scores[blocks.old_positions[blocks.token_block == b]]) for b in cand}
    ranked = sorted(cand, key=lambda b: (-per_block[b], b))
    assert sel["extra"]["attention"] == sorted(int(b) for b in ranked[:3])
    lowest = sorted(cand, key=lambda b: (per_block[b], b))[:3]
    assert sel["extra"]["low-attention"] == sorted(int(b) for b in lowest)
    np.testing.assert_allclose(block_scores(blocks, scores)[cand], [per_block[b] for b in cand])
    # distance: the three blocks right after D (one edited span)
    assert sel["extra"]["distance"] == [int(b) for b in cand[:3]]
    # readers: highest lexical reader score first, then the nearest
    from patchkv_agent.core.readers import lexical_reader_scores

    lex = lexical_reader_scores(e, blocks)
    dist = {b: blocks.distance[blocks.token_block == b].min() for b in cand}
    want = sorted(cand, key=lambda b: (-lex[b], dist[b], b))[:3]
    assert sel["extra"]["readers"] == sorted(int(b) for b in want)
    again = selection_masks(e, scores, window=16, block_size=16, budget_blocks=3, seed=5)
    assert again["extra"]["random"] == sel["extra"]["random"] and set(sel["extra"]["random"]) <= set(cand.tolist())
    for name in SELECTORS:
        assert (sel["masks"][name] & d).sum() == d.sum()
        assert sel["masks"][name].sum() == d.sum() + (0 if name == "D-only" else 3)
    assert selection_masks(e, scores, window=16, block_size=16, budget=0.0)["budget_blocks"] == 1  # at least one
    with pytest.raises(ValueError):
        selection_masks(e, None, window=16, block_size=16)


def test_d_only_matches_plan_repair_and_a_full_budget_is_exact(engine, shifted):
    e = shifted.edit
    rows = evaluate_selection(engine, shifted, window=16, block_size=16, budget_blocks=2, max_new_tokens=8)
    assert [r["selector"] for r in rows] == list(SELECTORS)
    base = plan_repair(e, None, plan_settings(length_model=LengthModel.fixed(16), kappa=0.0, block_size=16))
    d_only = rows[0]
    assert d_only["recompute_tokens"] == base.n_recompute
    assert all(r["recompute_tokens"] > base.n_recompute for r in rows[1:])
    plan = BlockSetStrategy(base.repair_blocks, block_size=16).plan(engine.settings, shifted.ckpt, e)
    assert np.array_equal(plan.recompute_positions, base.recompute_positions)
    assert np.array_equal(plan.restore_old_positions, base.restore_old_positions)

    full = evaluate_selection(engine, shifted, window=16, block_size=16, budget=1.0, max_new_tokens=8)
    for r in full[1:]:  # every suffix block recomputed: the prefix-cache result, i.e. exact
        assert r["exact_continuation"] and r["tf_agree"] == 1.0 and r["first_token_kl"] < 1e-8
        assert r["recompute_tokens"] == e.new_len - e.prefix_len


# ------------------------------------------------------------------------------------------ (c) precision


def test_identity_format_costs_nothing_and_k8v4_shares_form_a_lorenz_curve(engine, shifted):
    before = [k.clone() for k in shifted.ckpt.keys], [v.clone() for v in shifted.ckpt.values]
    ident = block_sensitivity(engine, shifted, block_size=16, max_blocks=4, fmt="FP16")
    assert len(ident["blocks"]) == 4 and all(b["kl"] == 0.0 for b in ident["blocks"])
    assert ident["blocks"][0]["block"] == 0 and ident["blocks"][-1]["block"] == ident["n_blocks"] - 1
    q = block_sensitivity(engine, shifted, block_size=16, max_blocks=6, fmt="K8V4")
    assert any(b["kl"] > 0 for b in q["blocks"])
    for t, t0 in zip(shifted.ckpt.keys + shifted.ckpt.values, before[0] + before[1]):
        assert torch.equal(t, t0)  # the probe puts the rows back
    c = concentration([b["kl"] for b in q["blocks"]], 0.1)
    y = np.asarray(c["y"])
    assert 0.0 <= c["top_share"] <= 1.0 and c["k_top"] == 1
    assert np.all(np.diff(y) >= 0) and y[0] == 0.0 and y[-1] == pytest.approx(1.0)
    assert c["top_share"] == pytest.approx(max(b["kl"] for b in q["blocks"]) / sum(b["kl"] for b in q["blocks"]))
    assert [b["last"] for b in q["blocks"]] == [False] * 5 + [True]  # the suffix runs to the last token
    s = summarize_precision([q, ident], 0.1)
    assert s["per_context"][0] == {"context": q["context"], **c} and s["per_context"][1]["top_share"] is None
    w = s["per_context_without_last"][0]
    assert len(w["x"]) == 6 and w["total_kl"] == pytest.approx(sum(b["kl"] for b in q["blocks"][:5]))
    assert s["top_share_mean"] == pytest.approx(c["top_share"])  # contexts with zero KL carry no share


def test_quantized_rows_writes_the_round_trip_and_restores_after_an_error(engine, shifted):
    ck = shifted.ckpt
    k0 = ck.keys[1].clone()
    rows = np.arange(100, 116)
    with pytest.raises(RuntimeError):
        with quantized_rows(ck, rows, "K8V4"):
            changed = ck.keys[1][:, 100:116]
            err = (changed - k0[:, 100:116]).abs().max()
            assert 0 < err < 0.01 * k0[:, 100:116].abs().max()  # 8-bit keys: small, non-zero
            assert torch.equal(ck.keys[1][:, :100], k0[:, :100])
            raise RuntimeError("boom")
    assert torch.equal(ck.keys[1], k0)


def test_concentration_oracle():
    c = concentration([0.0, 0.5, 0.3, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0], top=0.1)
    assert c["k_top"] == 1 and c["top_share"] == pytest.approx(0.5) and c["total_kl"] == pytest.approx(1.0)
    assert c["y"][:5] == pytest.approx([0.0, 0.5, 0.8, 0.9, 1.0]) and c["x"][-1] == 1.0
    assert concentration([0.2, 0.2, 0.2, 0.2], top=0.5)["top_share"] == pytest.approx(0.5)
    zero = concentration([0.0, 0.0])
    assert zero["top_share"] is None and zero["y"] == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------------- (d) ablation


def test_kappa_zero_rows_are_the_fixed_window_plan(engine, shifted):
    rows = ablation_grid(engine, shifted, kappas=(0.0, 0.05), blocks=(16, 32), window=16, max_new_tokens=8)
    assert [(r["kappa"], r["block_size"]) for r in rows] == [(0.0, 16), (0.05, 16), (0.0, 32), (0.05, 32)]
    sel = {r["selector"]: r for r in evaluate_selection(engine, shifted, window=16, block_size=16, max_new_tokens=8)}
    for r in rows:
        base = plan_repair(shifted.edit, shifted.ckpt.scores if r["kappa"] else None,
                           plan_settings(length_model=LengthModel.fixed(16), kappa=r["kappa"],
                                         block_size=r["block_size"]))
        assert r["recompute_tokens"] == base.n_recompute
    k0_16 = rows[0]
    assert k0_16["first_token_kl"] == sel["D-only"]["first_token_kl"]  # the same plan, the same numbers
    assert k0_16["tf_agree"] == sel["D-only"]["tf_agree"]
    assert rows[1]["recompute_tokens"] >= rows[0]["recompute_tokens"]


# ---------------------------------------------------------------------------------------------- end to end


def test_run_analysis_writes_json_and_one_png_per_figure(engine, tmp_path):
    ctxs = [_context("shift", 240, seed=2), _context("two-spans", 240, seed=3)]
    cfg = AnalysisConfig(bin_size=16, window=16, block_size=16, max_blocks=3, kappas=(0.0, 0.05), blocks=(16,),
                         max_new_tokens=4)
    data = run_analysis(engine, ctxs, cfg, progress=False)
    paths = write_outputs({"model": "tiny-llama", **data}, tmp_path)
    assert [p.name for p in paths] == ["analysis.json", "a_drift.png", "b_selection.png", "c_precision.png",
                                       "d_ablation.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    back = json.loads(paths[0].read_text())
    assert [c["id"] for c in back["contexts"]] == [c.id for c in ctxs]
    assert len(back["drift"]["spans"]) == 3  # one span, then two spans
    assert back["drift"]["summary"]["n_spans"][0] == 3
    assert {k: v["n"] for k, v in back["selection"]["summary"].items()} == {s: 2 for s in SELECTORS}
    assert [len(c["blocks"]) for c in back["precision"]["contexts"]] == [3, 3]
    assert [(r["kappa"], r["block_size"], r["n"]) for r in back["ablation"]["summary"]] == [(0.0, 16, 2), (0.05, 16, 2)]
    only_a = run_analysis(engine, ctxs[:1], AnalysisConfig(figures=("a",)), progress=False)
    assert "drift" in only_a and not {"selection", "precision", "ablation"} & set(only_a)


def test_parser_defaults_and_bad_configs():
    args = build_parser().parse_args(["--kappas", "0,0.02", "--blocks", "16,32", "--threads", "1"])
    assert (args.model, args.n, args.target_tokens, args.window, args.max_blocks) == ("smollm2-135m", 3, 3000, 32, 48)
    assert (args.kappas, args.blocks, args.threads, args.figures) == ((0.0, 0.02), (16, 32), 1, "a,b,c,d")
    with pytest.raises(ValueError):
        AnalysisConfig(figures=("e",))
    with pytest.raises(ValueError):
        AnalysisConfig(quant_format="K2V2")  # K4V4 is a format now
    assert AnalysisConfig(quant_format="K4V4").quant_format == "K4V4"


def test_analysis_notebook_runs_without_a_model(monkeypatch):
    from pathlib import Path

    from nb_helpers import run_notebook

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PATCHKV_ANALYSIS", str(root / "tests" / "data" / "analysis_small.json"))  # the kernel inherits it
    outputs, text = run_notebook("analysis.ipynb")
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
    assert "| selector | n |" in text and "command:" in text


def test_profile_figure_from_a_profile_and_its_drift_curves(tmp_path):
    """The calibration figure (was scripts/figures.py): per distance block the least similar / mean token's
    cosine over spans with a long enough suffix (oracle: the loop by hand), drawn and written with no model."""
    from patchkv_agent.calibration.analysis.cli import main
    from patchkv_agent.calibration.analysis.plots import cosine_by_distance, plot_profile

    rng = np.random.default_rng(0)
    lengths = [300, 40, 700]  # the short span (S < 256) is left out
    dev = [rng.random(n).astype(np.float32) * 0.2 for n in lengths]
    drift = {"offsets": np.cumsum([0] + lengths), "deviation": np.concatenate(dev), "S": np.array(lengths)}
    starts, p10, p50, p90, n = cosine_by_distance(drift, block=100, max_distance=500)
    assert starts.tolist() == [0, 100, 200, 300, 400] and n.tolist() == [2, 2, 2, 1, 1]
    for j, a in enumerate(starts):
        mins = [1.0 - float(d[a:a + 100].max()) for d, s in zip(dev, lengths) if s >= 256 and a < d.size]
        assert np.allclose([p10[j], p50[j], p90[j]], np.percentile(mins, [10, 50, 90]))
    means = cosine_by_distance(drift, block=100, max_distance=500, reduce="mean")[2]
    assert np.isclose(means[3], 1.0 - float(dev[2][300:400].mean()))

    prof = {"model": "tiny", "tau_v": 0.15, "quantile": 0.9, "validation_coverage": 1.0,
            "labels": [{"split": "calib", "d_hat": 16, "d_star": 0}, {"split": "validation", "d_hat": 32, "d_star": 20}]}
    assert plot_profile(prof, drift, tmp_path / "fig.png", block=100) is not None and (tmp_path / "fig.png").stat().st_size
    (tmp_path / "p.json").write_text(json.dumps(prof))
    np.savez(tmp_path / "p.drift.npz", **drift)  # beside the profile: found without --drift
    assert main(["--profile-figure", str(tmp_path / "p.json"), "--out-dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "value_cosine_by_distance.png").stat().st_size > 0
