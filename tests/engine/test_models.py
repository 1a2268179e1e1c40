import time

import pytest
import torch
import transformers

from tests.conftest import FAMILIES
from moelab.engine.models import ModelError, adapt, load_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapter_finds_glu_of_every_family(family, tiny_model, data_dir):
    adapter = load_model(str(tiny_model(family)), data_dir=data_dir)
    info = adapter.describe()
    assert info["n_layers"] == 3 and info["d_model"] == 64 and info["d_ffn"] == [96, 96, 96]
    assert info["fused_gate_up"] == (family == "phi3")
    assert ("gelu" in info["activation"]) == family.startswith("gemma")
    torch.manual_seed(1)
    x = torch.randn(5, 64)
    for lay in adapter.layers:
        assert lay.gate_weight().shape == lay.up_weight().shape == (96, 64)
        assert lay.down_weight().shape == (64, 96)
        # The neuron-slice view reproduces the module: down(act(x Wg) * x Wu) == mlp(x).
        h = lay.act_fn(x @ lay.gate_weight().T) * (x @ lay.up_weight().T)
        with torch.no_grad():
            torch.testing.assert_close(h @ lay.down_weight().T, lay.mlp(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_norm_on_the_mlp_output_is_found_with_its_gain(family, tiny_model, data_dir):
    """Gemma 2/3 and OLMo 2 add ``post_feedforward_layernorm(mlp(x))`` to the stream; the gain is
    ``1 + w`` in Gemma's parametrisation and ``w`` in OLMo 2's."""
    adapter = load_model(str(tiny_model(family)), data_dir=data_dir)
    for lay in adapter.layers:
        y = torch.randn(5, 64) * torch.tensor([1e-4, 1e-3, 1e-2, 1.0, 10.0])[:, None]  # where ε matters too
        if family not in ("gemma2", "gemma3_text", "olmo2"):
            assert lay.post_norm is None and lay.output_gain(y) is None
            continue
        norm = lay.post_norm
        assert norm is lay.block.post_feedforward_layernorm
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(-0.5, 2.0, 64))
        eps = getattr(norm, "eps", None) or norm.variance_epsilon
        g = 1 + norm.weight.detach() if family.startswith("gemma") else norm.weight.detach()
        torch.testing.assert_close(lay.output_gain(y), g / (y.pow(2).mean(-1, keepdim=True) + eps).sqrt(), rtol=1e-4, atol=0)


def test_non_gated_model_is_refused_by_type():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100))
    with pytest.raises(ModelError, match="gpt2"):
        adapt(model)


def test_missing_local_model_has_actionable_error(tmp_path, data_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path / "empty"), data_dir=data_dir)
    with pytest.raises(ModelError, match="not a local directory"):
        load_model("no-such-org/no-such-model-xyz", data_dir=data_dir)


def test_trust_remote_code_is_off_by_default(tmp_path, data_dir, tiny_model):
    import json
    import shutil

    target = tmp_path / "remote"
    shutil.copytree(tiny_model("llama"), target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    cfg["model_type"] = "moelab-unknown"
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="trust_remote_code"):
        load_model(str(target), data_dir=data_dir)


@pytest.mark.slow
def test_default_model_loads_from_cache_quickly(default_model_dir, data_dir):
    t0 = time.perf_counter()
    adapter = load_model("default", data_dir=data_dir)
    elapsed = time.perf_counter() - t0
    info = adapter.describe()
    assert info["family"] == "llama" and info["n_layers"] == 30 and info["d_ffn"][0] == 1536
    assert elapsed < 5.0, f"second load of the cached default model took {elapsed:.1f}s"
    ids = adapter.tokenizer("The capital of France is", return_tensors="pt")
    out = adapter.model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in adapter.tokenizer.decode(out[0])


def test_a_gguf_is_parsed_once_while_transformers_reads_it_three_times(tmp_path):
    """``gguf_read_once``: inside the block every GGUFReader of one file is the same parse and the tensor-name map is
    built once per architecture; after it, gguf-py's own reader and map are back (a later file is read anew)."""
    import gguf
    import numpy as np

    from moelab.engine.models import gguf_read_once

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("t.count", 3)
    writer.add_tensor("w", np.arange(8, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_read_once():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again and list(first.tensors[0].data) == list(range(8))
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not first


def test_transformers_gguf_bar_follows_its_progress_switch():
    """transformers dequantises a GGUF under plain tqdm, which its ``disable_progress_bar`` does not reach (``moelab
    evaluate --quiet`` printed "Converting and de-quantizing GGUF tensors"): inside ``gguf_read_once`` the bar
    follows that switch, and after it transformers' own tqdm is back."""
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as hf_logging

    from moelab.engine.models import gguf_read_once

    own, was_enabled = gguf_loading.tqdm, hf_logging.is_progress_bar_enabled()
    try:
        for enabled in (False, True):
            (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
            with gguf_read_once():
                bar = gguf_loading.tqdm(range(2), desc="Converting and de-quantizing GGUF tensors...")
                assert bar.disable is not enabled
                bar.close()
            assert gguf_loading.tqdm is own
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
