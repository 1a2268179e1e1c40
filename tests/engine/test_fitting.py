"""The fitted router and the budget plan (core.fitting), and honest cost accounting (ffn_flops_fraction)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moelab.cli import main
from moelab.engine.core.allocation import plan_flops_fraction
from moelab.engine.core.fitting import (_curve_weights, budget_costs, collect_inputs, error_curve, fit_router, greedy_budget,
                                         layerwise_inputs, output_fisher, profile_token_windows, rank_sums, routed_hidden,
                                         skipped_means, skipped_means_at)
from moelab.engine.layer_calls import layer_list_name
from moelab.engine.runtime.moelab_routers import ROUTERS
from moelab.engine.core.params import ConversionError
from moelab.engine.core.slicing import moe_from_dense, partition_modules
from moelab.engine.methods import cmoe, expertweaver, get_method
from moelab.engine.methods.cmoe import CMoEParams
from moelab.engine.methods.expertweaver import ExpertWeaverParams
from moelab.engine.models import dense_weights, load_model
from moelab.engine.runs import run_profile
from moelab.engine.profiling.profiler import ProfileSettings
from moelab.engine.runtime.export import load_exported
from moelab.engine.runtime.modeling_moelab import MoeFFN
from moelab.engine.runtime.param_count import ffn_flops_fraction, ffn_macs_per_token

D_MODEL = 64


@pytest.fixture(scope="module")
def fitted(tiny_model, data_dir, tmp_path_factory):
    """A tiny llama profiled on built-in text (so the fit can reload it) and its calibration inputs."""
    model = str(tiny_model("llama"))
    prof = run_profile(model, "builtin:mixed", tmp_path_factory.mktemp("fit") / "p",
                       ProfileSettings(max_tokens=64, batch_tokens=512, atopk_k=8), samples=24, data_dir=data_dir)
    adapter = load_model(model, data_dir=data_dir)
    torch.manual_seed(0)
    calib = collect_inputs(adapter, torch.randint(0, 1000, (4, 64)))
    return model, adapter, prof, calib


def _built_fraction(adapter, rows, modules) -> float:
    """``ffn_flops_fraction`` of the built modules: a layer without one kept its dense MLP (a plan's whole layer)."""
    dense = [3 * adapter.d_model * r.d_ffn for r in rows]
    whole = sum(c for r, c in zip(rows, dense) if r.layer not in modules)
    return (sum(m.active_param_count() for m in modules.values()) + whole) / sum(dense)


def test_greedy_budget_buys_the_steepest_error_decrease_per_multiply_add():
    errors = [np.array([10.0, 4.0, 3.0, 2.5]), np.array([6.0, 5.0, 1.0, 0.0])]
    costs = [budget_costs(3, 1, None), budget_costs(3, 2, None)]
    # layer 0: gains 6, 1, 0.5 per expert of cost 1; layer 1: gains 0.5, 2, 0.5 per expert of cost 2:
    # layer 1's first expert alone is a poor buy, its first two together (1.25 per cost) a good one
    assert greedy_budget(errors, costs, budget=1) == [1, 0]
    assert greedy_budget(errors, costs, budget=3) == [3, 0]
    assert greedy_budget(errors, costs, budget=5) == [1, 2]
    assert greedy_budget(errors, costs, budget=100) == [3, 3]
    with pytest.raises(ConversionError):
        greedy_budget(errors, costs, budget=1, k_min=[1, 1])


def test_a_layer_at_every_expert_costs_the_whole_layer_and_a_cheaper_whole_layer_is_bought_first():
    """``budget_costs``: every expert selected is the layer written whole, at its own cost. A whole layer
    dearer than its experts (half the down rows saved) is bought only where its error pays for it; one
    no dearer than the step before it (it drops the router) is taken before any other expert."""
    errors = [np.array([10.0, 4.0, 3.0, 2.5]), np.array([6.0, 5.0, 1.0, 0.0])]
    dear = [budget_costs(3, 1, None), budget_costs(3, 2, 9)]
    assert dear[1].tolist() == [0, 2, 4, 9]
    assert greedy_budget(errors, dear, budget=7) == [3, 2]  # the whole layer (5 more for 1.0) does not pay
    assert greedy_budget(errors, dear, budget=12) == [3, 3]
    capped = budget_costs(4, 2, 9, max_share=0.5)  # past two of four experts only the whole layer is offered
    assert capped.tolist() == [0, 2, 4, np.inf, 9]
    assert budget_costs(4, 2, None, max_share=0.5).tolist() == [0, 2, 4, np.inf, np.inf]  # no whole layer: two at most
    assert greedy_budget([np.array([8.0, 4.0, 2.0, 1.0, 0.0])], [capped], budget=8) == [2]
    assert greedy_budget([np.array([8.0, 4.0, 2.0, 1.0, 0.0])], [capped], budget=9) == [4]
    # the speed guard's mask takes out the top-k it predicts slower than dense; none and the whole layer stay
    guarded = budget_costs(4, 2, 9, no_slower=np.array([False, True, False, True, False]))
    assert guarded.tolist() == [0, 2, np.inf, 6, 9]
    assert greedy_budget([np.array([8.0, 4.0, 2.0, 1.0, 0.0])], [guarded], budget=5) == [1]
    cheap = [budget_costs(3, 1, None), budget_costs(3, 2, 3)]  # the whole layer costs less than two experts
    # at two experts the budget is spent; the whole layer frees some of it, which buys layer 0's first expert
    assert greedy_budget(errors, cheap, budget=4, k_min=[0, 2]) == [1, 3]


def test_error_curve_is_the_brute_force_error_of_the_top_k_experts():
    torch.manual_seed(0)
    T, d, E, m = 40, 8, 4, 3
    x = torch.randn(T, d)
    g, u, dn = torch.randn(E * m, d), torch.randn(E * m, d), torch.randn(d, E * m)
    routed = np.arange(E * m).reshape(E, m)
    scores = torch.randn(T, E)
    w = torch.rand(T) + 0.5
    w_dim = torch.rand(T, d)  # per token and output dimension (plan_error="fisher")
    err = error_curve(x, g, u, dn, routed, scores, "silu", chunk=7)
    err_w = error_curve(x, g, u, dn, routed, scores, "silu", chunk=7, weights=w)
    err_dim = error_curve(x, g, u, dn, routed, scores, "silu", chunk=7, weights=w_dim)
    h = torch.nn.functional.silu(x @ g.T) * (x @ u.T)
    y = h @ dn.T
    for k in range(E + 1):
        top = scores.topk(k, dim=1).indices if k else torch.zeros(T, 0, dtype=torch.long)
        keep = torch.zeros(T, E).scatter_(1, top, 1.0).repeat_interleave(m, dim=1)
        sq = (y - (h * keep) @ dn.T) ** 2
        per_token = sq.sum(-1)
        assert err[k] == pytest.approx(float(per_token.sum()), rel=1e-4, abs=1e-6)
        assert err_w[k] == pytest.approx(float((per_token * w).sum()), rel=1e-4, abs=1e-6)
        assert err_dim[k] == pytest.approx(float((sq * w_dim).sum()), rel=1e-4, abs=1e-6)
    assert err[E] == pytest.approx(0, abs=1e-6) and np.all(np.diff(err) <= 1e-6)


def test_skipped_means_are_each_experts_mean_over_the_tokens_that_skip_it():
    torch.manual_seed(0)
    T, d, E, m, k = 50, 8, 5, 3, 2
    x = torch.randn(T, d)
    g, u, dn = torch.randn(E * m, d), torch.randn(E * m, d), torch.randn(d, E * m)
    routed = torch.randperm(E * m).reshape(E, m).numpy()
    scores = torch.randn(T, E)
    scores[:, 4] = 100.0  # every token selects expert 4: nobody skips it
    mu = skipped_means(x, g, u, dn, routed, scores, k, "silu")
    top = scores.topk(k, dim=1).indices.tolist()
    for e in range(E):
        idx = torch.as_tensor(routed[e])
        out = (torch.nn.functional.silu(x @ g[idx].T) * (x @ u[idx].T)) @ dn[:, idx].T  # [T, d]
        skipped = [t for t in range(T) if e not in top[t]]
        want = out[skipped].mean(0) if skipped else torch.zeros(d)
        assert np.allclose(mu[e], want.numpy(), atol=1e-5), e
    assert not mu[4].any()
    every = skipped_means(x, g, u, dn, routed, scores, 0, "silu")  # top-k 0: the plain mean of every expert
    assert np.allclose(every.sum(0), ((torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ dn.T).mean(0).numpy(), atol=1e-4)
    # one pass of rank sums gives the means at every top-k (the budget plan picks k after the fit)
    sums, counts = rank_sums(routed_hidden(x, g, u, routed, "silu"), scores)
    assert counts.sum(1).tolist() == [T] * E and counts.sum(0).tolist() == [T] * E
    for top_k in range(E + 1):
        assert np.allclose(skipped_means_at(sums, counts, top_k, dn, routed),
                           skipped_means(x, g, u, dn, routed, scores, top_k, "silu"), atol=1e-6), top_k


@pytest.mark.parametrize("top_k", [0, 2, 4])
def test_moe_ffn_adds_the_means_of_the_experts_a_token_skips(top_k):
    torch.manual_seed(1)
    gate, up, down = torch.randn(16, D_MODEL), torch.randn(16, D_MODEL), torch.randn(D_MODEL, 16)
    mu = torch.randn(4, D_MODEL)
    plain = moe_from_dense(gate, up, down, "silu", [], torch.arange(16).reshape(4, 4), top_k, "centroid")
    comp = moe_from_dense(gate, up, down, "silu", [], torch.arange(16).reshape(4, 4), top_k, "centroid", skip_mean=mu)
    picked = []
    plain.recorder = picked.append
    x = torch.randn(7, D_MODEL)
    with torch.no_grad():
        want = plain(x) + torch.stack([mu[[e for e in range(4) if e not in row]].sum(0) for row in picked[0].tolist()])
        assert torch.allclose(comp(x), want, atol=1e-4)
        comp.dispatch = "loop"
        assert torch.allclose(comp(x), want, atol=1e-4)
        again = MoeFFN(comp.spec)  # the spec says it, the state dict carries the means
        again.load_state_dict(comp.state_dict())
        assert torch.equal(again.skip_mean, mu) and torch.allclose(again(x), want, atol=1e-4)
    assert comp.active_param_count() == plain.active_param_count()  # additions, not multiply-adds
    with pytest.raises(ValueError, match=r"skip_mean must be \[n_routed=4, d_model=64\]"):
        moe_from_dense(gate, up, down, "silu", [], torch.arange(16).reshape(4, 4), 1, "centroid", skip_mean=mu[:2])


def test_compensation_lowers_the_error_at_the_same_cost(fitted):
    _, adapter, prof, calib = fitted
    out = {}
    for comp in ("none", "skipped_mean"):
        p = ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active", compensation=comp)
        rows, experts, modules, fit = partition_modules(adapter, prof, p, expertweaver.plan_for(prof, p),
                                                         expertweaver.layer_builder(prof, p), calib=calib)
        err = 0.0
        with torch.no_grad():
            for e, mod in zip(experts, modules.values()):
                x = calib.mlp_inputs[e.layer]
                err += float(((adapter.layers[e.layer].mlp(x) - mod(x)) ** 2).sum())
        out[comp] = (sum(m.active_param_count() for m in modules.values()), err, fit.get("compensation"))
    assert out["skipped_mean"][0] == out["none"][0] and out["skipped_mean"][2] == "skipped_mean"
    assert out["skipped_mean"][1] < 0.98 * out["none"][1], out


def test_compensation_needs_the_sum_combine():
    with pytest.raises(ConversionError, match="needs combine 'sum', not 'weighted'"):
        ExpertWeaverParams(compensation="skipped_mean", combine="weighted").check()
    with pytest.raises(ConversionError, match="needs combine 'sum'"):
        CMoEParams(compensation="skipped_mean", combine="weighted").check()


def test_ridge_router_is_the_regularised_least_squares_solution():
    torch.manual_seed(1)
    T, d, E, m = 200, 6, 3, 2
    x = torch.randn(T, d)
    g, u = torch.randn(E * m, d), torch.randn(E * m, d)
    routed = np.arange(E * m)[::-1].copy().reshape(E, m)
    fitted = ROUTERS["ridge"].fit(x, g[routed.reshape(-1)].reshape(E, m, d), u[routed.reshape(-1)].reshape(E, m, d),
                                  torch.nn.functional.silu, lam=0.1)
    w, b = fitted["router_weight"].numpy(), fitted["router_offset"].numpy()
    default = fit_router(x, "ridge", g, u, routed, "silu")  # what a conversion fits: the same, at LAMBDA
    assert default["router_weight"].shape == (E, d) and default["router_offset"].shape == (E,)
    h = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)).double().numpy()
    target = np.abs(h[:, routed.reshape(-1)]).reshape(T, E, m).sum(-1)
    xa = np.hstack([x.double().numpy(), np.ones((T, 1))])
    lam = 0.1 * np.trace(xa.T @ xa) / T
    sol = np.linalg.solve(xa.T @ xa + lam * np.eye(d + 1), xa.T @ target)
    np.testing.assert_allclose(w, sol[:-1].T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b, sol[-1], rtol=1e-4, atol=1e-5)


