"""One router registry (``moelab/engine/runtime/moelab_routers.py``): the plan's cost, the runtime's
count and the multiply-adds the forward pass really performs are the same number for every router
kind × combine × top-k (0, 1, n_routed) × expert count; each kind's scores are its paper formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from moelab.engine.core.allocation import layer_cost, layer_plan, plan_flops_fraction, plan_macs
from moelab.engine.core.slicing import expert_rows, moe_from_dense
from moelab.engine.runtime.modeling_moelab import MoeFFN
from moelab.engine.runtime.moelab_routers import COMBINES, PARTITION_ROUTERS, ROUTERS, ffn_macs

D, M, D_SHARED, T = 16, 4, 8, 6


def _module(router: str, combine: str, E: int, k: int) -> MoeFFN:
    torch.manual_seed(E * 10 + k)
    gate, up = torch.randn(D_SHARED + E * M, D), torch.randn(D_SHARED + E * M, D)
    down = torch.randn(D, D_SHARED + E * M)
    extra = {"router_offset": torch.randn(E)} if router == "ridge" else {}
    mod = moe_from_dense(gate, up, down, "silu", torch.arange(D_SHARED), torch.arange(D_SHARED, D_SHARED + E * M).reshape(E, M),
                         k, router, combine, **extra)
    mod.experts_impl = "loop"  # the reference: its matmuls are exactly the expert work
    return mod


def _measured_macs(mod: MoeFFN) -> float:
    """Multiply-adds per token of one forward pass, counted by torch's FLOP counter (matmuls only:
    2 FLOPs a multiply-add)."""
    x = torch.randn(T, D)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        mod(x)
    return counter.get_total_flops() / 2 / T


@pytest.mark.parametrize("E", [1, 4, 7])
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_plan_cost_equals_runtime_cost_equals_the_work_done(router, combine, E):
    for k in sorted({0, 1, E}):
        row = layer_plan(0, D_SHARED + E * M, math.nan, M, D_SHARED // M, D_SHARED % M, E, k)
        mod = _module(router, combine, E, k)
        planned = plan_macs(row, router, D, combine)
        assert planned == mod.active_param_count() == ffn_macs(D, D_SHARED, E, M, k, router, combine), (k, planned)
        # the ridge router's offset: one addition per expert, counted as a multiply-add by the
        # parameter-count convention, which torch's counter (matmuls) does not see
        offset = E if router == "ridge" and k and not (k >= E and combine == "sum") else 0
        assert _measured_macs(mod) == planned - offset, (k, planned)
        assert plan_flops_fraction([row], router, D, combine) == pytest.approx(planned / (3 * D * row.d_ffn))


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_budget_unit_costs_add_up_to_the_layer_cost(router):
    """The budget plan buys routed experts at ``layer_cost``'s unit price on top of its fixed part:
    the same total as ``plan_macs`` for a layer that scores (0 < k < E)."""
    row = layer_plan(0, D_SHARED + 6 * M, math.nan, M, D_SHARED // M, 0, 6, 2)
    fixed, unit = layer_cost(row, router, D)
    assert fixed + 2 * unit == plan_macs(row, router, D)


def test_each_kind_scores_with_its_paper_formula():
    torch.manual_seed(0)
    x = torch.randn(T, D)
    mods = {r: _module(r, "sum", 4, 2) for r in ROUTERS}
    expect = {
        "centroid": x @ mods["centroid"].router_weight.T,  # EW Eq. 9
        "softmax": x @ mods["softmax"].router_weight.T,  # EW Eq. 11's logits
        "ridge": x @ mods["ridge"].router_weight.T + mods["ridge"].router_offset,
        "representative": F.silu(x @ mods["representative"].router_gate.T) * (x @ mods["representative"].router_up.T),  # CM Eq. 18
        "gate_mass": F.silu(x @ expert_rows(mods["gate_mass"])[0].reshape(-1, D).T).abs().reshape(T, 4, M).sum(-1),
    }
    assert expect.keys() == ROUTERS.keys()
    for r, mod in mods.items():
        scores, gate_act = ROUTERS[r].scores(mod, x)
        torch.testing.assert_close(scores, expect[r], rtol=1e-5, atol=1e-5, msg=r)
        assert (gate_act is not None) == (r == "gate_mass")


def test_registry_flags_drive_the_methods_and_exports():
    from moelab.engine.core.params import needs_fitting
    from moelab.engine.methods.cmoe import CMoEParams
    from moelab.engine.methods.expertweaver import ExpertWeaverParams
    from moelab.engine.runtime.native_export import NATIVE_ROUTERS

    assert set(PARTITION_ROUTERS) == {"gate_mass", "ridge"}
    assert set(NATIVE_ROUTERS) == {"centroid", "softmax"}
    for router in ("centroid", *PARTITION_ROUTERS):
        ExpertWeaverParams(router=router).check()
        assert needs_fitting(ExpertWeaverParams(router=router)) == ROUTERS[router].fitted
    for router in ("representative", *PARTITION_ROUTERS):
        CMoEParams(router=router).check()
    with pytest.raises(ValueError, match="unknown router"):
        MoeFFN({"kind": "moe", "d_model": D, "n_routed": 2, "expert_size": 2, "top_k": 1, "router": "nope"})
