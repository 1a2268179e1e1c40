"""ExpertWeaver's leading plan and ``--recipe portable`` (issue 25 item 2): one shared count, one top-k,
dense layers only in front, within the FFN budget, and a recovered conversion that exports natively."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moelab.cli import main
from moelab.engine.core.allocation import is_dense, plan_flops_fraction
from moelab.engine.core.fitting import collect_inputs, leading_choice
from moelab.engine.core.params import ConversionError, needs_fitting
from moelab.engine.core.slicing import partition_modules
from moelab.engine.methods import expertweaver, get_method
from moelab.engine.methods.expertweaver import ExpertWeaverParams, prepare_recovery
from moelab.engine.models import load_model
from moelab.engine.profiling.profiler import ProfileSettings
from moelab.engine.runs import run_profile
from moelab.engine.runtime.export import export_model
from moelab.engine.runtime.gguf_export import gguf_layout
from moelab.engine.runtime.modeling_moelab import MoelabForCausalLM, layer_spec
from moelab.engine.runtime.native_export import native_layout
from moelab.engine.training.finetune import load_tokenizer, routed_modules

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def fitted(tiny_model, data_dir, tmp_path_factory):
    """A tiny llama (4 layers) profiled on built-in text (the fit reloads it) and its calibration inputs."""
    model = str(tiny_model("llama"))
    prof = run_profile(model, "builtin:mixed", tmp_path_factory.mktemp("lead") / "p",
                       ProfileSettings(max_tokens=64, batch_tokens=512, atopk_k=8), samples=24, data_dir=data_dir)
    adapter = load_model(model, data_dir=data_dir)
    torch.manual_seed(0)
    return adapter, prof, collect_inputs(adapter, torch.randint(0, 1000, (4, 64)))


def test_leading_choice_is_the_least_error_option_within_the_budget():
    # 3 layers, k = 0 … 2; layer 0 is poor at every k, so keeping it dense pays off once the budget allows.
    # Options (L, k): cost 8·L + Σ_{ℓ≥L} (2 + 2k), error Σ_{ℓ≥L} errors[ℓ, k]:
    # (0,1) 12 / 8, (0,2) 18 / 5, (1,1) 16 / 2, (1,2) 20 / 0, (2,1) 20 / 1, (2,2) 22 / 0
    errors = np.array([[9.0, 6.0, 5.0], [3.0, 1.0, 0.0], [3.0, 1.0, 0.0]])
    moe = np.array([[2.0, 4.0, 6.0]] * 3)
    dense = np.full(3, 8.0)
    assert leading_choice(errors, moe, dense, 12.0) == (0, 1)
    assert leading_choice(errors, moe, dense, 18.0) == (1, 1)  # not (0, 2): more experts everywhere, more error
    assert leading_choice(errors, moe, dense, 22.0) == (1, 2)  # (2, 2) has the same error at a higher cost
    with pytest.raises(ConversionError, match="no leading plan fits the budget"):
        leading_choice(errors, moe, dense, 11.0)  # (0, 0) would fit, but k = 0 is no MoE layer
    flat = np.zeros((3, 3))
    assert leading_choice(flat, np.full((3, 3), 8.0), dense, 24.0) == (0, 1)  # all tie: no dense layer, fewest experts


def test_recipe_portable_resolves_and_is_fitted():
    p = get_method("expertweaver").recipe("portable", sparsity=0.5)
    assert (p.plan, p.compensation, p.combine, p.sparsity) == ("leading", "none", "sum", 0.5)
    assert needs_fitting(p) and p.flops_budget() == 0.5
    assert "portable" in get_method("expertweaver").describe()["recipes"]


@pytest.mark.parametrize(("d_ffn", "n_experts", "multiple", "count"), [
    (1536, 12, 64, 12), (1536, 16, 64, 12), (1536, 16, 1, 16),  # the default model: 16 of 96 would leave 32 per row
    (2048, 12, 64, 16), (4864, 12, 64, 19), (14336, 12, 64, 14),  # Gemma 3 270M, Qwen2.5-0.5B, Llama-3 8B
    (96, 8, 64, 8)])  # no count fits: as given
def test_expert_count_splits_d_ffn_into_whole_steps(d_ffn, n_experts, multiple, count):
    assert expertweaver.expert_count(d_ffn, n_experts, multiple) == count
    if count != n_experts:
        assert d_ffn % count == 0 and (d_ffn // count) % multiple == 0


def test_the_portable_recipe_plans_experts_a_multiple_of_64_wide_and_says_so():
    rng = np.random.default_rng(0)
    cv = [rng.gamma(2.0, 0.4, 1536) for _ in range(4)]
    rows = expertweaver.plan(cv, get_method("expertweaver").recipe("portable", sparsity=0.5))
    assert {(r.d_expert, r.n_shared + r.n_routed) for r in rows} == {(128, 12)}
    assert all(r.note.startswith("12 experts of 128 neurons (n_experts 12, width a multiple of 64)") for r in rows)
    rows = expertweaver.plan(cv, get_method("expertweaver").recipe("portable", sparsity=0.5, n_experts=16))
    assert {(r.d_expert, r.n_shared + r.n_routed) for r in rows} == {(128, 12)} and "(n_experts 16," in rows[0].note
    rows = expertweaver.plan(cv, get_method("expertweaver").recipe("portable", sparsity=0.5, n_experts=16, width_multiple=1))
    assert {(r.d_expert, r.n_shared + r.n_routed) for r in rows} == {(96, 16)} and "width" not in rows[0].note
    tiny = expertweaver.plan([c[:96] for c in cv], get_method("expertweaver").recipe("portable", sparsity=0.5, n_experts=8))
    assert tiny[0].d_expert == 12 and tiny[0].note.startswith("no expert count splits d_ffn 96 into experts a multiple of 64")
    labels = expertweaver._label({"n_experts": 12, "width_multiple": 64}), expertweaver._label({"n_experts": 12})
    assert labels[0][0] == "12 experts (widths ×64)" and labels[1][0] == "12 experts"


@pytest.mark.parametrize("sparsity", [0.25, 0.5])
def test_leading_plan_is_uniform_with_dense_layers_only_in_front_within_the_budget(fitted, sparsity):
    adapter, prof, calib = fitted
    p = get_method("expertweaver").recipe("portable", n_experts=8, sparsity=sparsity)
    start = expertweaver.plan_for(prof, p)
    assert len({(r.n_shared, r.n_routed, r.top_k, r.d_expert) for r in start}) == 1  # the numpy preview: uniform
    rows, experts, modules, fit = partition_modules(adapter, prof, p, start, expertweaver.layer_builder(prof, p), calib=calib)
    L, k = fit["leading"]["dense_layers"], fit["leading"]["top_k"]
    assert [is_dense(r) for r in rows] == [i < L for i in range(len(rows))] and L < len(rows)
    assert L >= 1 or sparsity == 0.5  # on this model a dense first layer is worth its cost at 0.75, not at 0.5
    assert {(r.n_shared, r.n_routed, r.top_k, r.d_shared) for r in rows[L:]} == {(start[0].n_shared, start[0].n_routed, k,
                                                                                   start[0].d_shared)}
    assert k >= 1 and sorted(modules) == list(range(L, len(rows)))  # dense layers keep the dense MLP
    cost = plan_flops_fraction(rows, p.router, adapter.d_model)
    assert cost <= p.flops_budget() + 1e-12 and cost == pytest.approx(fit["leading"]["planned_ffn_flops_fraction"])
    built = (sum(m.active_param_count() for m in modules.values()) + sum(3 * adapter.d_model * r.d_ffn for r in rows[:L]))
    assert built / sum(3 * adapter.d_model * r.d_ffn for r in rows) == pytest.approx(cost, rel=1e-12)
    assert fit["leading"]["error"] <= fit["leading"]["error_all_moe"] + 1e-12


def test_the_recovered_portable_conversion_exports_natively_and_to_gguf(fitted, data_dir, tmp_path):
    """--recipe portable from the CLI, then EW recovery's layer switch (softmax router + weighted combine,
    0 steps): every MoE layer alike, dense layers only in front: native HF and GGUF layouts accept it."""
    _, prof, _ = fitted
    conv = tmp_path / "c"
    res = CliRunner().invoke(main, ["convert", "--profile", str(prof.path), "--recipe", "portable", "--sparsity", "0.25",
                                    "--n-experts", "8", "--fit-tokens", "512", "--out", str(conv), "--json", "--quiet"],
                             env={"MOELAB_DATA_DIR": str(data_dir)})
    assert res.exit_code == 0, res.output
    record = json.loads((conv / "conversion.json").read_text())
    assert record["params"]["plan"] == "leading" and record["summary"]["ffn_flops_fraction"] <= 0.75 + 1e-12
    L = record["fit"]["leading"]["dense_layers"]
    assert L >= 1  # the layout under test has a dense layer in front
    assert record["summary"]["dense_layers"] == list(range(L))
    moe = MoelabForCausalLM.from_pretrained(str(conv), dtype=torch.float32)
    modules, _, _ = prepare_recovery(moe, routed_modules(moe), torch.randint(0, 1000, (2, 16)))
    moe.config.moe_layers = [{**s, **layer_spec(modules[i])} if i in modules else s for i, s in enumerate(moe.config.moe_layers)]
    layout = native_layout(moe)
    assert layout["dense_layers"] == list(range(L)) and layout["top_k"] == record["fit"]["leading"]["top_k"]
    assert layout["model_type"] == "qwen2_moe" and not layout["norm_topk_prob"]
    export_model(moe, tmp_path / "ft", load_tokenizer(conv), record)
    gg = gguf_layout(json.loads((tmp_path / "ft" / "config.json").read_text()))
    assert gg["leading_dense"] == L and gg["top_k"] == layout["top_k"]


def test_convert_prints_each_distinct_layer_note_once_with_its_layers(capsys):
    from moelab.cli import _print_partition

    row = {"d_shared": 384, "n_routed": 9, "top_k": 2, "expert_size": 128, "objective": None, "n_iter": 0, "static": False}
    layers = ([{**row, "layer": i, "note": "left dense (all neurons kept)"} for i in range(4)]
              + [{**row, "layer": i, "note": "12 experts of 128 neurons; leading plan"} for i in range(4, 30)])
    _print_partition({"summary": {"active_fraction": 0.5}, "layers": layers})
    notes = [line.strip() for line in capsys.readouterr().out.splitlines() if "note" in line]
    assert notes == ["note, layers 0–3 (4 layers): left dense (all neurons kept)",
                     "note, layers 4–29 (26 layers): 12 experts of 128 neurons; leading plan"]