def test_moe_ffn_ridge_router_scores_with_its_offset():
    torch.manual_seed(2)
    gate, up, down = torch.randn(16, D_MODEL), torch.randn(16, D_MODEL), torch.randn(D_MODEL, 16)
    w, b = torch.randn(4, D_MODEL), torch.tensor([0.0, 100.0, 0.0, -100.0])
    mod = moe_from_dense(gate, up, down, "silu", [], torch.arange(16).reshape(4, 4), 1, "ridge",
                         router_weight=w, router_offset=b)
    picked = []
    mod.recorder = picked.append
    mod(torch.randn(5, D_MODEL) * 0.01)
    assert picked[0].reshape(-1).tolist() == [1] * 5  # the offset dominates tiny inputs
    assert mod.spec["router"] == "ridge" and mod.active_param_count() == 4 * (D_MODEL + 1) + 3 * D_MODEL * 4
    with pytest.raises(ValueError, match="router_offset"):
        moe_from_dense(gate, up, down, "silu", [], torch.arange(16).reshape(4, 4), 1, "ridge", router_weight=w)


@pytest.mark.parametrize("params", [
    ExpertWeaverParams(n_experts=8, sparsity=0.25),
    ExpertWeaverParams(n_experts=8, sparsity=0.5, router="gate_mass"),
    ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active"),
    ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active", compensation="skipped_mean"),
    CMoEParams(n_experts=8, shared=2, active=2),
    CMoEParams(n_experts=8, shared=1, active=3, router="gate_mass"),
    ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active", plan="budget", down_keep=0.5),
    ExpertWeaverParams(n_experts=8, sparsity=0.25, router="gate_mass", down_keep=0.3),
])
def test_the_planned_cost_is_what_the_built_modules_spend(fitted, params):
    _, adapter, prof, calib = fitted
    method = expertweaver if params.method == "expertweaver" else cmoe
    rows = method.plan_for(prof, params)
    rows, _, modules, _ = partition_modules(adapter, prof, params, rows, method.layer_builder(prof, params), calib=calib)
    built = _built_fraction(adapter, rows, modules)
    keep = getattr(params, "down_keep", 1.0)
    assert plan_flops_fraction(rows, params.router, adapter.d_model, down_keep=keep) == pytest.approx(built, rel=1e-12)
    assert all(getattr(m, "down_keep", 1.0) == keep for m in modules.values())


