"""Native export (issue 12 items 3-4): a converted model as a stock transformers MoE, and the model card.

Tiny random-weight Llama and Qwen3 models are converted with ExpertWeaver at a uniform α, switched to
the EW Eq. 11 softmax router + weighted combine by the fine-tuning mode's own ``prepare_recovery``
(0 training steps), exported, and written natively; the native model is loaded with
``trust_remote_code=False`` and must compute moelab's logits (fp32, 1e-4). Every layout a stock
architecture cannot express is refused with a message naming what blocks it and the route that works.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

from moelab.cli import main
from tests.engine.test_profiling import make_set
from moelab.engine.core.slicing import expert_rows, moe_from_dense
from moelab.engine.methods.dense2moe import Dense2MoEParams, fuse_model
from moelab.engine.methods.expertweaver import ExpertWeaverParams, prepare_recovery
from moelab.engine.methods.midas import MidasParams
from moelab.engine.models import load_model
from moelab.engine.profiling.profiler import ProfileSettings, profile_model
from moelab.engine.profiling.store import write_profile
from moelab.engine.runs import run_conversion
from moelab.engine.runtime.export import export_model
from moelab.engine.runtime.modeling_moelab import MoelabForCausalLM, convert_in_place, layer_spec
from moelab.engine.runtime.native_export import NativeExportError, export_converted, native_layout
from moelab.engine.training.finetune import load_tokenizer, routed_modules

IDS = torch.tensor([[1, 17, 256, 999, 42, 5, 77, 3001, 12, 640, 8, 91, 2048, 33, 7, 400],
                    [3, 9, 100, 2, 55, 1000, 4, 4, 61, 700, 18, 2, 300, 44, 81, 5]])


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


def _profile(tiny_model, data_dir, family, root, seed=5):
    adapter = load_model(str(tiny_model(family)), data_dir=data_dir)
    cset = make_set(n=24, tasks=4, seed=seed)
    res = profile_model(adapter, cset, ProfileSettings(max_tokens=48, batch_tokens=192, atopk_k=8))
    return write_profile(res, cset, root / f"prof-{family}-{seed}")


def _ew_switch(conv, out):
    """EW fine-tuning's layer switch (softmax router + weighted combine), 0 steps, exported like a fine-tuned model."""
    moe = MoelabForCausalLM.from_pretrained(str(conv), dtype=torch.float32)
    modules, _, _ = prepare_recovery(moe, routed_modules(moe), IDS)
    moe.config.moe_layers = [{**s, **layer_spec(modules[i])} if i in modules else s
                             for i, s in enumerate(moe.config.moe_layers)]  # as merge_adapters records them
    record = json.loads((conv / "conversion.json").read_text())
    record["finetune"] = {"params": {"mode": "expertweaver", "steps": 0}, "steps": 0, "tokens": 0, "perplexity_after": 12.5}
    export_model(moe, out, load_tokenizer(conv), record)
    return out


@pytest.fixture(scope="module")
def convs(tiny_model, data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    out = {}
    prof = _profile(tiny_model, data_dir, "llama", root)
    # uniform α: every layer 2 shared experts of 12 neurons, top-4 of 6 routed
    ew = ExpertWeaverParams(n_experts=8, sparsity=0.25, alpha_min=0.25, alpha_max=0.25, tau=0.3)
    run_conversion(prof, ew, root / "llama-ew", data_dir=data_dir)
    out["llama-ew"] = root / "llama-ew"
    out["llama-ft"] = _ew_switch(root / "llama-ew", root / "llama-ft")
    prof3 = _profile(tiny_model, data_dir, "qwen3", root)
    ew0 = ExpertWeaverParams(n_experts=8, sparsity=0.25, alpha_min=0.0, alpha_max=0.0, tau=0.3)
    run_conversion(prof3, ew0, root / "qwen3-ew", data_dir=data_dir)
    out["qwen3-ft"] = _ew_switch(root / "qwen3-ew", root / "qwen3-ft")
    run_conversion(prof3, ew, root / "qwen3-shared", data_dir=data_dir)
    out["qwen3-shared-ft"] = _ew_switch(root / "qwen3-shared", root / "qwen3-shared-ft")
    out["prof"] = prof
    out["root"] = root
    return out


def _logits_equal(src, native_dir):
    ref = MoelabForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    nat = AutoModelForCausalLM.from_pretrained(str(native_dir), trust_remote_code=False, dtype=torch.float32).eval()
    assert type(nat).__module__.startswith("transformers.models.")
    with torch.no_grad():
        a, b = ref(input_ids=IDS).logits, nat(input_ids=IDS).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=0), float((a - b).abs().max())
    return nat


