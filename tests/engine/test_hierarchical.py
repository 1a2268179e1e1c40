"""Hierarchical conversion of existing MoE models (AF §4.4, Eq. 10) on tiny random Mixtral,
Qwen2-MoE (with its gated shared expert) and Qwen3-MoE (with one dense layer) models."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import MOE_D, MOE_E, MOE_F, MOE_FAMILIES, MOE_K, build_tiny_moe
from moelab.engine.core.params import ConversionError
from moelab.engine.runtime.export import CONVERSION_FILE, export_model, load_exported
from moelab.engine.methods.hierarchical import HierarchicalParams, convert_hierarchical
from moelab.engine.profiling.moe_experts import load_moe_model, sparse_moe_layers
from moelab.engine.runtime.modeling_moelab import HierarchicalExperts

CALIB = "builtin:mixed"
# ~290 calibration tokens, ~145 routed to each of the 4 experts: fewer than the default minimum
# of 128 for some, so the minimum is lowered wherever the test expects no fallback.
FAST = dict(samples=6, max_tokens=48, min_expert_tokens=16)
E, K, F_EXPERT, D = MOE_E, MOE_K, MOE_F, MOE_D  # experts, top-level k, neurons per expert, d_model


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, default_model_dir):
    """Factory: ``tiny_moe("mixtral")`` -> directory of a saved random-weight MoE model."""
    made = {}

    def make(family: str):
        if family not in made:
            made[family] = build_tiny_moe(family, tmp_path_factory.mktemp(f"tiny-{family}"), default_model_dir)
        return made[family]

    return make


@pytest.fixture(scope="module")
def all_active(tiny_moe, data_dir):
    """Factory: ``all_active("mixtral")`` -> (moe_model, record) with every sub-expert active (cached)."""
    made = {}

    def make(family: str):
        if family not in made:
            params = HierarchicalParams(n_experts=8, shared=2, active=6, **FAST)
            moe, _, record = convert_hierarchical(tiny_moe(family), CALIB, params, data_dir=data_dir, device="cpu")
            made[family] = moe, record
        return made[family]

    return make


def batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # right padding on one row
    return ids, mask


def reference(path):
    model, tok = load_moe_model(path, device="cpu")
    ids, mask = batch(len(tok))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits, (ids, mask)


def logits(model, inputs):
    with torch.no_grad():
        return model(input_ids=inputs[0], attention_mask=inputs[1]).logits


def moe_layer_indices(family):
    return [0, 2] if family == "qwen3_moe" else [0, 1]


# --------------------------------------------------------------------------- parameters


def test_params_round_trip_and_validation():
    p = HierarchicalParams(n_experts=4, shared=1, active=2, samples=3)
    assert HierarchicalParams.from_dict(p.to_dict()) == p
    assert p.to_dict()["method"] == "hierarchical" and HierarchicalParams().atopk_k == 10  # CM §4 K_a
    p.validate(64)
    bad = [
        (HierarchicalParams(shared=6, active=3), None, "exceeds"),  # S + A > E
        (HierarchicalParams(n_experts=128), 64, "do not fit"),
        (HierarchicalParams(atopk_k=65, n_experts=4), 64, "atopk_k"),
        (HierarchicalParams(samples=0), None, "samples"),
        (HierarchicalParams(min_expert_tokens=0), None, "min_expert_tokens"),
        (HierarchicalParams(active=2.5), None, "integer"),
    ]
    for params, width, words in bad:
        with pytest.raises(ConversionError, match=words):
            params.validate(width)
    with pytest.raises(ConversionError, match="unknown hierarchical parameters"):
        HierarchicalParams.from_dict({"method": "hierarchical", "experts": 8})


def test_bad_params_and_dense_models_are_refused(tiny_moe, tiny_model, data_dir):
    with pytest.raises(ConversionError, match="do not fit d_ffn=64"):  # 128 sub-experts of a 64-neuron expert
        convert_hierarchical(tiny_moe("mixtral"), CALIB, HierarchicalParams(n_experts=128, **FAST), data_dir=data_dir)
    with pytest.raises(ConversionError, match="no sparse-MoE layer"):
        convert_hierarchical(tiny_model("llama"), CALIB, HierarchicalParams(**FAST), data_dir=data_dir)
    with pytest.raises(ConversionError, match="config.json"):
        load_moe_model(data_dir)


# --------------------------------------------------------------------------- conversions


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_all_sub_experts_active_reproduces_the_model(family, tiny_moe, all_active):
    ref, inputs = reference(tiny_moe(family))
    moe, record = all_active(family)
    assert sorted(moe.moe_modules()) == moe_layer_indices(family)
    torch.testing.assert_close(logits(moe, inputs), ref, rtol=0, atol=1e-5)
    assert record["summary"]["moe_layers"] == moe_layer_indices(family)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_fewer_active_sub_experts(family, tiny_moe, data_dir, tmp_path):
    ref, inputs = reference(tiny_moe(family))
    S, A, N = 2, 2, 8
    params = HierarchicalParams(n_experts=N, shared=S, active=A, **FAST)
    moe, tok, record = convert_hierarchical(tiny_moe(family), CALIB, params, data_dir=data_dir, device="cpu")
    out = logits(moe, inputs)
    assert (out - ref).abs().max() > 1e-2  # 8 of 64 neurons of each selected expert are skipped

    # Recorder: per token and top-level slot, A sub-experts of the expert the top-level router chose.
    n_routed = N - S
    layers = moe_layer_indices(family)
    seen, top = {}, {}
    moe.set_recorder(lambda i: lambda idx: seen.__setitem__(i, idx.clone()))
    blocks = moe.get_decoder().layers
    hooks = [blocks[i].mlp.gate.register_forward_hook(lambda m, a, o, i=i: top.__setitem__(i, o[2].clone()))
             for i in layers]
    try:
        torch.testing.assert_close(logits(moe, inputs), out, rtol=0, atol=0)  # recording changes nothing
    finally:
        moe.set_recorder(None)
        for h in hooks:
            h.remove()
    assert sorted(seen) == layers
    for i in layers:
        mod = moe.moe_modules()[i]
        assert (mod.n_routed, mod.top_k) == (E * n_routed, K * A)
        assert seen[i].shape == (2, 16, K * A)
        sub = seen[i].reshape(-1, K, A)
        assert torch.equal(sub // n_routed, top[i][:, :, None].expand(-1, -1, A))  # inside the chosen expert
        assert (sub.sort(-1).values.diff(dim=-1) > 0).all()  # A distinct sub-experts per slot

    # Parameter counts: the top-level router, attention, embeddings (and Qwen2-MoE's shared expert)
    # stay; per MoE layer the E experts gain a sub-router of 2·d per routed sub-expert, and a token
    # uses k experts × (shared + A routed sub-experts + sub-router) instead of k whole experts.
    m = F_EXPERT // N
    per_token_expert = 3 * D * m * (S + A) + 2 * D * n_routed
    s = record["summary"]
    L = len(layers)
    assert s["dense_active_params"] == s["dense_total_params"] - L * (E - K) * 3 * D * F_EXPERT
    assert s["total_params"] == s["dense_total_params"] + L * E * 2 * D * n_routed
    assert s["active_params"] == s["dense_active_params"] - L * K * 3 * D * F_EXPERT + L * K * per_token_expert
    assert s["n_layers"] == len(blocks) and s["sub_expert_size"] == m and s["fallback_experts"] == 0

    # Record: JSON, per layer and expert the S·A·E plan, the fallback flag and the clustering objective.
    json.dumps(record, allow_nan=False)
    assert record["params"] == params.to_dict()
    assert [r["layer"] for r in record["layers"]] == layers
    for lay in record["layers"]:
        assert len(lay["experts"]) == E
        for ex in lay["experts"]:
            assert (ex["n_shared"], ex["n_routed"], ex["top_k"], ex["d_expert"]) == (S, n_routed, A, m)
            assert ex["fallback"] is False and ex["profiled_tokens"] == ex["routed_tokens"] >= params.min_expert_tokens
            assert ex["router"] == "representative" and ex["objective"] > 0

    # Export and reload: identical logits, the hierarchical specs rebuilt from config.json.
    path = export_model(moe, tmp_path / "out", tok, record)
    loaded = load_exported(path)
    assert torch.equal(logits(loaded, inputs), out)
    kinds = [spec["kind"] for spec in loaded.config.moe_layers]
    assert kinds == ["hierarchical" if i in layers else "dense" for i in range(len(blocks))]
    assert sorted(loaded.moe_modules()) == layers
    assert json.loads((path / CONVERSION_FILE).read_text())["summary"] == s


def test_rarely_routed_experts_fall_back_to_all_tokens(tiny_moe, data_dir):
    params = HierarchicalParams(n_experts=8, shared=2, active=2, **{**FAST, "min_expert_tokens": 10**6})
    _, _, record = convert_hierarchical(tiny_moe("mixtral"), CALIB, params, data_dir=data_dir, device="cpu")
    tokens = record["summary"]["calibration"]["tokens"]
    assert record["summary"]["fallback_experts"] == 2 * E
    for lay in record["layers"]:
        assert lay["fallback_experts"] == E
        assert all(ex["fallback"] and ex["profiled_tokens"] == tokens for ex in lay["experts"])
        # every token is routed to exactly K experts
        assert sum(ex["routed_tokens"] for ex in lay["experts"]) == K * tokens


# --------------------------------------------------------------------------- the runtime module


def test_experts_module_matches_the_replaced_one_and_skips_the_no_expert_index(tiny_moe, all_active):
    model, _ = load_moe_model(tiny_moe("mixtral"), device="cpu")
    original = sparse_moe_layers(model)[0].experts
    mod = all_active("mixtral")[0].moe_modules()[0]
    assert isinstance(mod, HierarchicalExperts) and HierarchicalExperts(mod.spec).spec == mod.spec
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(10)])
    w = torch.rand(10, K, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(mod(x, idx, w), original(x, idx, w), rtol=0, atol=1e-6)
        skip = idx.clone()
        skip[:, 1] = E  # transformers' "no expert" index
        got = []
        mod.recorder = got.append
        y = mod(x, skip, w)
        mod.recorder = None
        torch.testing.assert_close(y, original(x, idx[:, :1], w[:, :1]), rtol=0, atol=1e-6)
    assert got[0].shape == (10, K * 6)  # called on its own: [T, top_k]
    assert (got[0][:, 6:] == -1).all() and (got[0][:, :6] >= 0).all()
    # every sub-expert of a selected expert runs (top_k = n_routed, sum): its router is never evaluated
    assert mod.active_param_count() == K * 3 * D * F_EXPERT