def test_down_keep_buys_more_experts_within_the_same_budget(fitted):
    """What ``down_keep`` saves on the down projections the budget plan spends on routed experts; the
    cost stays under the cap. The leading plan, made for the export layouts, refuses it."""
    _, adapter, prof, calib = fitted
    out = {}
    for keep in (1.0, 0.5):
        p = ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active", plan="budget",
                               down_keep=keep)
        rows, _, modules, fit = partition_modules(adapter, prof, p, expertweaver.plan_for(prof, p),
                                                  expertweaver.layer_builder(prof, p), calib=calib)
        assert _built_fraction(adapter, rows, modules) <= 0.5 + 1e-9
        out[keep] = sum(fit["budget"]["top_k"])
    assert out[0.5] > out[1.0]
    with pytest.raises(ConversionError, match="leading plan"):
        ExpertWeaverParams(sparsity=0.5, plan="leading", down_keep=0.5).check()


def test_the_budget_plan_writes_a_layer_whole_where_it_would_run_every_expert(fitted):
    """At a generous budget under ``down_keep`` some layers are worth every expert: those keep their dense
    MLP (exact, the dense GEMMs), are paid for in full, and every other layer leaves some expert out."""
    _, adapter, prof, calib = fitted
    p = ExpertWeaverParams(n_experts=8, sparsity=0.1, router="ridge", alpha_basis="active", plan="budget",
                           down_keep=0.5, compensation="skipped_mean")
    rows, experts, modules, fit = partition_modules(adapter, prof, p, expertweaver.plan_for(prof, p),
                                                     expertweaver.layer_builder(prof, p), calib=calib)
    whole = fit["budget"]["dense_layers"]
    assert whole and whole == [r.layer for r in rows if r.n_routed == 0 and r.d_shared == r.d_ffn]
    assert not set(whole) & set(modules)  # the dense MLP stays
    assert all(r.top_k < r.n_routed for r in rows if r.layer not in whole)
    built = _built_fraction(adapter, rows, modules)
    assert plan_flops_fraction(rows, "ridge", adapter.d_model, down_keep=0.5) == pytest.approx(built, rel=1e-12)
    assert built <= 0.9 + 1e-9
    assert fit["budget"]["top_k"] == [r.top_k for r in rows]


