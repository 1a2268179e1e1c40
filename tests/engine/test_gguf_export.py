"""GGUF export (issue 25): converted and dense models run by stock llama.cpp (llama-cpp-python,
built from its PyPI sdist by scripts/install.sh), computing moelab's logits.

Every exportable layout (uniform experts with a shared part, with none, with leading dense layers;
Llama and Mistral sources; the default model) is converted, switched to EW Eq. 11 (softmax router,
weighted combine) by the fine-tuning mode's own ``prepare_recovery`` with 0 steps, exported with
``moelab export --format gguf --type f32`` and loaded by llama.cpp with an f32 KV cache: its logits
must be within 1e-3 of moelab's fp32 model on the same tokens, and 32 greedy tokens the same. f16
and q8_0 files load and generate. Every layout llama.cpp cannot express is refused, naming what
blocks it, before anything is written.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from moelab.cli import main
from tests.engine.test_native_export import IDS, _ew_switch, _profile
from moelab.engine.methods.expertweaver import ExpertWeaverParams
from moelab.engine.runs import run_conversion
from moelab.engine.runtime.export import export_model
from moelab.engine.runtime.gguf_layout import gguf_layout, gguf_refusal
from moelab.engine.runtime.modeling_moelab import MoelabForCausalLM
from moelab.engine.training.finetune import load_tokenizer

llama_cpp = pytest.importorskip("llama_cpp", reason="scripts/install.sh installs llama-cpp-python")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py

TOKENS = [int(t) for t in IDS[0]] + [int(t) for t in IDS[1]]
GREEDY = 32


# --------------------------------------------------------------------------- layouts (no model)

BASE = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 3, "hidden_act": "silu"}
MOE = {"kind": "moe", "d_model": 64, "d_shared": 24, "n_routed": 6, "expert_size": 12, "top_k": 4, "router": "softmax",
       "combine": "weighted", "act": "silu"}


def _config(*layers, **base):
    return {"base_config": {**BASE, **base}, "moe_layers": [copy.deepcopy(s) for s in layers]}


def test_a_uniform_layout_maps_with_the_shared_part_padded_to_whole_experts():
    lay = gguf_layout(_config({"kind": "dense"}, {**MOE, "d_shared": 20}, {**MOE, "d_shared": 0}))
    assert lay == {"n_layers": 3, "leading_dense": 1, "num_experts": 6, "expert_size": 12, "top_k": 4,
                   "n_shared_experts": 2, "shared_padding": {1: 4, 2: 24}}
    # no shared neuron anywhere: one zero expert's worth, since llama.cpp's deepseek always runs the shared branch
    assert gguf_layout(_config(*[{**MOE, "d_shared": 0}] * 3))["n_shared_experts"] == 1


@pytest.mark.parametrize("layers,base,words", [
    ((MOE, {"kind": "dense"}, MOE), {}, "layer 1 is dense after MoE layer 0"),
    ((MOE, {**MOE, "top_k": 3}, MOE), {}, "layer 0 has 4 active experts and layer 1 has 3"),
    ((MOE, {**MOE, "n_routed": 5}, MOE), {}, "6 routed experts and layer 1 has 5"),
    ((MOE, MOE, {**MOE, "router": "ridge"}), {}, "layer 2 routes with the 'ridge' router"),
    ((MOE, {**MOE, "combine": "sum"}, MOE), {}, "combines its experts with 'sum'"),
    ((MOE, {**MOE, "combine": "normalized"}, MOE), {}, "combines its experts with 'normalized'"),
    ((MOE, {**MOE, "skip_mean": True}, MOE), {}, "skipped_mean"),
    ((MOE, {**MOE, "down_keep": 0.5}, MOE), {}, "part of each active expert's down projection (down_keep 0.5)"),
    ((MOE, {**MOE, "top_k": 0}, MOE), {}, "runs no routed expert"),
    ((MOE, {"kind": "lowrank_moe"}, MOE), {}, "MIDAS low-rank"),
    ((MOE, {"kind": "abstopk"}, MOE), {}, "AbsTopK"),
    ((MOE, {"kind": "teal"}, MOE), {}, "TEAL activation-sparse GLU"),
    ((MOE, MOE, MOE), {"model_type": "qwen2"}, "source family 'qwen2'"),
    ((MOE, MOE, MOE), {"attention_bias": True}, "attention biases"),
    ((MOE, MOE, MOE), {"rope_parameters": {"rope_type": "llama3"}}, "scales RoPE"),
    ((MOE, MOE, MOE), {"model_type": "mistral", "sliding_window": 256, "max_position_embeddings": 512}, "slides its attention"),
    (({"kind": "dense"},) * 3, {}, "no MoE layer"),
])
def test_layouts_llamacpp_cannot_express_are_refused_with_the_reason(layers, base, words):
    why = gguf_refusal(_config(*layers, **base))
    assert why is not None and words in why, why


def test_the_refusal_names_the_route_that_exports():
    why = gguf_refusal(_config(MOE, {**MOE, "router": "ridge"}, MOE))
    assert "--recipe portable" in why and "--format moelab" in why


# --------------------------------------------------------------------------- real llama.cpp


def _leading_dense(conv, dense_dir, out):
    """``conv`` with layer 0 put back to the source's dense MLP (a leading dense layer)."""
    moe = MoelabForCausalLM.from_pretrained(str(conv), dtype=torch.float32)
    dense = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32)
    moe.model.model.layers[0].mlp = dense.model.layers[0].mlp
    moe.config.moe_layers = [{"kind": "dense"}] + list(moe.config.moe_layers[1:])
    export_model(moe, out, load_tokenizer(conv), json.loads((conv / "conversion.json").read_text()))
    return out


