"""Offline calibration: oracle boundary, quantile fit, task split, minimax selection, profiles end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchkv_agent.calibration.drift import (
    block_deviation,
    default_profile_layers,
    oracle_boundary,
    span_drift,
    token_deviation,
)
from patchkv_agent.calibration.fit import coverage, fit_length_model, fit_quantile, pinball_loss, split_by_group
from patchkv_agent.calibration.select import select_config
from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.plan import LengthModel, span_features
from patchkv_agent.profiles import SHIPPED_PROFILE_DIR, Profile, load_profile

# --- oracle boundary ------------------------------------------------------------------------------------------------


def test_oracle_boundary_gamma_one_is_after_the_last_bad_block():
    b = np.array([0.5, 0.2, 0.01, 0.01])
    assert oracle_boundary(b, block_size=16, suffix_len=64, tau_v=0.05, gamma=1.0) == 32
    assert oracle_boundary(b, block_size=16, suffix_len=64, tau_v=0.3, gamma=1.0) == 16
    assert oracle_boundary(b, block_size=16, suffix_len=64, tau_v=0.6, gamma=1.0) == 0  # all under: nothing dirty
    # a late bad block moves d* past it
    b2 = np.array([0.5, 0.01, 0.01, 0.2, 0.01])
    assert oracle_boundary(b2, block_size=16, suffix_len=80, tau_v=0.05) == 64


def test_oracle_boundary_none_case_is_the_whole_segment():
    b = np.full(4, 0.5)
    assert oracle_boundary(b, block_size=16, suffix_len=60, tau_v=0.05) == 60  # ragged last block: |S|, not 64
    assert oracle_boundary(np.array([0.01, 0.9]), block_size=16, suffix_len=20, tau_v=0.05) == 20
    assert oracle_boundary(np.zeros(0), block_size=16, suffix_len=0, tau_v=0.05) == 0


def test_oracle_boundary_gamma_tolerates_isolated_late_blocks():
    b = np.full(30, 0.01)
    b[0], b[10] = 0.5, 0.3
    assert oracle_boundary(b, block_size=16, suffix_len=480, tau_v=0.05, gamma=1.0) == 176
    # gamma 0.95: from block 1 on, 28 of 29 later blocks (96.6%) are under tau; from block 0 only 28/30
    assert oracle_boundary(b, block_size=16, suffix_len=480, tau_v=0.05, gamma=0.95) == 16
    # gamma 0.9: 28/30 = 93% already qualifies at 0
    assert oracle_boundary(b, block_size=16, suffix_len=480, tau_v=0.05, gamma=0.9) == 0


def test_oracle_boundary_rejects_bad_inputs():
    with pytest.raises(ValueError):
        oracle_boundary(np.zeros(3), block_size=16, suffix_len=64, tau_v=0.1)  # 64 tokens need 4 blocks
    with pytest.raises(ValueError):
        oracle_boundary(np.zeros(4), block_size=16, suffix_len=64, tau_v=0.1, gamma=0.0)


def test_block_deviation_max_and_mean_with_a_ragged_block():
    d = np.array([0.1, 0.3, 0.2, 0.0, 0.4])
    assert block_deviation(d, 2, "max").tolist() == pytest.approx([0.3, 0.2, 0.4])
    assert block_deviation(d, 2, "mean").tolist() == pytest.approx([0.2, 0.1, 0.4])
    assert block_deviation(np.zeros(0), 4).size == 0


def test_token_deviation_cosine_and_rel_l2():
    old = [torch.tensor([[[1.0, 0.0], [2.0, 0.0], [0.0, 5.0]]])]  # one layer, 1 head, 3 tokens, D=2
    new = [torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.0, 5.0]]])[None]]  # batch dim accepted
    cos = token_deviation(old, new, np.array([0, 1, 2]), np.array([0, 1, 2]), layers=[0])
    assert cos.tolist() == pytest.approx([1.0, 0.0, 0.0])
    rel = token_deviation(old, new, np.array([1]), np.array([1]), layers=[0], metric="rel_l2")
    assert rel.tolist() == pytest.approx([1.0])  # |(2,0) - (1,0)| / |(1,0)|
    with pytest.raises(ValueError):
        token_deviation(old, new, np.array([0]), np.array([0]), layers=[3])
    assert default_profile_layers(30) == tuple(range(1, 30)) and default_profile_layers(1) == (0,)


def test_span_drift_follows_the_edit_layout():
    old = np.arange(100, 300)
    new = np.concatenate([old[:50], np.arange(900, 920), old[60:150], np.arange(950, 955), old[160:]])
    edit = diff_versions(old, new)
    h, d = 2, 4
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(1000, h, d, generator=gen)  # value = f(token): no drift anywhere
    vo = [table[torch.from_numpy(old)].transpose(0, 1)]
    vn = [table[torch.from_numpy(new)].transpose(0, 1)]
    spans = span_drift(edit, vo, vn, layers=[0])
    p, e, s = span_features(edit)
    assert [(x.prefix_len, x.edit_len, x.suffix_len) for x in spans] == list(zip(p.tolist(), e.tolist(), s.tolist()))
    assert [x.suffix_len for x in spans] == [90, 40]
    assert all(np.allclose(x.deviation, 0.0, atol=1e-6) and x.deviation.size == x.suffix_len for x in spans)


# --- quantile fit ---------------------------------------------------------------------------------------------------


def _synthetic(n, rng):
    p, e, s = rng.integers(50, 3000, n), rng.integers(5, 500, n), rng.integers(50, 2000, n)
    x = LengthModel.features(p, e, s)
    w = np.array([1.0, 0.1, 0.3, 0.2, 0.0, 0.0, 0.0])
    y = x @ w + rng.normal(0.0, 0.4, n) * (1.0 + 0.1 * x[:, 2])  # heteroscedastic noise
    return p, e, s, x, y


@pytest.mark.parametrize("q", [0.5, 0.9])
def test_pinball_fit_recovers_the_quantile(q):
    rng = np.random.default_rng(1)
    _, _, _, x, y = _synthetic(1500, rng)
    w = fit_quantile(x, y, q, ridge=0.0)
    assert np.mean(y <= x @ w) == pytest.approx(q, abs=0.01)  # in sample: a quantile fit hits q
    _, _, _, x2, y2 = _synthetic(4000, rng)
    assert np.mean(y2 <= x2 @ w) == pytest.approx(q, abs=0.03)  # out of sample: within a few points
    # the fit is a pinball minimum: perturbing the weights never helps
    base = pinball_loss(y, x @ w, q)
    for k in range(x.shape[1]):
        for step in (-1e-2, 1e-2):
            w2 = w.copy()
            w2[k] += step
            assert pinball_loss(y, x @ w2, q) >= base - 1e-9


def test_fit_length_model_covers_d_star_on_held_out_tasks():
    rng = np.random.default_rng(2)
    p, e, s, x, y = _synthetic(600, rng)
    d_star = np.minimum(np.exp(y).round().astype(np.int64), s)
    groups = [f"task{i // 3}" for i in range(600)]  # three spans per task
    cal, val = split_by_group(groups, val_share=0.3)
    cal_m = np.isin(groups, cal)
    lm = fit_length_model(p[cal_m], e[cal_m], s[cal_m], d_star[cal_m], quantile=0.9,
                          groups=[g for g, m in zip(groups, cal_m) if m])
    assert lm.quantile == 0.9
    cov = coverage(lm, p[~cal_m], e[~cal_m], s[~cal_m], d_star[~cal_m])
    assert 0.85 <= cov <= 0.98
    assert LengthModel.from_dict(json.loads(json.dumps(lm.to_dict()))) == lm


def test_fit_quantile_rejects_bad_inputs():
    with pytest.raises(ValueError):
        fit_quantile(np.ones((3, 2)), np.zeros(3), 1.0)
    with pytest.raises(ValueError):
        fit_quantile(np.zeros((3, 2)), np.zeros(3), 0.5)  # no intercept column


# --- split ----------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([f"w/{i}" for i in range(12)]), min_size=1, max_size=60),
       st.floats(0.0, 0.9))
def test_split_never_puts_a_task_on_both_sides(groups, share):
    cal, val = split_by_group(groups, val_share=share)
    assert not set(cal) & set(val)
    assert set(cal) | set(val) == set(groups)
    if len(set(groups)) >= 2 and share > 0:
        assert cal and val
    assert split_by_group(list(reversed(groups)), val_share=share) == (cal, val)  # order-independent


# --- selection ------------------------------------------------------------------------------------------------------


def _row(kappa, bs, wl, kl, rec):
    return {"kappa": kappa, "block_size": bs, "workload": wl, "first_token_kl": kl, "tf_agree": 1.0 - kl,
            "recompute_tokens": rec, "ttft_s": rec / 1000}


def test_minimax_picks_the_cheapest_config_within_tolerance_of_the_best_worst_gap():
    rows = [
        # (0, 16): good on a, bad on b -> worst 0.30
        _row(0.0, 16, "a", 0.01, 100), _row(0.0, 16, "b", 0.30, 100),
        # (0.02, 16): worst 0.105, cheap
        _row(0.02, 16, "a", 0.10, 150), _row(0.02, 16, "b", 0.105, 150),
        # (0.02, 64): best worst gap 0.10, expensive
        _row(0.02, 64, "a", 0.10, 300), _row(0.02, 64, "b", 0.09, 300),
    ]
    sel = select_config(rows, tol_rel=0.1, tol_abs=0.0)
    assert (sel["kappa"], sel["block_size"]) == (0.02, 16)
    assert sel["best_worst_gap"] == pytest.approx(0.10)
    sel = select_config(rows, tol_rel=0.0, tol_abs=0.0)
    assert (sel["kappa"], sel["block_size"]) == (0.02, 64)
    # any key set: the tau_V stage selects over one field
    tau_rows = [{**r, "tau_v": 0.05 if r["block_size"] == 64 else 0.1} for r in rows if r["kappa"] == 0.02]
    sel = select_config(tau_rows, keys=("tau_v",), tol_rel=0.1, tol_abs=0.0)
    assert sel["tau_v"] == 0.1 and len(sel["summary"]) == 2
    with pytest.raises(ValueError):
        select_config([])


def test_minimax_z_treats_differences_within_noise_as_ties():
    rows = [
        # cheap config: noisy on workload a (0.00 and 0.10: mean 0.05, se 0.05)
        _row(0.0, 16, "a", 0.00, 100), _row(0.0, 16, "a", 0.10, 100), _row(0.0, 16, "b", 0.01, 100),
        # expensive config: 0.01 everywhere
        _row(0.03, 128, "a", 0.01, 900), _row(0.03, 128, "a", 0.01, 900), _row(0.03, 128, "b", 0.01, 900),
    ]
    strict = select_config(rows, z=0.0, tol_abs=0.0, tol_rel=0.0)
    assert (strict["kappa"], strict["block_size"]) == (0.03, 128)
    lenient = select_config(rows, z=1.0, tol_abs=0.0, tol_rel=0.0)  # 0.05 <= 0.01 + 1 * 0.05
    assert (lenient["kappa"], lenient["block_size"]) == (0.0, 16) and lenient["admissible"] == 2
    # a quality target: the cheapest configuration whose worst gap meets it, else the tolerance rule
    assert select_config(rows, target=0.06, z=0.0)["kappa"] == 0.0
    missed = select_config(rows, target=0.001, z=0.0, tol_abs=0.0, tol_rel=0.0)
    assert missed["target_met"] is False and missed["kappa"] == 0.03
    cheap = next(s for s in lenient["summary"] if s["kappa"] == 0.0)
    assert cheap["worst_workload"] == "a" and cheap["worst_se"] == pytest.approx(0.05)


def _frow(kappa, readers, kl, rec, follows, exact_follows=True, stale=False):
    return {**_row(kappa, 32, "follow-twohop", kl, rec), "readers": readers, "follows": follows,
            "exact_follows": exact_follows, "stale": stale, "exact_stale": False}


def test_selection_keeps_the_follow_rate_not_only_the_kl():
    """The cheap configuration has the lower KL but answers the old gold in half the pairs: with a follow
    target it is not admissible; without one it wins."""
    keys = ("kappa", "block_size", "readers")
    rows = ([_frow(0.0, "none", 0.004, 60, f, stale=not f) for f in (True, False, True, False)]
            + [_frow(0.0, "lexical", 0.005, 150, True) for _ in range(4)]
            + [_frow(0.02, "none", 0.005, 150, True) for _ in range(3)] + [_frow(0.02, "none", 0.005, 150, False)]
            + [_frow(0.0, "none", 0.004, 60, False, exact_follows=False)])  # exact misses: not counted
    plain = select_config(rows, keys=keys, z=0.0, tol_abs=0.0, tol_rel=0.5)
    assert (plain["readers"], plain["follow_target_met"]) == ("none", None) and plain["follow_rate"] == 0.5
    sel = select_config(rows, keys=keys, z=0.0, tol_abs=0.0, tol_rel=0.5, follow_target=0.95)
    assert (sel["kappa"], sel["readers"], sel["follow_target_met"], sel["follow_rate"]) == (0.0, "lexical", True, 1.0)
    summ = {(s["kappa"], s["readers"]): s for s in sel["summary"]}
    # stale rate over the 5 rows whose exact is not stale (the exact-miss row too): 2 of 5
    assert summ[(0.0, "none")]["follow_n"] == 4 and summ[(0.0, "none")]["stale_rate"] == pytest.approx(0.4)
    assert summ[(0.02, "none")]["follow_rate"] == 0.75
    # nobody meets the target: the best followers stay, and the miss is reported
    worse = [r for r in rows if r["readers"] != "lexical"]
    missed = select_config(worse, keys=keys, z=0.0, tol_abs=0.0, tol_rel=0.5, follow_target=0.95)
    assert (missed["kappa"], missed["follow_target_met"], missed["follow_rate"]) == (0.02, False, 0.75)
    # equal cost and loss: the reader rule stays on (it found nothing to add on these pairs)
    tie = [_frow(0.0, rd, 0.004, 60, True) for rd in ("none", "lexical")]
    assert select_config(tie, keys=keys, follow_target=0.95)["readers"] == "lexical"
    with pytest.raises(ValueError, match="follow_target"):
        select_config(rows, keys=keys, follow_target=1.5)


def test_profile_readers_reach_the_settings_and_episodes_check_their_answers():
    from patchkv_agent.calibration.config import Episode
    from patchkv_agent.core.settings import RecoverySettings
    shipped = json.loads((SHIPPED_PROFILE_DIR / "smollm2-135m.json").read_text())
    assert Profile.from_dict({**shipped, "readers": "none"}).settings().readers == "none"
    assert Profile.from_dict({k: v for k, v in shipped.items() if k != "readers"}).settings(
        RecoverySettings(readers="none")).readers == "none"  # an older profile keeps the base's
    with pytest.raises(ValueError, match="readers"):
        Profile.from_dict({**shipped, "readers": "semantic"})
    with pytest.raises(ValueError, match="answer lists"):
        Episode(id="e", task="t", workload="w", versions=((1, 2), (1, 3)), answers=(("a",),))


# --- end to end on a tiny model -------------------------------------------------------------------------------------


ENGINE = dict(block_size=16, dirty_window=None, profile="auto")  # the `engine` fixture (conftest.py)


def _episodes(n_tasks=5, length=160, seed=0):
    from patchkv_agent.calibration.config import Episode

    rng = np.random.default_rng(seed)
    out = []
    for t in range(n_tasks):
        old = rng.integers(3, 211, length)
        cut = int(rng.integers(20, 60))
        new = np.concatenate([old[:cut], rng.integers(3, 211, int(rng.integers(4, 20))), old[cut + 10:]])
        out.append(Episode(id=f"syn/{t}/edit", task=f"syn/{t}", workload="syn-a" if t % 2 else "syn-b",
                           versions=(tuple(old.tolist()), tuple(new.tolist()))))
    return out


def test_end_to_end_profile_is_found_and_loads(engine, tmp_path):
    from patchkv_agent.calibration.config import CalibConfig
    from patchkv_agent.calibration.outputs import save_drift, save_rows, write_profile
    from patchkv_agent.calibration.profile import run_calibration

    eng = engine
    cfg = CalibConfig(kappas=(0.0, 0.05), blocks=(16, 32), ref_tokens=4, tau_grid=(0.05, 0.2), val_share=0.4,
                      policy_grid=((0.5, 4.0), (1.0, 8.0)))
    profile, pairs = run_calibration(eng, _episodes(), cfg, model_name="tiny-llama", command="pytest")
    path = write_profile(profile, tmp_path / "tiny-llama.json")
    rows_path = save_rows(profile, tmp_path / "tiny-llama.rows.jsonl")
    stages = [json.loads(x)["stage"] for x in rows_path.read_text().splitlines()]
    n_kept = data_pairs = len({r["pair"] for r in profile["_rows"]["grid"]})
    assert stages.count("grid") == 8 * n_kept and stages.count("window") == 2 * n_kept  # 2 x 2 x 2 readers
    assert stages.count("reference") == 2 * data_pairs and stages.count("precision") == 2 * n_kept
    npz = save_drift(pairs, tmp_path / "tiny-llama.drift.npz", profile)
    (tmp_path / "not-a-profile.json").write_text('{"hello": 1}')

    data = json.loads(path.read_text())
    assert "_rows" not in data
    for key in ("model", "fingerprint", "length_model", "kappa", "block_size", "precision_policy", "tau_v", "gamma",
                "quantile", "validation_coverage", "split", "command", "created"):
        assert key in data, key
    assert data["fingerprint"] == eng.spec.fingerprint and data["command"] == "pytest"
    assert data["kappa"] in (0.0, 0.05) and data["block_size"] in (16, 32)
    assert 0.0 <= data["validation_coverage"] <= 1.0
    assert not set(data["split"]["calib_tasks"]) & set(data["split"]["validation_tasks"])
    assert len(data["selection"]["summary"]) == 8 and data["readers"] in ("none", "lexical")
    sel = data["selection"]
    assert sel["grid_readers"] == ["none", "lexical"] and sel["n_follow_pairs"] == 0  # no gold answers here
    assert sel["chosen"]["follow_rate"] is None and sel["chosen"]["follow_target_met"] is None
    assert sel["target"] == "default" and sel["target_value"] >= 0.0  # no worse than the built-in setting
    assert set(sel["reference"]) == {"direct", "patchkv-default"}
    ws = data["window_selection"]
    assert data["tau_v"] == ws["chosen"]["tau_v"] in (0.05, 0.2) and len(ws["summary"]) == 2
    assert all(0.0 <= s["validation_coverage"] <= 1.0 for s in ws["summary"])
    assert {r["split"] for r in data["labels"]} == {"calib", "validation"}
    pol = data["precision_policy"]
    assert pol["calibrated"] is True and (pol["tau_L"], pol["tau_H"]) in ((0.5, 4.0), (1.0, 8.0))
    assert pol["block_size"] == data["block_size"] and len(pol["summary"]) == 2
    # the precision rows are real resumes: the FP16 restore KL is the direct reference's, per pair
    prec = profile["_rows"]["precision"]
    ref_direct = {r["pair"]: r["first_token_kl"] for r in profile["_rows"]["reference"] if r["strategy"] == "direct"}
    assert all(r["kl_fp16"] == pytest.approx(ref_direct[r["pair"]], rel=1e-6, abs=1e-12) for r in prec)

    found = load_profile(eng, dirs=[tmp_path])  # by fingerprint
    assert found is not None and found.match == "fingerprint" and found.path == str(path)
    assert load_profile(eng.spec.fingerprint, dirs=[tmp_path]).model == "tiny-llama"
    by_name = load_profile("tiny-llama", dirs=[tmp_path])
    assert by_name is not None and by_name.match == "name"
    assert load_profile("llama:0000", model_name="tiny-llama", dirs=[tmp_path]).match == "name"
    assert load_profile("llama:0000", dirs=[tmp_path]) is None
    lm = found.length_model
    assert isinstance(lm, LengthModel) and lm.quantile == 0.9
    assert (found.kappa, found.block_size) == (data["kappa"], data["block_size"])
    from patchkv_agent.engine import PatchKVEngine

    loaded = PatchKVEngine(eng.model, eng.tokenizer, profile=found)
    s = loaded.settings
    assert (s.precision_policy.tau_L, s.precision_policy.tau_H) == (pol["tau_L"], pol["tau_H"])
    assert (s.kappa, s.block_size, s.length_model) == (data["kappa"], data["block_size"], lm)
    assert loaded.profile_path == str(path) and loaded.settings_sources["kappa"] == f"profile {path}"
    z = np.load(npz)
    assert z["offsets"][-1] == z["deviation"].size and len(z["S"]) == data["data"]["n_spans"]


def test_select_policy_smallest_payload_meeting_the_target():
    from patchkv_agent.calibration.precision_stage import select_policy

    def row(w, tl, kl16, klm, pay):
        return {"pair": f"{w}{tl}", "workload": w, "tau_L": tl, "tau_H": 8.0, "alpha": 0.7, "g4": 0.15,
                "kl_fp16": kl16, "kl_mixed": klm, "payload_vs_fp16": pay}

    rows = [row("a", 0.5, 0.10, 0.11, 0.60), row("b", 0.5, 0.20, 0.21, 0.60),   # +10%, +5%: worst +10%
            row("a", 2.0, 0.10, 0.15, 0.45), row("b", 2.0, 0.20, 0.21, 0.45),   # worst +50%
            row("a", 1.0, 0.10, 0.118, 0.50), row("b", 1.0, 0.20, 0.22, 0.50)]  # worst +18%
    pick = select_policy(rows, 0.2)
    assert pick["tau_L"] == 1.0 and pick["target_met"] and pick["worst_increase"] == pytest.approx(0.18)
    assert select_policy(rows, 0.12)["tau_L"] == 0.5
    missed = select_policy(rows, 0.01)  # nobody meets it: the smallest worst increase, flagged
    assert missed["tau_L"] == 0.5 and missed["target_met"] is False
    with pytest.raises(ValueError):
        select_policy([], 0.2)


def test_calibrate_cli_parses_defaults():
    import argparse

    from patchkv_agent.calibration.cli import add_calibrate_cli, calibrate_main

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command")
    add_calibrate_cli(sub)
    args = ap.parse_args(["calibrate", "--workload", "hotpotqa-e", "--n", "3", "--kappas", "0,0.02", "--out", "x.json"])
    assert args.func is calibrate_main
    assert (args.n, args.kappas, args.blocks, args.quantile) == (3, (0.0, 0.02), (32, 64, 128), 0.9)
    assert len(args.tau_v) >= 2  # the tau_V stage runs by default
    # edit-following episodes join the calibration, and the chosen configuration must follow them
    assert args.follow_workloads.split(",") == ["follow-lookup", "follow-twohop", "follow-count", "follow-retract"]
    assert (args.follow_n, args.follow_target, args.readers) == (8, "0.95", "none,lexical")

    from patchkv_agent.calibration.cli import _parse_workloads

    assert _parse_workloads("hotpotqa-e, 2wikimqa-e:1800,", 1500) == {"hotpotqa-e": 1500, "2wikimqa-e": 1800}
    with pytest.raises(SystemExit):
        _parse_workloads("nq-e:many", 1500)

    from patchkv_agent.calibration.cli import _policy_grid
    from patchkv_agent.calibration.config import DEFAULT_POLICY_GRID

    assert args.precision_target == "0.2" and _policy_grid(args.policy_grid) == DEFAULT_POLICY_GRID
    assert _policy_grid("0.5:4,1:8") == ((0.5, 4.0), (1.0, 8.0))
    for bad in ("0.5-4", "4:1"):
        with pytest.raises(SystemExit, match="policy-grid"):
            _policy_grid(bad)


def test_packaged_profiles_are_valid():
    from patchkv_agent.profiles import iter_profiles, profile_dirs

    packaged = profile_dirs()[-1]
    assert packaged == SHIPPED_PROFILE_DIR and list(iter_profiles([packaged]))
    for path, data in iter_profiles([packaged]):
        prof = Profile.from_dict(data, path=path)
        assert prof.length_model.quantile == data["quantile"], path
        assert 0.0 <= prof.kappa <= 1.0 and prof.block_size >= 1


def test_read_profile_explicit_path_and_clear_errors(tmp_path):
    from patchkv_agent.profiles import read_profile

    shipped = SHIPPED_PROFILE_DIR / "smollm2-135m.json"
    prof = read_profile(shipped)
    assert (prof.path, prof.match) == (str(shipped), "explicit") and prof.block_size >= 1
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    for name in ("bad.json", "other.json", "absent.json"):
        with pytest.raises(ValueError, match="patchkv-agent calibrate"):
            read_profile(tmp_path / name)
    from patchkv_agent.profiles import resolve_profile_arg

    assert resolve_profile_arg("auto") == "auto" and resolve_profile_arg(None) == "auto"
    assert resolve_profile_arg("none") is None and resolve_profile_arg(str(shipped)).block_size == prof.block_size
    good = json.loads(shipped.read_text())
    for bad in ({"kappa": "0.1"}, {"kappa": float("nan")}, {"block_size": 2.5}, {"block_size": True},
                {"length_model": [1, 2]}, {"readers": 3}, {"precision_policy": {"tau_L": "x"}}, {"model": None}):
        (tmp_path / "hostile.json").write_text(json.dumps({**good, **bad}))
        with pytest.raises(ValueError, match="hostile.json is malformed"):
            read_profile(tmp_path / "hostile.json")