def test_a_routed_share_cap_writes_the_layers_worth_more_whole(fitted):
    _, adapter, prof, calib = fitted
    p = ExpertWeaverParams(n_experts=8, sparsity=0.25, router="ridge", alpha_basis="active", plan="budget",
                           down_keep=0.5, max_routed_share=0.5)
    rows, _, modules, fit = partition_modules(adapter, prof, p, expertweaver.plan_for(prof, p),
                                              expertweaver.layer_builder(prof, p), calib=calib)
    assert all(r.top_k <= r.n_routed // 2 for r in rows if r.layer in modules)
    assert plan_flops_fraction(rows, "ridge", adapter.d_model, down_keep=0.5) <= 0.75 + 1e-9
    with pytest.raises(ConversionError, match="max_routed_share 0.5 caps the budget plan"):
        ExpertWeaverParams(sparsity=0.5, max_routed_share=0.5).check()


def test_the_speed_guard_offers_only_the_top_k_this_machines_table_predicts_no_slower_than_dense(fitted, data_dir):
    """``speed_guard="machine"``: the budget plan reads the kernel table the profile measured here and offers each layer
    only the top-k predicted no slower than its dense FFN in every phase; the plan stays within budget, the record says
    what was offered and from which table. Without a table the record says the guard could not run."""
    from moelab.engine.core.speed_prediction import top_k_no_slower
    from moelab.engine.evaluation.speed_table import cached_table, model_info

    _, adapter, prof, calib = fitted
    table = cached_table(adapter.model, model_info(adapter, prof.manifest["model"]["source"]), data_dir)
    assert table is not None  # the fixture's profile measured it
    p = ExpertWeaverParams(n_experts=8, sparsity=0.25, router="ridge", alpha_basis="active", plan="budget",
                           down_keep=0.5, speed_guard="machine")
    rows, _, modules, fit = partition_modules(adapter, prof, p, expertweaver.plan_for(prof, p),
                                              expertweaver.layer_builder(prof, p), data_dir=data_dir, calib=calib)
    guard = fit["speed_guard"]
    assert guard["applied"] and guard["machine"] == table["machine"] and guard["measured_at"] == table["measured_at"]
    for row, offered in zip(rows, guard["top_k_offered"]):
        if row.layer in modules:  # a MoE layer runs a top-k the table predicts no slower than dense
            layout = {"kind": "moe", "d_shared": row.d_shared, "n_routed": row.n_routed, "expert_size": row.d_expert,
                      "down_keep": 0.5}
            assert row.top_k in offered
            # the plan starts every layer from its shared part alone, so top-0 is offered even where the table (on a
            # slow or busy machine) predicts it slower than dense
            assert offered == sorted({0} | {int(k) for k in np.flatnonzero(top_k_no_slower(table, layout))})
    assert plan_flops_fraction(rows, "ridge", adapter.d_model, down_keep=0.5) <= 0.75 + 1e-9
    # with a margin, each layer is offered only the top-k predicted at most 0.9 of its dense FFN's time, and says so
    held = replace(p, speed_margin=0.1)
    rows_m, _, modules_m, fit_m = partition_modules(adapter, prof, held, expertweaver.plan_for(prof, held),
                                                    expertweaver.layer_builder(prof, held), data_dir=data_dir, calib=calib)
    margin = fit_m["speed_guard"]
    assert margin["margin"] == 0.1 and "0.90× the dense FFN's time (a 10% margin" in margin["note"]
    for row, offered, wider in zip(rows_m, margin["top_k_offered"], guard["top_k_offered"]):
        layout = {"kind": "moe", "d_shared": row.d_shared, "n_routed": row.n_routed, "expert_size": row.d_expert,
                  "down_keep": 0.5}
        assert offered == sorted({0} | {int(k) for k in np.flatnonzero(top_k_no_slower(table, layout, 0.1))})
        assert set(offered) <= set(wider) and (row.layer not in modules_m or row.top_k in offered)
    *_, unguarded = partition_modules(adapter, prof, p, expertweaver.plan_for(prof, p),
                                      expertweaver.layer_builder(prof, p), calib=calib)  # no data dir: no table
    assert not unguarded["speed_guard"]["applied"] and "no kernel timings" in unguarded["speed_guard"]["note"]
    with pytest.raises(ConversionError, match="speed_guard 'machine' chooses among the budget plan's top-k"):
        ExpertWeaverParams(sparsity=0.5, speed_guard="machine").check()


def test_the_budget_plan_at_the_paper_plans_cost_has_no_more_calibration_error(fitted):
    _, adapter, prof, calib = fitted
    paper = ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active")
    paper_cost = plan_flops_fraction(expertweaver.plan_for(prof, paper), "ridge", adapter.d_model)
    budget = ExpertWeaverParams(n_experts=8, sparsity=1 - paper_cost, router="ridge", alpha_basis="active", plan="budget")
    out = {}
    for name, p in (("paper", paper), ("budget", budget)):
        rows = expertweaver.plan_for(prof, p)
        rows, experts, modules, fit = partition_modules(adapter, prof, p, rows, expertweaver.layer_builder(prof, p),
                                                         calib=calib)
        cost = _built_fraction(adapter, rows, modules)
        err = 0.0
        for layer, mod in modules.items():  # a layer written whole has no module and no error
            x = calib.mlp_inputs[layer]
            with torch.no_grad():
                dense = adapter.layers[layer].mlp(x)
                err += float((((dense - mod(x)) ** 2).sum(-1) / calib.residual_sq[layer]).mean())
        out[name] = (cost, err, [r.top_k for r in rows], fit)
    assert out["budget"][0] <= paper_cost + 1e-9 and out["paper"][0] == pytest.approx(paper_cost)
    assert out["budget"][1] <= out["paper"][1] * 1.0001  # greedy over the same error it is measured by
    assert out["budget"][2] != out["paper"][2]  # the plan did move experts between layers
    assert out["budget"][3]["budget"]["top_k"] == out["budget"][2]


def test_recipe_best_from_the_cli_records_its_cost_and_the_export_reloads(fitted, tmp_path, monkeypatch, data_dir):
    _, _, prof, _ = fitted
    monkeypatch.setenv("MOELAB_DATA_DIR", str(data_dir))
    from moelab.settings import get_settings

    get_settings.cache_clear()
    out = tmp_path / "c"
    # the speed guard off: this machine runs no top-k of the tiny model's 8 experts as fast as its dense FFN, so the
    # recipe with its guard writes every layer whole or shared-only (below); the subject here is what the recipe saves
    args = ["convert", "--profile", str(prof.path), "--recipe", "best", "--sparsity", "0.5", "--n-experts", "8",
            "--fit-tokens", "512", "--json", "--quiet"]
    res = CliRunner().invoke(main, [*args, "--speed-guard", "none", "--out", str(out)])
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout)
    guarded = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "guarded")])
    get_settings.cache_clear()
    assert guarded.exit_code == 0, guarded.output
    g = json.loads(guarded.stdout)
    guard = g["fit"]["speed_guard"]
    assert guard["applied"] and g["summary"]["speed_guard"] == guard["note"]
    assert all(k == 0 or k in offered for k, offered in zip(g["fit"]["budget"]["top_k"], guard["top_k_offered"]))
    assert g["summary"]["ffn_flops_fraction"] <= 0.5 + 1e-9
    assert record["params"]["router"] == "ridge" and record["params"]["plan"] == "budget"
    assert record["params"]["alpha_basis"] == "active" and record["params"]["compensation"] == "skipped_mean"
    model = load_exported(out)
    moes = [m for m in model.moe_modules().values() if 0 < m.top_k < m.n_routed]
    assert moes and all(m.compensated and m.skip_mean.abs().sum() > 0 for m in moes)  # the means were saved and reloaded
    dense = prof.manifest["model"]["n_ffn_parameters"]
    assert record["summary"]["ffn_flops_fraction"] == pytest.approx(ffn_flops_fraction(model, dense))
    assert record["summary"]["ffn_flops_fraction"] <= 0.5
    assert sum(ffn_macs_per_token(model)) <= 0.5 * dense
    assert record["fit"]["fit_source"] == "builtin:mixed" and record["fit"]["fit_tokens"] >= 256