@pytest.fixture(scope="module")
def layouts(tiny_model, data_dir, tmp_path_factory):
    """name -> an exportable (EW Eq. 11, uniform) conversion directory."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    shared = ExpertWeaverParams(n_experts=8, sparsity=0.25, alpha_min=0.25, alpha_max=0.25, tau=0.3)
    none = ExpertWeaverParams(n_experts=8, sparsity=0.25, alpha_min=0.0, alpha_max=0.0, tau=0.3)
    for family in ("llama", "mistral"):
        prof = _profile(tiny_model, data_dir, family, root)
        run_conversion(prof, shared, root / f"{family}-ew", data_dir=data_dir)
        out[f"{family}-shared"] = _ew_switch(root / f"{family}-ew", root / f"{family}-shared")
    run_conversion(prof, none, root / "mistral-none", data_dir=data_dir)
    out["mistral-no-shared"] = _ew_switch(root / "mistral-none", root / "mistral-no-shared-ft")
    out["llama-leading-dense"] = _leading_dense(out["llama-shared"], tiny_model("llama"), root / "llama-lead")
    return out


def _llama(path, n_ctx=128):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=2, logits_all=True,
                           verbose=False, type_k=0, type_v=0)  # GGML_TYPE_F32 KV cache: the f32 file's own precision


def _llamacpp_run(path, tokens, n_new):
    """(logits of ``tokens`` [T, V], ``n_new`` greedy tokens) from llama.cpp."""
    llm = _llama(path)
    try:
        llm.eval(tokens)
        logits = np.array(llm.scores[: len(tokens)], dtype=np.float64)
        new = []
        for _ in range(n_new):
            new.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([new[-1]])
        return logits, new
    finally:
        llm.close()


@torch.no_grad()
def _torch_run(model, tokens, n_new):
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0].double().numpy()
    out = model.generate(ids, max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new, eos_token_id=None,
                         pad_token_id=0)
    return logits, [int(t) for t in out[0, len(tokens):]]


def _export(src, out, gguf_type="f32"):
    res = CliRunner().invoke(main, ["export", str(src), "--format", "gguf", "--type", gguf_type, "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def exported(layouts, tmp_path_factory):
    """``exported(name, type)``: ``moelab export`` of a layout, once per module (each export runs llama.cpp's converter)."""
    done: dict[tuple[str, str], dict] = {}

    def get(name: str, gguf_type: str = "f32") -> dict:
        if (name, gguf_type) not in done:
            done[name, gguf_type] = _export(layouts[name], tmp_path_factory.mktemp("g") / "out", gguf_type)
        return done[name, gguf_type]

    return get


@pytest.mark.parametrize("name", ["llama-shared", "mistral-shared", "mistral-no-shared", "llama-leading-dense"])
def test_llamacpp_computes_moelabs_logits_and_greedy_tokens(layouts, exported, name):
    info = exported(name)
    assert info["architecture"] == "deepseek"
    lay = info["layout"]
    assert lay["leading_dense"] == (1 if name == "llama-leading-dense" else 0)
    assert lay["n_shared_experts"] == (1 if name == "mistral-no-shared" else 2)
    moe = MoelabForCausalLM.from_pretrained(str(layouts[name]), dtype=torch.float32).eval()
    ref, ref_new = _torch_run(moe, TOKENS, GREEDY)
    got, got_new = _llamacpp_run(info["file"], TOKENS, GREEDY)
    assert np.abs(got - ref).max() < 1e-3, np.abs(got - ref).max()
    assert got_new == ref_new


def test_the_export_directory_runs_in_ollama_and_says_how(exported):
    info = exported("llama-shared", "q8_0")
    out = Path(info["out"])
    name = info["file"].rsplit("/", 1)[1]
    assert name.endswith("-q8_0.gguf")
    assert (out / "Modelfile").read_text() == f"FROM ./{name}\n"
    card = (out / "README.md").read_text()
    assert f"llama-cli -m {name}" in card and "ollama create" in card and "6 routed experts of 12 neurons, top-4" in card
    record = json.loads((out / "conversion.json").read_text())
    assert record["gguf"]["type"] == "q8_0" and record["gguf"]["layout"]["num_experts"] == 6


def test_q8_0_says_when_experts_are_not_whole_blocks(exported):
    """Rows of 12 neurons are not whole q8_0 blocks: the converter keeps the experts' down projections in
    f16, and the export says so (the reason --recipe portable's experts are multiples of 32 wide)."""
    from gguf import GGMLQuantizationType, GGUFReader

    from moelab.engine.runtime.gguf_export import quantisation_note

    info = exported("llama-shared", "q8_0")
    assert "experts of 12 neurons are not whole 32-value blocks" in info["note"]
    types = {t.name: t.tensor_type for t in GGUFReader(info["file"]).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == GGMLQuantizationType.F16, types["blk.1.ffn_down_exps.weight"]
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q8_0  # rows of d_model = 64: whole blocks
    assert quantisation_note(96, "q8_0") is None and quantisation_note(12, "f32") is None


def test_f16_says_when_expert_rows_are_not_whole_steps_of_its_dot_product(exported):
    """ggml-cpu's f16 dot product runs 64 values per step on AVX-512 and the rest of a row one value at a time; the
    export names expert counts of this model whose experts are whole steps (the reason --recipe portable takes 12
    experts, 128 neurons, on the default model: 16 are 96 wide)."""
    from moelab.engine.runtime.gguf_export import quantisation_note, widths_that_fit

    info = exported("llama-shared", "f16")
    assert "f16: experts of 12 neurons are not a multiple of 64" in info["note"] and "the last 12 of every" in info["note"]
    assert quantisation_note(128, "f16", 1536) is None
    said = quantisation_note(96, "f16", 1536)
    assert "the last 32 of every expert" in said and "--n-experts 8 or 12 (experts of 192 or 128)" in said
    assert widths_that_fit(1536, 64, 16) == [8, 12] and widths_that_fit(14336, 64, 16) == [14, 16]
    assert all(1536 % n == 0 and (1536 // n) % 64 == 0 for n in widths_that_fit(1536, 64, 16, count=6))


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_f16_and_q8_0_files_load_and_generate(exported, gguf_type):
    info, f32 = exported("llama-shared", gguf_type), exported("llama-shared")
    assert info["bytes"] < 0.7 * f32["bytes"]
    llm = _llama(info["file"])
    try:
        out = llm.create_completion(TOKENS, max_tokens=8, temperature=0.0)
        assert out["usage"]["completion_tokens"] == 8
    finally:
        llm.close()


def test_refusals_write_nothing_and_exit_non_zero(layouts, tmp_path):
    conv = layouts["llama-shared"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in conv.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["moe_layers"][1]["router"] = "ridge"
    (bad / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(main, ["export", str(bad), "--format", "gguf", "--out", str(tmp_path / "g")])
    assert res.exit_code != 0 and "'ridge' router" in res.output
    assert not (tmp_path / "g").exists()
    res = CliRunner().invoke(main, ["export", str(conv), "--format", "gguf", "--type", "q4_k", "--out", str(tmp_path / "g")])
    assert res.exit_code != 0 and "q4_k" in res.output


# --------------------------------------------------------------------------- the default model, dense and converted


@pytest.fixture(scope="module")
def default_conversion(default_model_dir, data_dir, tmp_path_factory):
    """The default model converted with a uniform ExpertWeaver plan and switched to EW Eq. 11 (0 steps)."""
    from tests.engine.test_profiling import make_set
    from moelab.engine.models import load_model
    from moelab.engine.profiling.profiler import ProfileSettings, profile_model
    from moelab.engine.profiling.store import write_profile

    root = tmp_path_factory.mktemp("gguf-default")
    cset = make_set(n=24, tasks=4, seed=3)
    res = profile_model(load_model(str(default_model_dir), data_dir=data_dir, dtype="float32"), cset,
                        ProfileSettings(max_tokens=48, batch_tokens=384))
    prof = write_profile(res, cset, root / "prof")
    params = ExpertWeaverParams(n_experts=16, sparsity=0.25, alpha_min=0.25, alpha_max=0.25, max_iter=10)
    run_conversion(prof, params, root / "ew", data_dir=data_dir)
    return _ew_switch(root / "ew", root / "ft")


@pytest.mark.slow
def test_the_default_models_conversion_and_its_dense_baseline_run_in_llamacpp(default_conversion, default_model_dir,
                                                                               tmp_path):
    tokens = load_tokenizer(default_conversion)("def add(a, b):\n    return a + b\n\nThe capital of France is")["input_ids"]
    moe = MoelabForCausalLM.from_pretrained(str(default_conversion), dtype=torch.float32).eval()
    info = _export(default_conversion, tmp_path / "moe")
    ref, ref_new = _torch_run(moe, tokens, GREEDY)
    got, got_new = _llamacpp_run(info["file"], tokens, GREEDY)
    assert np.abs(got - ref).max() < 1e-3, np.abs(got - ref).max()
    assert got_new == ref_new
    dense = _export("default", tmp_path / "dense")
    assert dense["architecture"] == "llama"
    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    ref, ref_new = _torch_run(model, tokens, GREEDY)
    got, got_new = _llamacpp_run(dense["file"], tokens, GREEDY)
    assert np.abs(got - ref).max() < 1e-3 and got_new == ref_new
    # the dense .gguf re-typed by llama.cpp is the baseline at the same --type as a converted q8_0 file
    q8 = _export(dense["file"], tmp_path / "dense-q8", "q8_0")
    assert q8["architecture"] == "llama" and q8["bytes"] < 0.35 * dense["bytes"]
    q8_logits, _ = _llamacpp_run(q8["file"], tokens, 0)
    # 8-bit weights move near-ties (top-1 agreed at 87% of positions when measured), never far: dense's
    # top token stays in q8_0's top 5 and the logit vectors correlate at 0.998
    top5 = np.argsort(-q8_logits, axis=1)[:, :5]
    assert all(ref[i].argmax() in top5[i] for i in range(len(tokens)))
    assert np.mean([np.corrcoef(ref[i], q8_logits[i])[0, 1] for i in range(len(tokens))]) > 0.99


@pytest.mark.parametrize("sparsity", [0.25, 0.5])
def test_the_path_a_user_takes_gives_llamacpp_moelabs_logits(tiny_model, data_dir, tmp_path, sparsity):
    """Issue 38 item 0, through the commands a user runs: ``moelab profile`` → ``convert --recipe portable`` →
    ``finetune --mode expertweaver`` (a real optimizer step: LoRA merged, routers trained) → ``export --format gguf
    --type f32`` and ``--format native``: llama.cpp (f32 KV cache, as the model card says) and transformers compute
    the fine-tuned model's logits on real text within 1e-3 at both costs."""
    from transformers import AutoModelForCausalLM as Auto

    env = {"MOELAB_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    run = lambda *args: CliRunner().invoke(main, [*args, "--json"], env=env)  # noqa: E731
    prof, conv, ft = tmp_path / "p", tmp_path / "c", tmp_path / "ft"
    for args in (["profile", "--model", str(tiny_model("llama")), "--calib", "builtin:mixed", "--samples", "24",
                  "--max-tokens", "64", "--out", str(prof), "--quiet"],
                 ["convert", "--profile", str(prof), "--recipe", "portable", "--sparsity", str(sparsity), "--n-experts", "8",
                  "--fit-tokens", "512", "--out", str(conv), "--quiet"],
                 ["finetune", str(conv), "--mode", "expertweaver", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                  "--eval-windows", "1", "--out", str(ft), "--quiet"]):
        res = run(*args)
        assert res.exit_code == 0, (args[0], res.output[-2000:])
    model_dir = ft / "model"
    gguf = run("export", str(model_dir), "--format", "gguf", "--type", "f32", "--out", str(tmp_path / "g"))
    assert gguf.exit_code == 0, gguf.output[-2000:]
    native = run("export", str(model_dir), "--format", "native", "--out", str(tmp_path / "n"))
    assert native.exit_code == 0, native.output[-2000:]
    card = (tmp_path / "g" / "README.md").read_text()
    assert "-ctk f32 -ctv f32" in card and "type_k=0, type_v=0" in card  # how to run it exactly
    tok = load_tokenizer(model_dir)
    text = ("The committee met on Tuesday to discuss the budget for next year. def mean(xs):\n    return sum(xs) / len(xs)\n"
            "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.")
    ids = tok(text)["input_ids"]
    moe = MoelabForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = moe(input_ids=torch.tensor([ids])).logits[0].double().numpy()
        hf = Auto.from_pretrained(json.loads(native.stdout)["out"], dtype=torch.float32).eval()
        native_logits = hf(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    got, _ = _llamacpp_run(json.loads(gguf.stdout)["file"], ids, 0)
    assert np.abs(native_logits - ref).max() < 1e-3, np.abs(native_logits - ref).max()
    assert np.abs(got - ref).max() < 1e-3, np.abs(got - ref).max()
