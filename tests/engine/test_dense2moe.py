"""Dense2MoE layer fusion (D2 §2.3, Eq. 6) on tiny random-weight models of several families.

Fusion modifies the dense model in place, so every test loads its own copy.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moelab.engine.core.params import ConversionError
from moelab.engine.methods.dense2moe import Dense2MoEParams, choose_fusion, fuse_model, plan_fusion, prepare_recovery, preview
from moelab.engine.core.fusion import fused_ffn, remove_decoder_layers
from moelab.engine.core.slicing import expert_rows
from moelab.engine.runtime.export import export_model, load_exported
from moelab.engine.runtime.modeling_moelab import MoeFFN, decoder_layers
from moelab.engine.models import adapt, load_model
from moelab.engine.runtime.param_count import parameter_counts

IDS = torch.tensor([[1, 17, 256, 999, 42, 5, 77, 3001, 12, 640, 8, 91, 2048, 33]])


def load(tiny_model, data_dir, family: str):
    return load_model(str(tiny_model(family)), data_dir=data_dir)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


# ------------------------------------------------------------------ choose_fusion (D2 §2.3)


def reference_choice(s_l, s_m, delta, max_fused):
    """Plain-loop version of D2 §2.3: every pair, sorted by S_L desc (ties: n, then l)."""
    L = len(s_l)
    pairs = [(l, n) for l in range(L) for n in range(1, max_fused + 1) if l + n <= L - 1]
    pairs.sort(key=lambda p: (-s_l[p[0], p[0] + p[1]], p[1], p[0]))
    for l, n in pairs:
        if 1 - s_m[l, l + n] < delta:
            return l, n, pairs
    return None, None, pairs


def synthetic(L=7, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.5, 0.9, (L, L))
    s_l = (a + a.T) / 2
    b = rng.uniform(0.6, 0.99, (L, L))
    s_m = (b + b.T) / 2
    np.fill_diagonal(s_l, 1.0)
    np.fill_diagonal(s_m, 1.0)
    # The most similar outputs are l=1 → 1+3, but their MLP inputs are far apart (distance 0.3);
    # the runner-up l=2 → 2+1 has close MLP inputs (distance 0.05).
    s_l[1, 4] = s_l[4, 1] = 0.99
    s_m[1, 4] = s_m[4, 1] = 0.70
    s_l[2, 3] = s_l[3, 2] = 0.98
    s_m[2, 3] = s_m[3, 2] = 0.95
    return s_l, s_m


def test_choose_fusion_takes_the_first_pair_by_s_layer_whose_mlp_inputs_are_close():
    s_l, s_m = synthetic()
    c = choose_fusion(s_l, s_m, delta=0.1, max_fused=8)
    assert (c.layer, c.n_fused) == (2, 1)
    assert c.fused_layers == [3]
    assert c.s_layer == pytest.approx(s_l[2, 3]) and c.s_mlp == pytest.approx(s_m[2, 3])
    assert c.rank == 1 and c.candidates[0]["layer"] == 1 and not c.candidates[0]["admitted"]
    # δ above the best pair's distance (0.3) admits it; the condition is strict
    loose = choose_fusion(s_l, s_m, delta=0.31, max_fused=8)
    assert (loose.layer, loose.n_fused, loose.rank) == (1, 3, 0)
    at = choose_fusion(s_l, s_m, delta=1 - 0.70, max_fused=8)
    assert (at.layer, at.n_fused) == (2, 1)
    # max_fused excludes the n = 3 pair, so even a loose δ cannot pick it
    capped = choose_fusion(s_l, s_m, delta=0.5, max_fused=2)
    assert (capped.layer, capped.n_fused) == (2, 1) and max(d["n_fused"] for d in capped.candidates) == 2


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("delta,max_fused", [(0.05, 8), (0.2, 3), (0.35, 1), (2.0, 6)])
def test_choose_fusion_matches_a_plain_loop(seed, delta, max_fused):
    s_l, s_m = synthetic(L=9, seed=seed)
    l, n, pairs = reference_choice(s_l, s_m, delta, max_fused)
    if l is None:
        with pytest.raises(ConversionError, match="δ >"):
            choose_fusion(s_l, s_m, delta, max_fused)
        return
    c = choose_fusion(s_l, s_m, delta, max_fused)
    assert (c.layer, c.n_fused) == (l, n)
    assert [(d["layer"], d["n_fused"]) for d in c.candidates] == pairs


def test_choose_fusion_error_names_the_delta_that_admits_the_best_pair():
    s_l, s_m = synthetic()
    with pytest.raises(ConversionError, match=r"δ > 0\.3000 would admit it"):
        choose_fusion(s_l, s_m, delta=0.001, max_fused=8)


def test_choose_fusion_with_given_layer_or_pair():
    s_l, s_m = synthetic()
    c = choose_fusion(s_l, s_m, delta=0.01, max_fused=8, layer=1, n_fused=3)  # given: no δ test
    assert (c.layer, c.n_fused, c.rank) == (1, 3, None) and c.s_mlp == pytest.approx(0.70)
    only_l1 = choose_fusion(s_l, s_m, delta=1.0, max_fused=8, layer=1)
    assert only_l1.layer == 1 and all(d["layer"] == 1 for d in only_l1.candidates)
    only_n2 = choose_fusion(s_l, s_m, delta=1.0, max_fused=8, n_fused=2)
    assert only_n2.n_fused == 2 and all(d["n_fused"] == 2 for d in only_n2.candidates)
    with pytest.raises(ConversionError, match="square matrices"):
        choose_fusion(s_l[:, :3], s_m, 0.1, 8)


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize(
    "change,message",
    [
        ({}, r"n_fused=5: a model of 3 layers has only 2 block\(s\) after block 0 to fuse: use n_fused ≤ 2, or 0"),
        ({"delta": 0.0}, "δ must be in"),
        ({"delta": float("nan")}, "δ must be in"),
        ({"layer": 2}, r"l\* must be in \[0, 1\]"),
        ({"layer": -1}, r"l\* must be in"),
        ({"n_fused": -1}, r"at least 1 \(or 0 to choose it\)"),
        ({"layer": 1, "n_fused": 2}, r"only 1 block\(s\) after l\* = 1"),
        ({"n_fused": 1, "max_fused": 0}, "cap on n"),
        ({"n_fused": 1, "own_copies": 0}, "N .copies"),
        ({"n_fused": 1, "fused_copies": 0}, "plain layer pruning"),
        ({"n_fused": 1, "top_k": 0}, "at least one expert"),
        # no routing: top_k would run every distinct MLP on every token (the n* = 1, top-2)
        ({"n_fused": 1, "top_k": 2}, r"holds 2 distinct MLPs .* no routing and no sparsity.* use top_k ≤ 1"),
        ({"n_fused": 1, "top_k": 2, "own_copies": 3}, r"2 distinct MLPs \(4 experts counting copies"),
        ({"layer": 1, "n_fused": 0, "top_k": 2}, "no routing and no sparsity"),  # the only n* possible is 1
        ({"n_fused": 2, "top_k": 3}, "use top_k ≤ 2"),
        ({"n_fused": 1, "combine": "mean"}, "use one of"),
        ({"n_fused": 1, "seed": -1}, "non-negative"),
    ],
)
def test_bad_params_raise_a_conversion_error(change, message):
    with pytest.raises(ConversionError, match=message):
        dataclasses.replace(Dense2MoEParams(), **change).validate(3)


def test_defaults_are_the_papers_configuration():
    """D2 §4.2 (Qwen2.5-0.5B, 24 layers): N = 6 experts in all, top-1, the top-5 redundant layers pruned."""
    p = Dense2MoEParams()
    assert (p.n_fused, p.own_copies, p.fused_copies, p.top_k, p.combine) == (5, 1, 1, 1, "sum")
    assert p.n_experts(p.n_fused) == 6 and p.routing_problem(p.n_fused) is None
    assert p.delta == 0.3  # ours: the paper gives no δ (see the module docstring and the slow test below)
    p.validate(24)
    p.validate(30)  # the default model
    assert p.fixed_n == 5 and Dense2MoEParams(n_fused=0).fixed_n is None
    assert dataclasses.replace(p, n_fused=None).fixed_n is None  # records written when None meant "chosen"


def test_params_round_trip_and_unknown_keys():
    p = Dense2MoEParams(delta=0.2, layer=3, n_fused=4, own_copies=2, top_k=3, combine="normalized", seed=4)
    assert Dense2MoEParams.from_dict(p.to_dict()) == p and p.to_dict()["method"] == "dense2moe"
    with pytest.raises(ConversionError, match="unknown dense2moe parameters"):
        Dense2MoEParams.from_dict({**p.to_dict(), "alpha": 1})
    Dense2MoEParams(n_fused=0, top_k=8).validate(30)  # n* ≤ max_fused = 8 may leave 9 distinct MLPs
    with pytest.raises(ConversionError, match="no routing"):
        Dense2MoEParams(n_fused=0, top_k=9).validate(30)


def test_needs_a_profile_unless_the_pair_is_given(tiny_model, data_dir):
    with pytest.raises(ConversionError, match="needs a profile"):
        fuse_model(load(tiny_model, data_dir, "llama"), Dense2MoEParams(n_fused=1), None)


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_refuses_blocks_that_normalise_the_mlp_output(tiny_model, data_dir, family):
    with pytest.raises(ConversionError, match="post_feedforward_layernorm"):
        fuse_model(load(tiny_model, data_dir, family), Dense2MoEParams(layer=0, n_fused=1), None)


# ------------------------------------------------------------------ structure and counts


@pytest.mark.parametrize(
    "family,layer,n,N,M,k",
    [("llama", 0, 2, 2, 1, 2), ("qwen3", 1, 1, 1, 2, 1), ("phi3", 0, 2, 2, 2, 2), ("gemma", 0, 1, 1, 1, 1),
     ("mistral", 1, 1, 3, 1, 1)],
)
def test_layer_and_parameter_counts_follow_eq6(tiny_model, data_dir, family, layer, n, N, M, k):
    adapter = load(tiny_model, data_dir, family)
    L, d, d_ffn = adapter.n_layers, adapter.d_model, adapter.d_ffn
    blocks = decoder_layers(adapter.model)
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    weights = [(lay.gate_weight().clone(), lay.up_weight().clone(), lay.down_weight().clone()) for lay in adapter.layers]
    dense_total = sum(p.numel() for p in {id(p): p for p in adapter.model.parameters()}.values())
    kept_blocks = [b for i, b in enumerate(blocks) if not layer < i <= layer + n]

    moe, rec = fuse_model(adapter, Dense2MoEParams(layer=layer, n_fused=n, own_copies=N, fused_copies=M, top_k=k), None)

    E, P_mlp = N + n * M, 3 * d * d_ffn
    total = dense_total - sum(block_params[layer + 1 : layer + n + 1]) + (E - 1) * P_mlp + E * d  # + router W_g
    active = total - (E - k) * P_mlp
    s = rec["summary"]
    assert (s["dense_total_params"], s["total_params"], s["active_params"]) == (dense_total, total, active)
    assert s["distinct_experts"] == n + 1 and s["active_params"] < s["dense_active_params"]
    assert parameter_counts(moe) == {"total": total, "active": active}
    assert (s["layers_before"], s["layers_after"], s["n_layers"]) == (L, L - n, L - n)
    assert s["removed_layers"] == list(range(layer + 1, layer + n + 1)) and s["n_experts"] == E

    new_blocks = decoder_layers(moe.model)
    assert list(new_blocks) == kept_blocks and moe.config.base_config.num_hidden_layers == L - n
    assert [b.self_attn.layer_idx for b in new_blocks] == list(range(L - n))
    assert [r["kind"] for r in rec["layers"]] == ["fused" if i == layer else "dense" for i in range(L - n)]
    assert [r["source_layer"] for r in rec["layers"]] == [i for i in range(L) if not layer < i <= layer + n]
    assert list(moe.moe_modules()) == [layer]
    assert [e["kind"] for e in moe.config.moe_layers] == ["moe" if i == layer else "dense" for i in range(L - n)]

    ffn = moe.moe_modules()[layer]
    sources = [layer] * N + [j for j in range(layer + 1, layer + n + 1) for _ in range(M)]
    assert ffn.spec["expert_source_layers"] == sources and ffn.d_shared == 0 and ffn.router.kind == "softmax"
    assert ffn.spec.get("expert_groups") == (sources if N > 1 or M > 1 else None)
    gate_rows, up_rows, down = expert_rows(ffn)
    for e, src in enumerate(sources):  # expert e is an exact copy of MLP^(src)
        g, u, dn = weights[src]
        assert torch.equal(gate_rows[e], g) and torch.equal(up_rows[e], u)
        assert torch.equal(down[e], dn)


# ------------------------------------------------------------------ Eq. 6 by hand


def hand_composition(model, ids, layer: int, n: int) -> torch.Tensor:
    """x → blocks < l* → block l*'s attention → h → h + Σ_{j=l*..l*+n*} MLP^(j)(norm_l*(h))
    → blocks > l*+n* → final norm → LM head, calling the dense model's own modules."""
    body = model.model
    T = ids.shape[1]
    x = body.embed_tokens(ids)
    pos = torch.arange(T)[None]
    pe = body.rotary_emb(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]

    def run(block, x):
        out = block(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return out[0] if isinstance(out, tuple) else out

    blocks = body.layers
    for i in range(layer):
        x = run(blocks[i], x)
    b = blocks[layer]
    attn = b.self_attn(b.input_layernorm(x), attention_mask=mask, position_ids=pos, position_embeddings=pe)[0]
    h = x + attn
    u = b.post_attention_layernorm(h)
    x = h + sum(blocks[j].mlp(u) for j in range(layer, layer + n + 1))
    for i in range(layer + n + 1, len(blocks)):
        x = run(blocks[i], x)
    return model.lm_head(body.norm(x))


def fuse_every_expert(adapter, layer: int, n: int):
    """fuse_model's surgery with top_k = every expert, which fuse_model refuses (no routing):
    the plain Eq. 6 sum, to check the composition by hand."""
    from types import SimpleNamespace

    from moelab.engine.runtime.export import build_moe_model

    params = SimpleNamespace(own_copies=1, fused_copies=1, top_k=n + 1, combine="sum", seed=0)
    module = fused_ffn(adapter, layer, n, params)
    kept = remove_decoder_layers(adapter.model, list(range(layer + 1, layer + n + 1)))
    return build_moe_model(adapter, {kept.index(layer): module}, provenance={"method": "dense2moe"})


@pytest.mark.parametrize("family,layer,n", [("llama", 0, 1), ("qwen3", 0, 2), ("phi3", 1, 1)])
def test_all_experts_summed_equal_the_hand_computed_eq6(tiny_model, data_dir, family, layer, n):
    reference = load(tiny_model, data_dir, family).model
    with torch.no_grad():
        expected = hand_composition(reference, IDS, layer, n)
    dense = logits(reference)
    with pytest.raises(ConversionError, match="no routing and no sparsity"):  # not as a conversion
        fuse_model(load(tiny_model, data_dir, family), Dense2MoEParams(layer=layer, n_fused=n, top_k=n + 1), None)
    moe = fuse_every_expert(load(tiny_model, data_dir, family), layer, n)
    got = logits(moe)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (got - dense).abs().max() > 1e-3  # the removed attention really is gone


# ------------------------------------------------------------------ runtime, export, generation


def sliding_qwen3():
    """4 blocks: full, full, sliding, sliding (window 4) - the kept blocks keep their type."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, use_sliding_window=True,
        sliding_window=4, max_window_layers=2,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    return adapt(model)


def check_cache_and_reload(moe, tmp_path, record):
    """Incremental decoding with the KV cache == full forward; export → reload: same logits."""
    full = logits(moe)
    with torch.no_grad():
        out = moe(IDS[:, :-3], use_cache=True)
        cache = out.past_key_values
        steps = []
        for t in range(IDS.shape[1] - 3, IDS.shape[1]):
            o = moe(IDS[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            steps.append(o.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, -3:], rtol=1e-4, atol=1e-5)
    gen = moe.generate(IDS, max_new_tokens=4, do_sample=False)
    gen_nocache = moe.generate(IDS, max_new_tokens=4, do_sample=False, use_cache=False)
    assert gen.shape == (1, IDS.shape[1] + 4) and torch.equal(gen, gen_nocache)

    export_model(moe, tmp_path / "fused", None, record)
    loaded = load_exported(tmp_path / "fused")
    assert torch.equal(logits(loaded), full)
    assert torch.equal(loaded.generate(IDS, max_new_tokens=4, do_sample=False), gen)
    return loaded


def test_export_reload_and_generate_llama(tiny_model, data_dir, tmp_path):
    adapter = load(tiny_model, data_dir, "llama")
    moe, rec = fuse_model(adapter, Dense2MoEParams(layer=0, n_fused=2, own_copies=2, top_k=2), None)
    picked = []
    moe.set_recorder(lambda i: lambda idx: picked.append((i, idx.clone())))
    loaded = check_cache_and_reload(moe, tmp_path, rec)
    moe.set_recorder(None)
    assert picked and {i for i, _ in picked} == {0}
    assert picked[0][1].shape == (*IDS.shape, 2) and picked[0][1].max() < 4
    sources = torch.tensor(rec["layers"][0]["expert_source_layers"])  # [0, 0, 1, 2]
    assert all(bool((sources[idx[..., 0]] != sources[idx[..., 1]]).all()) for _, idx in picked), "never two copies"
    assert loaded.moe_modules()[0].spec["expert_groups"] == [0, 0, 1, 2]
    assert len(decoder_layers(loaded.model)) == 1 and loaded.config.base_config.num_hidden_layers == 1


def test_sliding_layer_types_follow_their_blocks(tmp_path):
    adapter = sliding_qwen3()
    moe, rec = fuse_model(adapter, Dense2MoEParams(layer=1, n_fused=2, top_k=2, combine="normalized"), None)
    assert moe.config.base_config.layer_types == ["full_attention", "full_attention"]
    loaded = check_cache_and_reload(moe, tmp_path, rec)
    assert loaded.config.base_config.layer_types == ["full_attention", "full_attention"]


def test_sliding_layer_types_mixed(tmp_path):
    adapter = sliding_qwen3()
    moe, rec = fuse_model(adapter, Dense2MoEParams(layer=0, n_fused=2, top_k=2, combine="weighted"), None)
    assert moe.config.base_config.layer_types == ["full_attention", "sliding_attention"]
    assert [b.self_attn.sliding_window for b in decoder_layers(moe.model)] == [None, 4]
    loaded = check_cache_and_reload(moe, tmp_path, rec)
    assert loaded.config.base_config.layer_types == ["full_attention", "sliding_attention"]


def test_remove_decoder_layers_refuses_unknown_per_layer_config(tiny_model, data_dir):
    model = load(tiny_model, data_dir, "llama").model
    model.config.mlp_only_layers = [1]
    with pytest.raises(ConversionError, match="mlp_only_layers"):
        remove_decoder_layers(model, [1])
    with pytest.raises(ConversionError, match="out of range"):
        remove_decoder_layers(model, [3])


def test_only_weighted_combines_train_the_router(tiny_model, data_dir):
    adapter = load(tiny_model, data_dir, "llama")
    assert Dense2MoEParams().combine == "sum"  # training-free default (see the module docstring)
    x = torch.randn(2, 9, adapter.d_model, generator=torch.Generator().manual_seed(0))
    for combine in ("weighted", "normalized", "sum"):
        params = Dense2MoEParams(layer=0, n_fused=2, own_copies=2, top_k=2, combine=combine)
        ffn = fused_ffn(adapter, 0, 2, params)
        assert ffn.n_routed == 4 and ffn.combine == combine
        ffn(x).pow(2).sum().backward()
        grad = ffn.router_weight.grad
        if combine == "sum":
            assert grad is None or not grad.any()
        else:
            assert grad is not None and grad.abs().sum() > 0


# ------------------------------------------------------------------ normalized combine (MoeFFN)


@pytest.mark.parametrize("dispatch", ["loop", "padded"])
def test_normalized_combine_weights_the_selected_experts_by_their_own_softmax(dispatch):
    g = torch.Generator().manual_seed(0)
    E, m, d, k = 5, 8, 16, 2
    spec = {"kind": "moe", "d_model": d, "act": "silu", "n_experts": E, "expert_size": m, "top_k": k,
            "router": "softmax", "combine": "normalized", "dispatch": dispatch}
    mod = MoeFFN(spec)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(3, 7, d, generator=g)
    with torch.no_grad():
        y = mod(x)
        xt = x.reshape(-1, d)
        gate_rows, up_rows, down = expert_rows(mod)
        s = xt @ mod.router_weight.T
        top = s.topk(k, dim=-1)
        w = torch.softmax(top.values, dim=-1)
        ref = torch.zeros_like(xt)
        for t in range(xt.shape[0]):
            for j in range(k):
                e = top.indices[t, j]
                h = F.silu(gate_rows[e] @ xt[t]) * (up_rows[e] @ xt[t])
                ref[t] += w[t, j] * (down[e] @ h)
    torch.testing.assert_close(y.reshape(-1, d), ref, rtol=1e-4, atol=1e-5)
    assert MoeFFN(mod.spec).combine == "normalized"


# ------------------------------------------------------------------ with a real (tiny) profile


def test_fusion_chosen_from_a_profile(tiny_model, data_dir, tmp_path):
    from moelab.engine.data.calibration import CalibrationSet, Sample
    from moelab.engine.profiling.store import StoredProfile, write_profile
    from moelab.engine.profiling.profiler import ProfileSettings, profile_model

    words = "river stone cloud alpha beta gamma sigma omega lambda kappa".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(20 + 3 * i)) for i in range(6)]
    cset = CalibrationSet(name="t", samples=[Sample(text=t, task=f"t{i % 2}") for i, t in enumerate(texts)], source="test")
    adapter = load(tiny_model, data_dir, "llama")
    settings = ProfileSettings(max_tokens=32, batch_tokens=256, atopk_k=4, feature_tokens=256, hist_bins=11)
    prof = StoredProfile.open(write_profile(profile_model(adapter, cset, settings), cset, tmp_path / "p"))
    s_l, s_m = prof.similarity("outputs"), prof.similarity("mlp_inputs")
    l, n, _ = reference_choice(s_l, s_m, 2.0, 8)

    moe, rec = fuse_model(adapter, Dense2MoEParams(delta=2.0, n_fused=0, top_k=1), prof)
    s = rec["summary"]
    assert (s["fused_layer"], s["n_fused"], s["chosen"]) == (l, n, True)
    assert s["s_layer"] == pytest.approx(float(s_l[l, l + n])) and s["distance"] == pytest.approx(1 - float(s_m[l, l + n]))
    assert rec["fusion"]["candidates"][rec["fusion"]["rank"]]["layer"] == l
    assert rec["layers"][l]["s_mlp_fused"] == pytest.approx([float(s_m[l, j]) for j in range(l + 1, l + n + 1)])
    assert rec["params"] == Dense2MoEParams(delta=2.0, n_fused=0, top_k=1).to_dict() and rec["timings"]["total_s"] > 0
    assert json.loads(json.dumps(rec)) == rec  # conversion.json material

    tight = float((1 - s_m[np.triu_indices(len(s_m), 1)]).min()) / 2  # below every pair's distance
    with pytest.raises(ConversionError, match="would admit it"):
        fuse_model(load(tiny_model, data_dir, "llama"), Dense2MoEParams(delta=tight, n_fused=0), prof)


# ------------------------------------------------------------------ the paper's configuration (D2 §4.2)


class FakeProfile:
    """What fuse_model / preview read of a StoredProfile: the manifest and S_L, S_M."""

    def __init__(self, s_l, s_m, d_ffn: int, path="fake-profile"):
        self.s = {"outputs": np.asarray(s_l), "mlp_inputs": np.asarray(s_m)}
        self.manifest = {"n_layers": len(s_l), "d_ffn": [d_ffn] * len(s_l)}
        self.path = path

    def similarity(self, kind: str) -> np.ndarray:
        return self.s[kind]


def deep_llama(L: int = 8):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(3)
    return adapt(AutoModelForCausalLM.from_config(cfg).eval())


def banded(L: int = 8):
    """S_L / S_M falling with the span n = |i - j| (as in real models, D2 Fig. 3); the 5-block spans
    have MLP-input distances 0.25 + 0.01·l, their S_L peaks at l = 2."""
    i, j = np.indices((L, L))
    n = np.abs(i - j)
    s_l = 1 - 0.02 * n
    s_m = 1 - 0.05 * n
    for l in range(L - 5):
        s_l[l, l + 5] = s_l[l + 5, l] = 0.9 - 0.01 * abs(l - 2)
        s_m[l, l + 5] = s_m[l + 5, l] = 0.75 - 0.01 * l
    return s_l, s_m


def test_defaults_fuse_five_blocks_into_six_experts_with_top1():
    adapter = deep_llama(8)
    s_l, s_m = banded(8)
    prof = FakeProfile(s_l, s_m, adapter.d_ffn)
    moe, rec = fuse_model(adapter, Dense2MoEParams(), prof)
    s = rec["summary"]
    # the 5-block spans ranked by S_L: l = 2 first, distance 0.27 < δ = 0.3
    assert (s["fused_layer"], s["n_fused"], s["removed_layers"]) == (2, 5, [3, 4, 5, 6, 7])
    assert (s["n_experts"], s["distinct_experts"], s["top_k"], s["layers_after"]) == (6, 6, 1, 3)
    assert s["distance"] == pytest.approx(0.27)
    assert all(d["n_fused"] == 5 for d in rec["fusion"]["candidates"])
    d, f = adapter.d_model, adapter.d_ffn
    assert s["total_params"] - s["active_params"] == 5 * 3 * d * f  # one of six MLPs runs per token
    assert s["active_params"] < s["dense_active_params"]
    assert preview(prof, Dense2MoEParams())["fusion"]["layer"] == 2
    # δ at or below every 5-block span's distance: refused, naming the δ that admits the best span
    with pytest.raises(ConversionError, match=r"δ > 0\.2700 would admit it.*fewer blocks than n_fused=5"):
        preview(prof, Dense2MoEParams(delta=0.1))


def test_a_chosen_fusion_without_routing_is_refused(tiny_model, data_dir):
    """The issue: δ = 0.1 with n* chosen picked one block, two experts, top-2: no routing, no sparsity."""
    s_l = np.array([[1, 0.97, 0.5], [0.97, 1, 0.96], [0.5, 0.96, 1]])  # adjacent outputs most similar, as usual
    s_m = np.array([[1, 0.95, 0.8], [0.95, 1, 0.93], [0.8, 0.93, 1]])
    adapter = load(tiny_model, data_dir, "llama")
    prof = FakeProfile(s_l, s_m, adapter.d_ffn)
    old_defaults = Dense2MoEParams(delta=0.1, n_fused=0, top_k=2)
    assert plan_fusion(prof, old_defaults).n_fused == 1
    for call in (lambda: preview(prof, old_defaults), lambda: fuse_model(adapter, old_defaults, prof)):
        with pytest.raises(ConversionError, match=r"l\*=\d, n\*=1: top_k=2 .* no routing and no sparsity"):
            call()
    moe, rec = fuse_model(adapter, dataclasses.replace(old_defaults, top_k=1), prof)
    assert (rec["summary"]["n_experts"], rec["summary"]["top_k"]) == (2, 1)


# ------------------------------------------------------------------ copies never run twice for one token


def test_copies_are_never_selected_twice_for_one_token(tiny_model, data_dir):
    adapter = load(tiny_model, data_dir, "llama")
    params = Dense2MoEParams(layer=0, n_fused=2, own_copies=3, fused_copies=2, top_k=2)
    ffn = fused_ffn(adapter, 0, 2, params)
    sources = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    assert ffn.spec["expert_groups"] == sources.tolist() and ffn.n_routed == 7
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, adapter.d_model, generator=g)
    with torch.no_grad():  # copies of MLP^(0) score highest: an unconstrained top-2 would take two of them
        ffn.router_weight[:3] = ffn.router_weight[3] + 5.0 * x.reshape(-1, adapter.d_model).mean(0)
        ffn.router_weight[1] = ffn.router_weight[0]  # an exact tie between two copies
    picks = []
    ffn.recorder = picks.append
    with torch.no_grad():
        y = ffn(x)
    top = picks[0].reshape(-1, 2)
    assert bool((sources[top[:, 0]] != sources[top[:, 1]]).all()), "two copies of one MLP for one token"
    assert not bool((top == 1).any()), "ties between copies go to the lower index"
    xt = x.reshape(-1, adapter.d_model)
    scores = (xt @ ffn.router_weight.T).detach()
    unconstrained = scores.topk(2, -1).indices
    gate_rows, up_rows, down = expert_rows(ffn)
    assert bool((sources[unconstrained[:, 0]] == sources[unconstrained[:, 1]]).any()), "the test needs the hard case"
    ref = torch.zeros_like(xt)
    for t in range(xt.shape[0]):  # reference: best copy of each source, then the top-2 sources, summed
        best = {}
        for e in range(7):
            src = int(sources[e])
            if src not in best or scores[t, e] > scores[t, best[src]]:
                best[src] = e
        chosen = sorted(best.values(), key=lambda e: -float(scores[t, e]))[:2]
        assert sorted(chosen) == sorted(top[t].tolist())
        for e in chosen:
            h = F.silu(gate_rows[e] @ xt[t]) * (up_rows[e] @ xt[t])
            ref[t] += down[e] @ h
    torch.testing.assert_close(y.reshape(-1, adapter.d_model), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds the 3 expert groups"):
        MoeFFN({**ffn.spec, "top_k": 4})
    assert MoeFFN({**ffn.spec, "top_k": 1}).router.groups is not None  # top-1: the best copy is the argmax anyway


# ------------------------------------------------------------------ recovery fine-tuning switch (D2 §3)


@pytest.mark.parametrize("combine,N,k", [("sum", 1, 1), ("sum", 2, 2), ("normalized", 1, 1)])
def test_dense2moe_recovery_switch_keeps_the_logits_and_lets_the_lm_loss_reach_the_router(tiny_model, data_dir, combine, N, k):
    moe, _ = fuse_model(load(tiny_model, data_dir, "llama"),
                        Dense2MoEParams(layer=0, n_fused=2, own_copies=N, top_k=k, combine=combine), None)
    before = logits(moe)
    (i, ffn), = moe.moe_modules().items()
    ffn.recorder = None
    moe(IDS, labels=IDS, use_cache=False).loss.backward()
    assert ffn.router_weight.grad is None or not ffn.router_weight.grad.any(), "training-free: the router only ranks"
    moe.zero_grad(set_to_none=True)

    modules, notes, changed = prepare_recovery(moe, {i: ffn}, IDS)
    assert (ffn.combine, notes["scaled_combine_layers"], changed) == ("scaled", [0], False)
    after = logits(moe)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)  # fp32: the same function
    loss = moe(IDS, labels=IDS, use_cache=False).loss
    g_w, g_u = torch.autograd.grad(loss, [ffn.router_weight, ffn.router_scale])
    assert g_u.abs().sum() > 0, "u gets the LM loss's gradient from the first step"
    with torch.no_grad():
        ffn.router_scale.fill_(0.1)
    (g_w,) = torch.autograd.grad(moe(IDS, labels=IDS, use_cache=False).loss, [ffn.router_weight])
    assert g_w.abs().sum() > 0, "…and W_g through u once u ≠ 0"


@pytest.mark.slow
def test_the_default_delta_admits_the_papers_five_block_span_on_the_default_model(default_model_dir, data_dir, tmp_path):
    """δ is not in the paper; 0.3 is chosen so that the default model admits n* = 5 (module docstring):
    with δ = 0.1 no span of 5 blocks passes, and the joint §2.3 search fuses one block."""
    from moelab.engine.data.calibration import load_calibration
    from moelab.engine.profiling.profiler import ProfileSettings, profile_model
    from moelab.engine.profiling.store import StoredProfile, write_profile

    adapter = load_model(str(default_model_dir), data_dir=data_dir, dtype="float32")
    cset = load_calibration("builtin:mixed", samples=48, seed=0, data_dir=data_dir)
    res = profile_model(adapter, cset, ProfileSettings(max_tokens=96, batch_tokens=1536, second_moment=False))
    prof = StoredProfile.open(write_profile(res, cset, tmp_path / "p"))
    plan = preview(prof, Dense2MoEParams())
    f, s = plan["fusion"], plan["summary"]
    assert (f["n_fused"], s["n_experts"], s["top_k"], s["layers_after"]) == (5, 6, 1, 25)
    assert f["rank"] == 0 and 1 - f["s_mlp"] < 0.3  # the best 5-block span by S_L passes δ
    with pytest.raises(ConversionError, match="would admit it"):
        preview(prof, Dense2MoEParams(delta=0.1))
    assert plan_fusion(prof, Dense2MoEParams(delta=0.1, n_fused=0)).n_fused == 1  # the n* = 1