def test_an_unknown_recipe_is_refused_with_the_known_ones():
    with pytest.raises(ConversionError, match="paper, best"):
        get_method("expertweaver").recipe("fastest")
    res = CliRunner().invoke(main, ["convert", "--profile", "x", "--recipe", "fastest", "--out", "y"])
    assert res.exit_code == 2


def test_paper_recipe_is_the_defaults():
    assert get_method("expertweaver").recipe("paper") == ExpertWeaverParams()
    assert get_method("cmoe").recipe("paper", active=3) == CMoEParams(active=3)


def test_collect_inputs_with_replaced_mlps_reads_what_the_converted_layers_produce(fitted):
    _, adapter, prof, calib = fitted
    params = ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active")
    rows = expertweaver.plan_for(prof, params)
    _, _, modules, _ = partition_modules(adapter, prof, params, rows, expertweaver.layer_builder(prof, params), calib=calib)
    torch.manual_seed(0)
    windows = torch.randint(0, 1000, (4, 64))
    dense = collect_inputs(adapter, windows)
    converted = collect_inputs(adapter, windows, replaced=modules)
    first = min(modules)
    # up to the first converted layer the inputs are the dense model's; after it, the converted model's own
    assert torch.equal(converted.mlp_inputs[first], dense.mlp_inputs[first])
    assert not torch.allclose(converted.mlp_inputs[first + 1], dense.mlp_inputs[first + 1])
    assert all(adapter.layers[i].block.mlp is adapter.layers[i].mlp for i in modules)  # the dense model is given back
    from moelab.engine.evaluation.metrics import swapped_mlps

    with swapped_mlps(adapter, modules):
        from_model = collect_inputs(adapter, windows, replaced=modules)
    assert torch.equal(from_model.mlp_inputs[first + 1], converted.mlp_inputs[first + 1])


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_the_layer_by_layer_pass_reads_the_same_numbers_as_the_whole_forward(tiny_model, data_dir, family):
    """``layerwise_inputs`` runs each decoder layer over every batch with the arguments the model's own forward gave
    it (Gemma 3: alternating sliding and full attention; Phi-3: a fused gate and up projection): every layer's MLP
    inputs, residual norms and hidden activations are the whole forward's, bit for bit, and the hidden activations
    are the MLP's own act(g·x)·(u·x)."""
    adapter = load_model(str(tiny_model(family)), data_dir=data_dir)
    torch.manual_seed(0)
    windows = torch.randint(0, 1000, (6, 64))
    whole = collect_inputs(adapter, windows, batch=4, keep_hidden=True)
    seen = []
    for inputs in layerwise_inputs(adapter, windows, batch=4):
        i = inputs.index
        seen.append(i)
        assert torch.equal(inputs.x, whole.mlp_inputs[i]) and torch.equal(inputs.residual_sq, whole.residual_sq[i])
        assert torch.equal(inputs.hidden, whole.hidden[i])
        gate_w, up_w, _ = (w.float() for w in dense_weights(adapter, i))
        torch.testing.assert_close(inputs.hidden, routed_hidden(inputs.x, gate_w, up_w, np.arange(gate_w.shape[0])[None],
                                                                adapter.activation), rtol=1e-4, atol=1e-5)
    assert seen == list(range(adapter.n_layers))
    assert all(lay.block.mlp is lay.mlp for lay in adapter.layers)  # the model is as it was
    assert type(adapter.decoder().get_submodule(layer_list_name(adapter))[0]) is type(adapter.layers[0].block)


