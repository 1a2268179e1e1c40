"""MIDAS (MI §3.2, Alg. 1) on a tiny random model profiled on two built-in sets (code, prose)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moelab.engine.data.calibration import load_calibration
from moelab.engine.core.params import ConversionError
from moelab.engine.evaluation.metrics import load_cv_by_source
from moelab.engine.runtime.export import export_model, load_exported
from moelab.engine.core.lowrank import data_error, rank_for_ratio, whitening
from moelab.engine.methods import params_from_dict
from moelab.engine.methods.midas import (DENSE_RATIO, MidasParams, convert_midas, expert_rank, ffn_residual_ratios,
                                          surrogate_hidden_moment)
from moelab.engine.runtime.modeling_moelab import LowRankMoeFFN, build_layer_module
from moelab.engine.models import load_model
from moelab.engine.runtime.param_count import parameter_counts
from moelab.engine.profiling.store import StoredProfile, write_profile
from moelab.engine.profiling.profiler import ProfileSettings, profile_model

SETTINGS = ProfileSettings(max_tokens=64, batch_tokens=512, feature_tokens=256, hist_bins=11)
SETS = ("builtin:code", "builtin:prose")
D_MODEL, D_FFN, N_LAYERS = 64, 96, 3  # tests/conftest.py TINY


def make_profile(adapter, spec, data_dir, out, samples=16):
    cset = load_calibration(spec, samples=samples, data_dir=data_dir)
    return StoredProfile.open(write_profile(profile_model(adapter, cset, SETTINGS), cset, out))


@pytest.fixture(scope="module")
def profiles(tiny_model, data_dir, tmp_path_factory):
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    root = tmp_path_factory.mktemp("midas-prof")
    return [make_profile(adapter, s, data_dir, root / s.split(":")[1]) for s in SETS]


@pytest.fixture(scope="module")
def dense_weights(tiny_model, data_dir):
    """(gate, up, down) float64 weights per layer of the dense tiny model."""
    ref = load_model(str(tiny_model("llama")), data_dir=data_dir)
    return [tuple(w().detach().double() for w in (l.gate_weight, l.up_weight, l.down_weight)) for l in ref.layers]


@pytest.fixture
def fresh(tiny_model, data_dir):
    """A newly loaded dense tiny model: a conversion replaces its MLPs in place."""
    return load_model(str(tiny_model("llama")), data_dir=data_dir)


def glu(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def test_params_contract_and_paper_rank():
    p = MidasParams(keep_ratio=0.5, top_k=1, seed=3)
    assert MidasParams.from_dict(p.to_dict()) == p and params_from_dict(p.to_dict()) == p
    # MI §4.1: Llama-2-7B (d_ffn 11008, d_model 4096) at a 25% ratio is "rank 746".
    assert expert_rank(11008, 4096, 0.25) == 746
    assert expert_rank(D_FFN, D_MODEL, 1.0) == D_MODEL  # keep_ratio 1: exact, full rank
    bad = [
        (MidasParams(), 1, "at least 2"),
        (MidasParams(top_k=3), 2, "top_k"),
        (MidasParams(top_k=0), 2, "top_k"),
        (MidasParams(keep_ratio=0.0), 2, "keep_ratio"),
        (MidasParams(keep_ratio=1.5), 2, "keep_ratio"),
        (MidasParams(down="exact"), 2, "down"),
        (MidasParams(dense_layers="first"), 2, "dense_layers"),
        (MidasParams(dense_layers="0,-1"), 2, "dense_layers"),
    ]
    for params, n_sets, message in bad:
        with pytest.raises(ConversionError, match=message):
            params.validate(n_sets)
    with pytest.raises(ConversionError, match="unknown midas parameters: rank"):
        MidasParams.from_dict({"method": "midas", "rank": 4})


def test_full_rank_all_experts_reproduce_the_dense_ffn(fresh, profiles, dense_weights):
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    x = torch.randn(40, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense_logits = fresh.model(input_ids=ids).logits
    moe, record = convert_midas(fresh, profiles, MidasParams(keep_ratio=1.0, top_k=2))
    mods = moe.moe_modules()
    assert sorted(mods) == [0, 1, 2] and all(isinstance(m, LowRankMoeFFN) for m in mods.values())
    with torch.no_grad():
        for i, mod in mods.items():
            dense = glu(x, *(w.float() for w in dense_weights[i]))
            assert mod.rank == D_MODEL and mod.n_experts == 2
            for e in range(2):  # each expert alone is the dense FFN
                torch.testing.assert_close(mod.expert(e, x), dense, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mod(x), dense, rtol=1e-4, atol=1e-5)  # renormalised weights sum to 1
        torch.testing.assert_close(moe(input_ids=ids).logits, dense_logits, rtol=1e-4, atol=1e-4)
    assert max(max(map(max, row["gate_error"] + row["up_error"])) for row in record["layers"]) < 1e-6


def test_experts_specialise_on_their_own_set(fresh, profiles, dense_weights):
    moe, record = convert_midas(fresh, profiles, MidasParams(keep_ratio=0.25, top_k=1))
    r = rank_for_ratio(D_FFN, D_MODEL, 0.25)
    assert r == 9 and record["summary"]["ranks"] == [r] and record["summary"]["sets"] == ["code", "prose"]
    for row, (i, mod) in zip(record["layers"], sorted(moe.moe_modules().items())):
        assert row["rank"] == mod.rank == r
        assert row["jitter"] == [0.0, 0.0]  # ~1000 tokens in 64 dimensions: M is positive definite
        for kind in ("gate", "up"):
            err = np.asarray(row[f"{kind}_error"])
            # Each expert has the least error on its own calibration set: MIDAS's diversity.
            assert err[0, 0] < err[0, 1] and err[1, 1] < err[1, 0], (i, kind, err)
        # The recorded errors are those of the stored factors on each set's XᵀX.
        for e in range(2):
            approx = (mod.up_b[e] @ mod.up_a[e]).detach().double().numpy()
            for k, prof in enumerate(profiles):
                ours = data_error(dense_weights[i][1].numpy(), approx, prof.xtx(i))
                assert ours == pytest.approx(row["up_error"][e][k], rel=1e-4)
    s = record["summary"]
    assert s["mean_gate_error_own"] < s["mean_gate_error_other"] and s["mean_up_error_own"] < s["mean_up_error_other"]


def test_parameter_counts_in_the_record(fresh, profiles):
    before = parameter_counts(fresh.model)
    moe, record = convert_midas(fresh, profiles, MidasParams(keep_ratio=0.5, top_k=1))
    s = record["summary"]
    r = rank_for_ratio(D_FFN, D_MODEL, 0.5)
    dense_ffn = 3 * D_MODEL * D_FFN
    expert = 3 * r * (D_MODEL + D_FFN)  # three factor pairs
    router = 2 * D_MODEL
    assert (s["dense_total_params"], s["dense_active_params"]) == (before["total"], before["active"])
    assert s["total_params"] == before["total"] + N_LAYERS * (2 * expert + router - dense_ffn)
    assert s["active_params"] == before["active"] + N_LAYERS * (expert + router - dense_ffn)
    assert s["n_layers"] == N_LAYERS and s["method"] == "midas"
    assert record["params"] == MidasParams(keep_ratio=0.5, top_k=1).to_dict()
    assert {"factorise_s", "build_s", "total_s"} <= set(record["timings"])


def test_mismatched_or_duplicate_profiles_are_refused(tiny_model, data_dir, profiles, tmp_path, fresh):
    other_model = load_model(str(tiny_model("qwen3")), data_dir=data_dir)
    foreign = make_profile(other_model, "builtin:math", data_dir, tmp_path / "qwen", samples=4)
    with pytest.raises(ConversionError, match=r"different model .*family: 'llama' vs 'qwen3'"):
        convert_midas(fresh, [profiles[0], foreign], MidasParams())
    with pytest.raises(ConversionError, match="same calibration set"):
        convert_midas(fresh, [profiles[0], profiles[0]], MidasParams())
    with pytest.raises(ConversionError, match="at least 2"):
        convert_midas(fresh, profiles[:1], MidasParams(top_k=1))
    assert not any(isinstance(b.mlp, LowRankMoeFFN) for b in fresh.model.model.layers)  # nothing converted


def test_export_reload_identical_logits_and_load_cv_per_set(fresh, profiles, tmp_path, data_dir):
    moe, record = convert_midas(fresh, profiles, MidasParams(keep_ratio=0.5, top_k=1, seed=1))
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = moe(input_ids=ids).logits
    out = export_model(moe, tmp_path / "midas", fresh.tokenizer, record)
    loaded = load_exported(out).eval()
    assert [e["kind"] for e in loaded.config.moe_layers] == ["lowrank_moe"] * N_LAYERS
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, logits)
    # MI Eq. 7 per layer and per evaluation set, on each set's held-out text.
    cv = load_cv_by_source(loaded, fresh.tokenizer, list(SETS), data_dir, n_windows=2, seq_len=32)
    for source in SETS:
        assert sorted(cv[source]["load_cv"]) == ["0", "1", "2"]
        assert all(math.isfinite(v) and v >= 0 for v in cv[source]["load_cv"].values())
        assert all(sum(c) == 2 * 32 for c in cv[source]["load"].values())  # top_k = 1: one expert a token


def test_factors_are_projections_of_the_dense_map_and_balanced(fresh, profiles, dense_weights):
    """MI Eq. 2's rank-r map is U_r U_rᵀ W: on *any* input, seen in calibration or not, an expert's
    matrix cannot output more than the dense one (no blow-up off the calibration data), and the two
    stored factors split each component evenly (their scale does not grow with the token count)."""
    moe, _ = convert_midas(fresh, profiles, MidasParams(keep_ratio=0.25, top_k=2))
    x = 50.0 * torch.randn(500, D_MODEL, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for i, mod in moe.moe_modules().items():
        wg, wu, wd = dense_weights[i]
        for e in range(2):
            for kind, w, inp in (("gate", wg, x), ("up", wu, x), ("down", wd, x @ wg.T)):
                a, b = getattr(mod, f"{kind}_b")[e].detach().double(), getattr(mod, f"{kind}_a")[e].detach().double()
                approx = inp @ (a @ b).T
                assert (approx.norm(dim=-1) <= (inp @ w.T).norm(dim=-1) * (1 + 1e-4) + 1e-6).all(), (i, e, kind)
                torch.testing.assert_close(a.norm(dim=0), b.norm(dim=1), rtol=1e-4, atol=1e-6)


def test_plain_down_is_the_truncated_svd_of_w_down_for_every_set(fresh, profiles, dense_weights):
    """``down='plain'`` (module doc): every expert's down projection is W_down's own rank-r truncated
    SVD, U_r U_rᵀ W_down, the same for each set; no surrogate errors are recorded."""
    moe, record = convert_midas(fresh, profiles, MidasParams(keep_ratio=0.5, top_k=1, down="plain"))
    r = rank_for_ratio(D_FFN, D_MODEL, 0.5)
    for row, (i, mod) in zip(record["layers"], sorted(moe.moe_modules().items())):
        assert "down_error_surrogate" not in row and row["rank"] == r
        u = torch.linalg.svd(dense_weights[i][2], full_matrices=False)[0][:, :r]
        for e in range(2):
            got = (mod.down_b[e] @ mod.down_a[e]).detach().double()
            torch.testing.assert_close(got, u @ u.T @ dense_weights[i][2], rtol=1e-5, atol=1e-6)


def test_surrogate_samples_cover_the_hidden_width(fresh, profiles):
    """HᵀH is d_ffn × d_ffn: fewer Gaussian samples than neurons leave it singular, so a layer
    draws at least 2·d_ffn whatever surrogate_samples asks (16 here, d_ffn = 96)."""
    _, record = convert_midas(fresh, profiles, MidasParams(keep_ratio=0.5, top_k=1, down="surrogate",
                                                           surrogate_samples=16))
    for row in record["layers"]:
        assert row["surrogate_samples"] == 2 * D_FFN
        assert row["down_jitter"] == [0.0, 0.0]  # full rank: no jitter-dominated directions


def test_hidden_down_whitens_w_down_with_the_hidden_moment_of_each_sets_own_text(tiny_model, data_dir, profiles,
                                                                                 dense_weights):
    """``down='hidden'`` (the default; SVD-LLM on W_down's own input, as MI §3.2 applies it to every FFN matrix): each
    set's HᵀH is the one the dense model's own forward gives on the set's stored text (checked against a whole
    forward), and each expert's down projection is then the rank-r map of least error on it: no higher than the
    surrogate's or the plain SVD's there (Eckart–Young in the whitened space), lower in every layer."""
    from moelab.engine.core.fitting import collect_inputs, stored_token_windows
    from moelab.engine.methods.midas import HIDDEN_TOKENS, hidden_moments

    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    moments = list(hidden_moments(adapter, profiles))
    for j, p in enumerate(profiles):
        windows = stored_token_windows(adapter, p, min(int(p.manifest["n_tokens"]), HIDDEN_TOKENS), shorter=True)
        whole = collect_inputs(adapter, windows, keep_hidden=True)
        for i in range(N_LAYERS):
            h = whole.hidden[i].double()
            torch.testing.assert_close(moments[i][j], h.T @ h, rtol=1e-5, atol=1e-6 * float((h.T @ h).abs().max()))
    assert MidasParams().down == "hidden"
    errors = {}
    for down in ("hidden", "surrogate", "plain"):
        moe, record = convert_midas(load_model(str(tiny_model("llama")), data_dir=data_dir), profiles,
                                    MidasParams(keep_ratio=0.5, top_k=1, down=down, dense_layers="none"))
        if down == "hidden":
            assert all("down_error_hidden" in row and "surrogate_samples" not in row for row in record["layers"])
        errors[down] = [[data_error(dense_weights[i][2], (mod.down_b[j] @ mod.down_a[j]).detach(), moments[i][j])
                         for j in range(2)] for i, mod in sorted(moe.moe_modules().items())]
    for i in range(N_LAYERS):
        for j in range(2):
            assert errors["hidden"][i][j] <= min(errors["surrogate"][i][j], errors["plain"][i][j]) + 1e-9, (i, j)
            assert errors["hidden"][i][j] < errors["surrogate"][i][j], (i, j)


def test_a_layer_whose_ffn_outweighs_the_residual_stream_stays_dense(tiny_model, data_dir, profiles):
    """The first FFN of a real model is its token representation (SmolLM2-135M: output 16× the
    residual it is added to); approximating it corrupts every later layer's input, so
    dense_layers='auto' keeps such a layer dense (MI §3.2: the backbone keeps unconverted FFNs)."""
    def loud(layer=0, scale=300.0):
        adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
        with torch.no_grad():
            adapter.layers[layer].mlp.down_proj.weight.mul_(scale)
        return adapter

    adapter = loud()
    ratios = ffn_residual_ratios(adapter)
    assert ratios[0] > DENSE_RATIO > max(ratios[1:])
    x = torch.randn(2, 10, D_MODEL, generator=torch.Generator().manual_seed(2))
    dense_mlp = adapter.layers[0].mlp
    with torch.no_grad():
        y0 = dense_mlp(x)
    moe, record = convert_midas(adapter, profiles, MidasParams(keep_ratio=0.5, top_k=1))
    assert sorted(moe.moe_modules()) == [1, 2] and [row["layer"] for row in record["layers"]] == [1, 2]
    assert record["summary"]["dense_layers"] == [0] and record["summary"]["ffn_residual_ratio"] == pytest.approx(ratios)
    with torch.no_grad():
        assert torch.equal(moe.model.model.layers[0].mlp(x), y0)  # the dense MLP itself
    s = record["summary"]
    expert, router = 3 * rank_for_ratio(D_FFN, D_MODEL, 0.5) * (D_MODEL + D_FFN), 2 * D_MODEL
    assert s["active_params"] == s["dense_active_params"] + 2 * (expert + router - 3 * D_MODEL * D_FFN)  # layer 0 dense

    moe, record = convert_midas(loud(), profiles, MidasParams(keep_ratio=0.5, top_k=1, dense_layers="none"))
    assert sorted(moe.moe_modules()) == [0, 1, 2] and record["summary"]["dense_layers"] == []
    moe, record = convert_midas(loud(), profiles, MidasParams(keep_ratio=0.5, top_k=1, dense_layers="2"))
    assert sorted(moe.moe_modules()) == [0, 1] and record["summary"]["dense_layers"] == [2]
    with pytest.raises(ConversionError, match="beyond the model's 3 layers"):
        convert_midas(loud(), profiles, MidasParams(dense_layers="0,3"))
    with pytest.raises(ConversionError, match="nothing left to convert"):
        convert_midas(loud(), profiles, MidasParams(dense_layers="0,1,2"))


# --------------------------------------------------------------------------- runtime module


def random_lowrank(E=4, r=5, top_k=2, seed=0) -> LowRankMoeFFN:
    torch.manual_seed(seed)
    mod = LowRankMoeFFN({"kind": "lowrank_moe", "d_model": 16, "d_ffn": 24, "act": "silu", "n_experts": E,
                         "rank": r, "top_k": top_k})
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.4)
    return mod


def test_grouped_forward_matches_per_token_reference_and_records_routing():
    mod = random_lowrank()
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    seen = []
    mod.recorder = seen.append
    with torch.no_grad():
        y = mod(x)
    P = {n: p.detach().double() for n, p in mod.named_parameters()}
    ref = torch.zeros(21, 16, dtype=torch.float64)
    for t, v in enumerate(x.reshape(-1, 16).double()):  # naive loop over tokens, float64
        p = torch.softmax(P["router.weight"] @ v, -1)
        top = torch.topk(p, 2).indices
        for e in top:
            h = F.silu(P["gate_b"][e] @ (P["gate_a"][e] @ v)) * (P["up_b"][e] @ (P["up_a"][e] @ v))
            ref[t] += p[e] / p[top].sum() * (P["down_b"][e] @ (P["down_a"][e] @ h))
    torch.testing.assert_close(y.reshape(-1, 16).double(), ref, rtol=1e-5, atol=1e-6)
    assert seen[0].shape == (3, 7, 2) and int(seen[0].max()) < 4
    assert mod.active_param_count() == 4 * 16 + 2 * 3 * 5 * (16 + 24)


def test_spec_round_trip_and_gate_and_factors_are_trainable():
    mod = random_lowrank(top_k=3)
    again = build_layer_module(mod.spec)
    assert isinstance(again, LowRankMoeFFN) and again.spec == mod.spec
    again.load_state_dict(mod.state_dict())
    x = torch.randn(10, 16)
    assert torch.equal(again(x), mod(x))
    assert isinstance(mod.router, torch.nn.Linear)
    mod(x).pow(2).sum().backward()
    for name in ("router.weight", "gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
        assert mod.get_parameter(name).grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match="top_k"):
        LowRankMoeFFN({**mod.spec, "top_k": 5})


def test_surrogate_hidden_moment_is_gaussian_with_the_sets_second_moment():
    """With a linear 'activation' h_i = (g_i·x)(u_i·x); for x ~ N(0, C) Isserlis' theorem gives
    E[h_i h_j] = (g_i C u_i)(g_j C u_j) + (g_i C g_j)(u_i C u_j) + (g_i C u_j)(g_j C u_i)."""
    rng = np.random.default_rng(0)
    d, f, n_tokens = 6, 4, 500
    x = rng.normal(size=(n_tokens, d)) @ rng.normal(size=(d, d))
    m = x.T @ x
    wg, wu = rng.normal(size=(f, d)), rng.normal(size=(f, d))
    est = surrogate_hidden_moment(wg, wu, whitening(m), n_tokens, "linear", 400_000, seed=1)
    c = m / n_tokens
    gg, uu, gu = wg @ c @ wg.T, wu @ c @ wu.T, wg @ c @ wu.T
    exact = n_tokens * (np.diag(gu)[:, None] * np.diag(gu)[None, :] + gg * uu + gu * gu.T)
    np.testing.assert_allclose(est, exact, rtol=0.05, atol=0.02 * np.abs(exact).max())