def test_llama_ew_softmax_weighted_exports_as_qwen2_moe(convs, tmp_path):
    info = export_converted(convs["llama-ft"], tmp_path / "nat", "native")
    assert info["model_type"] == "qwen2_moe" and info["num_experts"] == 6 and info["top_k"] == 4 and info["d_shared"] == 24
    cfg = json.loads((tmp_path / "nat" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_moe" and "auto_map" not in cfg and cfg["norm_topk_prob"] is False
    assert not (tmp_path / "nat" / "modeling_moelab.py").exists()
    from safetensors import safe_open

    keys = set()
    for f in (tmp_path / "nat").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    # transformers writes Qwen2-MoE in the Hub's per-expert layout (what serving stacks read), not its stacked one
    assert {"model.layers.0.mlp.experts.5.gate_proj.weight", "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.shared_expert_gate.weight"} <= keys
    assert AutoConfig.from_pretrained(tmp_path / "nat").model_type == "qwen2_moe"
    nat = _logits_equal(convs["llama-ft"], tmp_path / "nat")
    gate = nat.model.layers[0].mlp.shared_expert_gate.weight
    assert float(gate.detach().abs().max()) == 0.0  # sigmoid(0) = 0.5, down projection doubled
    out = nat.generate(IDS[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_qwen3_without_shared_part_exports_as_qwen3_moe(convs, tmp_path):
    info = export_converted(convs["qwen3-ft"], tmp_path / "nat", "native")
    assert info["model_type"] == "qwen3_moe" and info["d_shared"] == 0
    assert json.loads((tmp_path / "nat" / "config.json").read_text())["model_type"] == "qwen3_moe"
    _logits_equal(convs["qwen3-ft"], tmp_path / "nat")


def test_dense2moe_weighted_exports_with_dense_layers(tiny_model, data_dir, tmp_path):
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    moe, rec = fuse_model(adapter, Dense2MoEParams(layer=0, n_fused=1, top_k=1, combine="weighted"), None)
    export_model(moe, tmp_path / "d2", adapter.tokenizer, rec)
    info = export_converted(tmp_path / "d2", tmp_path / "nat", "native")
    assert info["model_type"] == "qwen2_moe" and info["dense_layers"] == [1] and info["d_shared"] == 0
    assert json.loads((tmp_path / "nat" / "config.json").read_text())["mlp_only_layers"] == [1]
    _logits_equal(tmp_path / "d2", tmp_path / "nat")


# ------------------------------------------------------------------ refusals


def test_training_free_sum_combine_is_refused(convs, tmp_path):
    with pytest.raises(NativeExportError) as err:
        export_converted(convs["llama-ew"], tmp_path / "nat", "native")
    msg = str(err.value)
    assert "'centroid' router and the 'sum' combine" in msg and "fine-tune in mode expertweaver" in msg
    assert not (tmp_path / "nat").exists()


def test_per_layer_expert_counts_are_refused(convs):
    moe = MoelabForCausalLM.from_pretrained(str(convs["llama-ft"]), dtype=torch.float32)
    mod = moe.moe_modules()[1]
    g, u, dn = (t.detach() for t in expert_rows(mod))
    m = mod.expert_size
    gate_w = torch.cat([mod.shared_gate.weight, g.reshape(-1, g.shape[-1])])
    up_w = torch.cat([mod.shared_up.weight, u.reshape(-1, u.shape[-1])])
    down_w = torch.cat([mod.shared_down.weight, dn.permute(1, 0, 2).reshape(mod.d_model, -1)], 1)
    E = 5  # drop the last routed expert: layer 1 has 5 routed experts, layer 0 has 6
    new = moe_from_dense(gate_w, up_w, down_w, "silu", torch.arange(mod.d_shared),
                         torch.arange(mod.d_shared, mod.d_shared + E * m).reshape(E, m), 4, "softmax", "weighted")
    convert_in_place(moe.model, {1: new})
    moe.config.moe_layers[1] = new.spec
    with pytest.raises(NativeExportError, match=r"layer 0 has 6 routed experts and layer 1 has 5: native export needs a uniform plan"):
        native_layout(moe)


def test_qwen3_with_shared_part_is_refused(convs, tmp_path):
    with pytest.raises(NativeExportError, match="Qwen3-MoE .*no shared expert.*--alpha-min 0 --alpha-max 0"):
        export_converted(convs["qwen3-shared-ft"], tmp_path / "nat", "native")


def test_midas_and_gemma_are_refused(tiny_model, data_dir, convs, tmp_path):
    root = convs["root"]
    prof2 = _profile(tiny_model, data_dir, "llama", root, seed=6)
    run_conversion(convs["prof"], MidasParams(keep_ratio=0.5, top_k=1, surrogate_samples=256), root / "midas",
                   data_dir=data_dir, extra_profiles=[prof2])
    with pytest.raises(NativeExportError, match="layer 0 is a MIDAS low-rank MoE"):
        export_converted(root / "midas", tmp_path / "m", "native")
    with pytest.raises(NativeExportError, match="source family 'gemma2' cannot be written as a stock MoE architecture"):
        native_layout(_hand_moe(load_model(str(tiny_model("gemma2")), data_dir=data_dir)))


def _hand_moe(adapter, router="softmax", combine="weighted", **extra):
    """Layer 0 of ``adapter`` as an MoE of 4 experts of 24 neurons, top-2, no shared part (default: softmax, weighted)."""
    from moelab.engine.runtime.export import build_moe_model

    extra |= {"router_offset": torch.zeros(4)} if router == "ridge" else {}
    mlp = adapter.model.model.layers[0].mlp
    mod = moe_from_dense(mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach(),
                         getattr(adapter.model.config, "hidden_activation", None) or adapter.model.config.hidden_act,
                         [], torch.arange(96).reshape(4, 24), 2, router, combine, **extra)
    return build_moe_model(adapter, {0: mod})


def test_grouped_dense2moe_copies_are_refused(tiny_model, data_dir):
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    moe, _ = fuse_model(adapter, Dense2MoEParams(layer=0, n_fused=1, own_copies=2, top_k=1, combine="weighted"), None)
    with pytest.raises(NativeExportError, match="grouped expert copies"):
        native_layout(moe)


# ------------------------------------------------------------------ CLI and model card


def test_cli_export_native_and_refusal(convs, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, ["export", str(convs["llama-ft"]), "--format", "native", "--out", str(tmp_path / "nat")])
    assert ok.exit_code == 0, ok.output
    assert "qwen2_moe" in ok.output and (tmp_path / "nat" / "config.json").is_file()
    bad = runner.invoke(main, ["export", str(convs["llama-ew"]), "--format", "native", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 1
    assert "'sum' combine" in bad.output and "fine-tune in mode expertweaver" in bad.output
    missing = runner.invoke(main, ["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "no conversion.json" in missing.output


def test_cli_export_moelab_format_is_the_default(convs, tmp_path):
    res = CliRunner().invoke(main, ["export", str(convs["llama-ew"]), "--out", str(tmp_path / "re")])
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "re" / "config.json").read_text())
    assert cfg["model_type"] == "moelab" and (tmp_path / "re" / "modeling_moelab.py").is_file()
    assert (tmp_path / "re" / "README.md").is_file()


def test_model_card_numbers_match_the_record(convs, tmp_path):
    src = convs["llama-ft"]
    record = json.loads((src / "conversion.json").read_text())
    evaluation = {"heldout": {"source": "builtin:mixed", "windows": 2, "seq_len": 32},
                  "results": {"dense": {"perplexity": 10.0}, "converted": {"perplexity": 12.25, "perplexity_ratio": 1.225}},
                  "tasks": {"moelab_chat_qa": {"dense": {"acc": 0.5}, "converted": {"acc": 0.375, "acc_stderr": 0.02}}}}
    (src / "evaluation.json").write_text(json.dumps(evaluation))
    try:
        export_converted(src, tmp_path / "nat", "native")
    finally:
        (src / "evaluation.json").unlink()
    card = (tmp_path / "nat" / "README.md").read_text()
    s = record["summary"]
    assert f"| ffn_flops_fraction | {s['ffn_flops_fraction']:.6g} |" in card
    assert f"| total_params | {s['total_params']:,} |" in card or f"| total_params | {s['total_params']} |" in card
    assert f"| active_params | {s['active_params']:,} |" in card or f"| active_params | {s['active_params']} |" in card
    assert "expertweaver" in card and "| alpha_min | 0.25 |" in card
    assert "| 0–2 | moe | 24 | 6 × 12 | 4 | softmax | weighted |" in card
    assert "| variant | perplexity | × dense | moelab_chat_qa |" in card and "| dense | 10 | 1 | 0.5 |" in card
    assert "| converted | 12.25 | 1.225 | 0.375 |" in card and "perplexity_after 12.5" in card
    assert "trust_remote_code" not in card.split("## How to run")[1].split("```")[1]
    # the conversion's own (moelab format) card, written at conversion time
    own = (convs["llama-ew"] / "README.md").read_text()
    assert "trust_remote_code=True" in own and "Not evaluated yet" in own and "| 0–2 | moe | 24 | 6 × 12 | 4 | centroid | sum |" in own


@pytest.fixture(scope="module")
def tied_llama(tiny_model, tmp_path_factory):
    """The tiny Llama with tied input/output embeddings (as SmolLM2, the default model)."""
    from transformers import AutoTokenizer, LlamaConfig

    src = tiny_model("llama")
    config = LlamaConfig.from_pretrained(src)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path_factory.mktemp("tied-llama")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sliding_mistral(tiny_model, tmp_path_factory):
    """The tiny Mistral with a sliding window (6) shorter than the test's 16 tokens, so the window matters."""
    from transformers import AutoTokenizer, MistralConfig

    src = tiny_model("mistral")
    config = MistralConfig.from_pretrained(src)
    config.sliding_window = 6
    torch.manual_seed(2)
    out = tmp_path_factory.mktemp("sliding-mistral")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


@pytest.mark.parametrize("family,combine", [("qwen2", "weighted"), ("tied-llama", "weighted"), ("llama", "normalized"),
                                            ("gemma", "weighted"), ("sliding-mistral", "weighted")])
def test_dense2moe_round_trip_per_family(family, combine, tiny_model, tied_llama, sliding_mistral, data_dir, tmp_path):
    """Qwen2's q/k/v biases (qkv_bias), tied embeddings and Gemma's (1 + w) norms and scaled, tied embeddings
    (rewritten exactly, untied) survive the native export; the
    normalized combine is norm_topk_prob=True (checked at top-2 of 3 experts, where it is not 1)."""
    path = {"tied-llama": tied_llama, "sliding-mistral": sliding_mistral}.get(family) or tiny_model(family)
    adapter = load_model(str(path), data_dir=data_dir)
    torch.manual_seed(3)
    with torch.no_grad():  # random init leaves every norm weight at its identity (1, or 0 for Gemma's 1 + w)
        for name, p in adapter.model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    layer, n, k = (1, 1, 1) if combine == "weighted" else (0, 2, 2)
    moe, rec = fuse_model(adapter, Dense2MoEParams(layer=layer, n_fused=n, top_k=k, combine=combine), None)
    export_model(moe, tmp_path / "d2", adapter.tokenizer, rec)
    export_converted(tmp_path / "d2", tmp_path / "nat", "native")
    cfg = json.loads((tmp_path / "nat" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_moe" and cfg["mlp_only_layers"] == ([0] if combine == "weighted" else [])
    assert cfg["qkv_bias"] is (family == "qwen2") and cfg["tie_word_embeddings"] is (family == "tied-llama")
    assert cfg["hidden_act"] == ("gelu_pytorch_tanh" if family == "gemma" else "silu")
    if family == "sliding-mistral":
        assert cfg["sliding_window"] == 6 and set(cfg["layer_types"]) == {"sliding_attention"}
    assert cfg["norm_topk_prob"] is (combine == "normalized") and cfg["num_experts_per_tok"] == k
    nat = _logits_equal(tmp_path / "d2", tmp_path / "nat")
    if family == "tied-llama":
        assert nat.lm_head.weight.data_ptr() == nat.model.embed_tokens.weight.data_ptr()
    if family == "sliding-mistral":  # the window matters on these 16 tokens: full attention differs
        full = AutoModelForCausalLM.from_pretrained(str(tmp_path / "nat"), dtype=torch.float32, use_sliding_window=False,
                                                    layer_types=["full_attention"] * len(cfg["layer_types"])).eval()
        with torch.no_grad():
            assert (full(input_ids=IDS).logits - nat(input_ids=IDS).logits).abs().max() > 1e-4


def test_the_round_trip_check_is_sensitive(convs, tmp_path):
    """Negative control: without doubling the shared down projection the logits differ."""
    export_converted(convs["llama-ft"], tmp_path / "nat", "native")
    ref = MoelabForCausalLM.from_pretrained(str(convs["llama-ft"]), dtype=torch.float32).eval()
    nat = AutoModelForCausalLM.from_pretrained(str(tmp_path / "nat"), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in nat.model.layers:
            layer.mlp.shared_expert.down_proj.weight.mul_(0.5)
        diff = (ref(input_ids=IDS).logits - nat(input_ids=IDS).logits).abs().max()
    assert diff > 1e-4


def test_ew_weighted_conversion_exports_without_fine_tuning(convs, data_dir, tmp_path):
    """The centroid router scores x W^T like the softmax router: EW converted with --combine weighted exports as is."""
    ew = ExpertWeaverParams(n_experts=8, sparsity=0.25, alpha_min=0.25, alpha_max=0.25, tau=0.3, combine="weighted")
    run_conversion(convs["prof"], ew, tmp_path / "conv", data_dir=data_dir)
    info = export_converted(tmp_path / "conv", tmp_path / "nat", "native")
    assert info["model_type"] == "qwen2_moe"
    _logits_equal(tmp_path / "conv", tmp_path / "nat")


def test_evaluate_refreshes_the_model_card(convs, data_dir, tmp_path):
    import shutil

    from moelab.engine.runs import run_evaluation

    conv = tmp_path / "conv"
    shutil.copytree(convs["llama-ew"], conv)
    report = run_evaluation(conv, data_dir=data_dir, n_windows=2, seq_len=16, baselines=False)
    card = (conv / "README.md").read_text()
    ppl = report["results"]["converted"]["perplexity"]
    assert "Not evaluated yet" not in card and f"| converted | {ppl:.6g} |" in card
    b8 = report["speed"]["phases"]["decode_b8"]  # the models' times too, as the evaluation measured them
    assert (f"| decode, batch 8 | {1e3 * b8['seconds']['dense']:.1f} | {1e3 * b8['seconds']['converted']:.1f} | "
            f"{b8['speedup']['converted']:.2f} |") in card and "Speed against the dense model (PyTorch eager" in card


@pytest.mark.parametrize("fmt", ["native", "moelab"])
def test_the_cards_loading_snippet_runs(convs, tmp_path, fmt):
    export_converted(convs["llama-ft"], tmp_path / "out", fmt)
    card = (tmp_path / "out" / "README.md").read_text()
    code = card.split("## How to run")[1].split("```python")[1].split("```")[0].replace("PATH", str(tmp_path / "out"))
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the card's own snippet, on a local directory
    ids = scope["tokenizer"]("the cat sat", return_tensors="pt").input_ids
    assert scope["model"](input_ids=ids).logits.shape[-1] == scope["model"].config.get_text_config().vocab_size


def test_a_real_expertweaver_fine_tune_exports_natively(convs, data_dir, tmp_path):
    """run_finetune (2 steps, LoRA merged at export) -> the work dir exports natively, logits equal."""
    from moelab.engine.training.finetune import FinetuneParams, run_finetune

    text = tmp_path / "train.jsonl"
    text.write_text("".join(json.dumps({"text": "the cat sat on the mat and the dog sat on the log. " * 6}) + "\n"
                            for _ in range(8)))
    params = FinetuneParams(mode="expertweaver", steps=2, batch_size=2, seq_len=32, lr=1e-2, router_lr=1e-2, lora_rank=4,
                            lora_alpha=8.0, checkpoint_every=100, source=str(text), eval_source="builtin:mixed",
                            eval_windows=2)
    run_finetune(convs["llama-ew"], params, tmp_path / "ft", data_dir=data_dir, device="cpu")
    info = export_converted(tmp_path / "ft", tmp_path / "nat", "native")  # the work dir: its model/
    assert info["model_type"] == "qwen2_moe" and info["source"].endswith("model")
    _logits_equal(tmp_path / "ft" / "model", tmp_path / "nat")
    card = (tmp_path / "nat" / "README.md").read_text()
    assert "Fine-tuned (expertweaver, 2 steps" in card


def test_layout_table_groups_runs_of_equal_layers():
    from moelab.engine.runtime.model_card import _layer_rows

    moe = {"kind": "moe", "d_shared": 8, "n_routed": 4, "expert_size": 8, "top_k": 2, "router": "softmax", "combine": "weighted"}
    rows = _layer_rows([{"kind": "dense"}, moe, moe, {**moe, "top_k": 3}, {"kind": "lowrank_moe", "rank": 4, "n_experts": 2,
                                                                          "d_ffn": 96, "top_k": 1}])
    assert rows[2:] == ["| 0 | dense | - | - | - | - | - |", "| 1–2 | moe | 8 | 4 × 8 | 2 | softmax | weighted |",
                        "| 3 | moe | 8 | 4 × 8 | 3 | softmax | weighted |",
                        "| 4 | low-rank MoE (rank 4) | 0 | 2 × 96 | 1 | softmax | normalized |"]


@pytest.mark.parametrize("router,combine", [("representative", "sum"), ("gate_mass", "weighted"), ("ridge", "weighted"),
                                            ("centroid", "scaled"), ("centroid", "sum")])
def test_routers_and_combines_a_stock_gate_cannot_compute_are_refused(router, combine, tiny_model, data_dir):
    moe = _hand_moe(load_model(str(tiny_model("llama")), data_dir=data_dir), router, combine)
    with pytest.raises(NativeExportError, match=f"layer 0 routes with the '{router}' router and the '{combine}' combine"):
        native_layout(moe)


def test_skipped_expert_compensation_is_refused(tiny_model, data_dir):
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    moe = _hand_moe(adapter, skip_mean=torch.ones(4, adapter.d_model))
    with pytest.raises(NativeExportError, match="layer 0 adds the means of the experts a token skips .*compensation 'none'"):
        native_layout(moe)


def test_part_of_each_experts_down_projection_is_refused(tiny_model, data_dir):
    moe = _hand_moe(load_model(str(tiny_model("llama")), data_dir=data_dir), down_keep=0.5)
    with pytest.raises(NativeExportError, match="runs only part of each active expert's down projection .*down_keep 1"):
        native_layout(moe)