def test_a_fit_on_kept_inputs_is_the_fit_the_cli_makes(fitted, data_dir):
    """A benchmark fits many conversions on one ``collect_inputs(..., keep_hidden=True)``; the CLI's fit runs its
    own layer-by-layer pass and takes each layer's hidden activations from it: the same routers, plan and means,
    bit for bit. Without the kept activations they are computed again, the same to float rounding."""
    _, adapter, prof, _ = fitted
    params = ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active", plan="budget",
                                compensation="skipped_mean", fit_tokens=256)
    rows = expertweaver.plan_for(prof, params)
    build = expertweaver.layer_builder(prof, params)
    windows = profile_token_windows(adapter, prof, params.fit_tokens, data_dir)

    def fit(calib):
        _, experts, _, record = partition_modules(adapter, prof, params, rows, build, data_dir=data_dir, calib=calib)
        return [(e.top_k, {k: np.asarray(v) for k, v in e.router_weights.items()}) for e in experts], record

    own, own_record = fit(None)
    kept, kept_record = fit(collect_inputs(adapter, windows, keep_hidden=True))
    again, _ = fit(collect_inputs(adapter, windows))
    assert own_record == kept_record and own_record["fit_tokens"] == windows.numel()
    for (k0, w0), (k1, w1), (k2, w2) in zip(own, kept, again):
        assert k0 == k1 and w0.keys() == w1.keys() == w2.keys()
        assert all(np.array_equal(w0[name], w1[name]) for name in w0)
        assert all(np.allclose(w0[name], w2[name], rtol=1e-3, atol=1e-5) for name in w0)


def test_refit_on_the_converted_inputs_changes_only_the_fits_and_keeps_the_plan(fitted, data_dir):
    _, adapter, prof, calib = fitted
    base = ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active", plan="budget",
                              compensation="skipped_mean", fit_tokens=256)
    refit = replace(base, refit="converted_inputs")
    rows = expertweaver.plan_for(prof, base)
    r0, e0, m0, f0 = partition_modules(adapter, prof, base, rows, expertweaver.layer_builder(prof, base), data_dir=data_dir)
    r1, e1, m1, f1 = partition_modules(adapter, prof, refit, rows, expertweaver.layer_builder(prof, refit), data_dir=data_dir)
    assert [e.top_k for e in e0] == [e.top_k for e in e1] and f1["refit"] == "converted_inputs" and "refit" not in f0
    first = min(i for i, e in enumerate(e0) if len(e.routed))
    # the first routed layer sees the dense inputs either way: its fit is the same; a later one is fitted anew
    assert np.allclose(e0[first].router_weights["router_weight"], e1[first].router_weights["router_weight"], atol=1e-5)
    later = [i for i, e in enumerate(e0) if len(e.routed) and i > first]
    assert later and not np.allclose(e0[later[-1]].router_weights["router_weight"], e1[later[-1]].router_weights["router_weight"])
    assert "skip_mean" in e1[later[-1]].router_weights
    with pytest.raises(ConversionError, match="refit 'converted_inputs'"):
        ExpertWeaverParams(refit="converted_inputs").check()  # the paper's centroid router has nothing to refit


def test_output_fisher_is_the_squared_gradient_of_the_loss_by_finite_differences(tiny_model, data_dir):
    """Each entry is (∂L/∂y)² for the MLP output y of one token and dimension, L the summed next-token
    loss; checked by central differences on a few entries of three layers, the paths through the
    later layers' MLPs included."""
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir, dtype="float32")
    adapter.model.double()
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (2, 12))
    flags = [p.requires_grad for p in adapter.model.parameters()]
    fisher = output_fisher(adapter, ids, batch=1)
    assert [p.requires_grad for p in adapter.model.parameters()] == flags  # the weights' flags are restored
    assert set(fisher) == {lay.index for lay in adapter.layers}
    assert fisher[0].shape == (24, adapter.d_model) and fisher[0].dtype == torch.float32

    def loss(layer, delta):
        hook = adapter.layers[layer].mlp.register_forward_hook(lambda _m, _a, out: out + delta)
        try:
            with torch.no_grad():
                logits = adapter.model(input_ids=ids, use_cache=False).logits
            return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        finally:
            hook.remove()

    eps = 1e-3  # the RMS norms compute in float32 even in a float64 model: a smaller step is rounding noise
    for layer in (0, adapter.n_layers // 2, adapter.n_layers - 1):
        for b, t, i in ((0, 3, 5), (1, 11, 0), (1, 0, 7)):
            delta = torch.zeros(2, 12, adapter.d_model, dtype=torch.float64)
            delta[b, t, i] = eps
            g = (loss(layer, delta) - loss(layer, -delta)) / (2 * eps)
            assert float(fisher[layer][b * 12 + t, i]) == pytest.approx(g * g, rel=1e-3, abs=1e-10)


@pytest.mark.parametrize("plan_error", ["output", "fisher"])
def test_the_plan_errors_keep_the_cost_and_record_what_they_weighed(fitted, data_dir, plan_error):
    _, adapter, prof, calib = fitted
    base = ExpertWeaverParams(n_experts=8, sparsity=0.5, router="ridge", alpha_basis="active", plan="budget",
                              compensation="skipped_mean", fit_tokens=256)
    other = replace(base, plan_error=plan_error)
    rows = expertweaver.plan_for(prof, base)
    r0, e0, m0, f0 = partition_modules(adapter, prof, base, rows, expertweaver.layer_builder(prof, base), data_dir=data_dir)
    r1, e1, m1, f1 = partition_modules(adapter, prof, other, rows, expertweaver.layer_builder(prof, other), data_dir=data_dir)
    d = adapter.d_model
    assert plan_flops_fraction(r1, "ridge", d) <= 0.5 + 1e-9
    assert plan_flops_fraction(r1, "ridge", d) == pytest.approx(plan_flops_fraction(r0, "ridge", d), abs=0.05)
    assert (f0["budget"]["plan_error"], f1["budget"]["plan_error"]) == ("residual", plan_error)
    assert f1["budget"]["error_at_k"] != f0["budget"]["error_at_k"]  # another quantity was equalised
    assert [e.top_k for e in e1] == f1["budget"]["top_k"]


def test_a_plan_error_without_a_plan_that_uses_it_is_refused(tmp_path):
    with pytest.raises(ConversionError, match="plan_error 'fisher'.*use plan 'budget'"):
        ExpertWeaverParams(plan_error="fisher").check()
    ExpertWeaverParams(plan="budget", router="ridge", plan_error="fisher").check()
    result = CliRunner().invoke(main, ["convert", "--profile", str(tmp_path), "--method", "expertweaver",
                                       "--plan-error", "output", "--out", str(tmp_path / "c")])
    assert result.exit_code != 0 and "plan_error 'output'" in result.output


def test_the_output_plan_weighs_each_token_by_the_dense_mlps_own_output(fitted):
    _, adapter, _, calib = fitted
    tokens, weights = _curve_weights(adapter, calib.n_tokens, calib.windows, "output")
    for layer in (0, adapter.n_layers - 1):
        with torch.no_grad():
            y = adapter.layers[layer].mlp(calib.mlp_inputs[layer][tokens])  # the model's own module
        assert torch.allclose(weights(calib.layer(layer)), 1 / y.pow(2).sum(-1), rtol=1e-4)


def test_the_residual_plan_weighs_a_normed_mlp_output_as_it_reaches_the_stream(tiny_model, data_dir):
    """Gemma 3 renormalises the MLP output before the residual add: the plan's weights must give, to first
    order, the error that reaches the stream (an error across y: along y the norm removes it), and must not
    change when the MLP output is scaled (the model's function does not: that mistake starved every layer
    whose output happened to be small)."""
    adapter = load_model(str(tiny_model("gemma3_text")), data_dir=data_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for lay in adapter.layers:
            lay.post_norm.weight.copy_(torch.randn(D_MODEL))
            lay.down_proj.weight.mul_(100.0)  # MLP outputs far above the norm's ε, as in real models
    calib = collect_inputs(adapter, torch.randint(0, 1000, (4, 64)))
    tokens, weights = _curve_weights(adapter, calib.n_tokens, calib.windows, "residual")
    layer = 1
    lay = adapter.layers[layer]
    w = weights(calib.layer(layer))
    assert w.shape == (len(tokens), D_MODEL)
    with torch.no_grad():
        y = lay.mlp(calib.mlp_inputs[layer][tokens])
        r = torch.randn_like(y)
        e = 1e-3 * (r - (r * y).sum(-1, keepdim=True) / y.pow(2).sum(-1, keepdim=True) * y) * y.norm(dim=-1, keepdim=True) / r.norm(dim=-1, keepdim=True)
        reached = (lay.post_norm(y + e) - lay.post_norm(y)).pow(2).sum(-1) / calib.residual_sq[layer][tokens]
        torch.testing.assert_close((w * e.pow(2)).sum(-1), reached, rtol=2e-2, atol=0)
        lay.down_proj.weight.mul_(50.0)
    torch.testing.assert_close(weights(calib.layer(layer)), w / 50.0 ** 2, rtol=1e-4, atol=0)
    llama = load_model(str(tiny_model("llama")), data_dir=data_dir)
    llama_calib = collect_inputs(llama, torch.randint(0, 1000, (2, 64)))
    toks, plain = _curve_weights(llama, llama_calib.n_tokens, llama_calib.windows, "residual")
    assert torch.equal(plain(llama_calib.layer(0)), 1 / llama_calib.residual_sq[0][toks].clamp_min(1e-12))  # no norm: per token, as before
