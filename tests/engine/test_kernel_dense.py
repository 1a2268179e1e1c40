"""The dense model in moelab's kernels (``evaluation.kernel_dense``) and a layer that selects no expert at a decode
step (``MoeFFN``'s whole-block call with the shared expert alone): the same outputs as torch's, the dense model's
weights shared and left as they were, the reasons it cannot run, and the sparsity's gain read from a timing."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import psutil

import pytest
import torch

from moelab.engine.evaluation.kernel_dense import kernel_dense_mlps, kernel_dense_problem
from moelab.engine.evaluation.kernel_gain import NAME, sparsity_gain
from moelab.engine.evaluation.metrics import swapped_mlps
from moelab.engine.evaluation.speed import _cache, _cache_kwarg
from moelab.engine.models import load_model
from moelab.engine.runtime import moelab_native
from moelab.engine.runtime.moelab_moe import MoeFFN

native = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler: no native kernels")


def _decode_logits(model, ids, steps=3):
    """The logits of ``steps`` cached decode steps of each row of ``ids``, after a prefill of the tokens before."""
    kwarg = _cache_kwarg(model)
    with torch.no_grad():
        cache = _cache(model(ids[:, :-steps], use_cache=True))
        return torch.cat([model(ids[:, i:i + 1], **{kwarg: cache}, use_cache=True).logits
                          for i in range(ids.shape[1] - steps, ids.shape[1])], 1)


@native
@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
def test_the_dense_model_in_the_kernels_computes_what_it_computes_in_torch(family, tiny_model, data_dir, one_thread):
    """Each MLP swapped for its all-shared ``MoeFFN``: decode steps of 1 and 8 sequences and a prefill give dense's
    logits to float rounding, each step ran the whole-block call, the gate and up weights are dense's own tensors,
    and the dense model is as it was after (its down projection's storage too)."""
    adapter = load_model(str(tiny_model(family)), data_dir=data_dir)
    model = adapter.model.eval()
    assert kernel_dense_problem(adapter) is None
    strides = [lay.down_proj.weight.stride() for lay in adapter.layers]
    mods = kernel_dense_mlps(adapter)
    assert sorted(mods) == [lay.index for lay in adapter.layers]
    for lay in adapter.layers:
        assert mods[lay.index].shared_gate.weight.data_ptr() == lay.gate_weight().data_ptr()
        assert mods[lay.index].shared_up.weight.data_ptr() == lay.up_weight().data_ptr()
        assert mods[lay.index].shared_down.weight.data_ptr() != lay.down_weight().data_ptr()  # a copy, decode layout
        assert torch.equal(mods[lay.index].shared_down.weight, lay.down_weight())
    ids = torch.randint(0, 500, (8, 24), generator=torch.Generator().manual_seed(0))
    for rows in (ids[:1], ids):
        dense = _decode_logits(model, rows)
        with swapped_mlps(adapter, mods):
            kernel = _decode_logits(model, rows)
        assert (kernel - dense).abs().max() <= 1e-4 * dense.abs().max(), family
    assert all(m.__dict__["_fused_kept"].call is not None for m in mods.values())  # the decode call ran
    with torch.no_grad(), swapped_mlps(adapter, mods):
        prefill = model(ids[:1]).logits
    with torch.no_grad():
        assert torch.allclose(prefill, model(ids[:1]).logits, rtol=0, atol=1e-5 * float(prefill.abs().max()))
    assert [lay.down_proj.weight.stride() for lay in adapter.layers] == strides
    assert all(type(lay.mlp) is not MoeFFN for lay in adapter.layers)


def test_a_model_the_kernels_cannot_run_says_why(tiny_model, data_dir, monkeypatch):
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    adapter.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32 on the CPU; this model is bfloat16 on cpu"):
        kernel_dense_mlps(adapter)
    adapter.model.to(torch.float32)
    monkeypatch.setattr(adapter, "activation", "relu2")
    assert kernel_dense_problem(adapter) == "moelab's kernels have no 'relu2' activation"
    monkeypatch.undo()
    monkeypatch.setattr(moelab_native, "library", lambda: None)
    assert "not built on this machine" in kernel_dense_problem(adapter)
    monkeypatch.undo()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1000))
    assert kernel_dense_problem(adapter).startswith("its down projections' copy in the decode layout (")
    assert kernel_dense_problem(adapter).endswith("would take more than half the memory free (1000 B)")
    monkeypatch.undo()
    lay = adapter.layers[0]
    lay.down_proj.bias = torch.nn.Parameter(torch.zeros(lay.down_proj.out_features))
    assert kernel_dense_problem(adapter) == "its MLPs have biases, which moelab's kernels do not add"


@native
@pytest.mark.parametrize("spec", [
    {"d_shared": 96, "n_routed": 0, "expert_size": 0, "top_k": 0},
    {"d_shared": 96, "n_routed": 0, "expert_size": 0, "top_k": 0, "down_keep": 0.5},
    {"d_shared": 32, "n_routed": 8, "expert_size": 8, "top_k": 0, "skip_mean": True},
    {"d_shared": 0, "n_routed": 8, "expert_size": 8, "top_k": 0, "skip_mean": True},
])
def test_a_layer_that_selects_no_expert_decodes_in_the_whole_block_call(spec, one_thread):
    """Top-0 (and all-shared) layers: a decode step of 1-8 tokens runs the shared expert alone in the native call,
    with its kept products under down_keep and every skipped expert's mean, as the torch path computes it; the
    recorder hears that no expert was selected."""
    torch.manual_seed(0)
    ffn = MoeFFN({"kind": "moe", "d_model": 40, **spec}).eval()
    if ffn.compensated:
        ffn.skip_mean.normal_()
    heard = []
    ffn.recorder = heard.append
    for tokens in (1, 5, 8):
        x = torch.randn(1, tokens, 40)
        with torch.no_grad():
            got = ffn(x)
            want = ffn._shared(x.reshape(-1, 40)).reshape(x.shape)
        if ffn.compensated:
            want = want + ffn.skip_mean.sum(0)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (spec, tokens)
        assert heard[-1].shape == (1, tokens, 0)
    assert ffn.__dict__["_fused_kept"].call is not None


def test_the_sparsitys_gain_is_read_round_by_round_against_the_kernel_baseline():
    speed = {"phases": {
        "decode_b1": {"rounds": {"dense": [3.0, 3.0, 3.0], NAME: [2.0, 2.2, 2.0], "converted": [1.0, 2.0, 1.6]},
                      "speedup": {"dense": 1.0, NAME: 1.5, "converted": 2.0}},
        "prefill": {"speedup": {"dense": 1.0, NAME: 0.8, "converted": 1.2}},  # rounds not kept: the quotient
        "decode_b8": {"rounds": {"dense": [1.0], "converted": [1.0]}, "speedup": {"dense": 1.0, "converted": 1.0}},
    }}
    gain = sparsity_gain(speed)
    assert gain["decode_b1"] == pytest.approx(1.25)  # median of 2.0, 1.1, 1.25
    assert gain["prefill"] == pytest.approx(1.5) and "decode_b8" not in gain
    assert sparsity_gain({"phases": {"prefill": {"speedup": {"dense": 1.0, "converted": 1.2}}}}) == {}


def _kernel_decoded(module) -> bool:
    """Whether ``module`` has ``moelab_dense``'s decode call (a loaded export runs its own copy of the runtime)."""
    return any(c.__name__ == "KernelDecode" for c in type(module).__mro__)


@native
@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_a_layer_a_conversion_keeps_dense_decodes_in_the_kernels_once_loaded(family, tiny_model, data_dir, tmp_path,
                                                                              monkeypatch, one_thread):
    """``moelab_dense``: a loaded conversion's dense layer is its base MLP still (class name, isinstance, keys on
    disk), its down projection in the decode layout, and a decode step runs the whole-block call with the torch
    path's logits; Phi-3's fused gate/up MLP is left as it is. The model built in memory (which takes the dense model
    over) has its kept layers so too, so that it computes the loaded model's bits. Exported again, the same bytes are
    written."""
    from safetensors import safe_open

    from moelab.engine.runtime.export import build_moe_model, export_model, load_exported
    from tests.engine.test_moe_runtime import convert_adapter

    adapter = load_model(str(tiny_model(family)), data_dir=data_dir)
    base_mlp = type(adapter.layers[1].mlp)
    moe = build_moe_model(adapter, {0: convert_adapter(adapter, top_k=2)[0]})  # layers 1 and 2 stay dense
    applies = family != "phi3"
    assert [_kernel_decoded(block.mlp) for block in moe.model.model.layers[1:]] == [applies] * 2  # as once loaded
    out = export_model(moe, tmp_path / "moe", adapter.tokenizer, {})
    loaded = load_exported(out).eval()
    dense_layers = [block.mlp for block in loaded.model.model.layers[1:]]
    assert all(_kernel_decoded(m) == applies and isinstance(m, base_mlp) and type(m).__name__ == base_mlp.__name__
               for m in dense_layers)
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # a prefill: the in-memory model and the loaded one, bit for bit
        assert torch.equal(moe(input_ids=ids).logits, loaded(input_ids=ids).logits)
    if applies:
        assert all(m.down_proj.weight.t().is_contiguous() for m in dense_layers)
    ids = torch.randint(0, 500, (8, 20), generator=torch.Generator().manual_seed(1))
    for rows in (ids[:1], ids):
        kernel = _decode_logits(loaded, rows)
        assert all(m.__dict__["_fused_kept"].call is not None for m in dense_layers if applies)  # the call ran
        monkeypatch.setenv("MOELAB_NATIVE_KERNELS", "0")
        torch_path = _decode_logits(loaded, rows)
        monkeypatch.delenv("MOELAB_NATIVE_KERNELS")
        assert (kernel - torch_path).abs().max() <= 1e-4 * torch_path.abs().max(), family
    again = export_model(loaded, tmp_path / "again", adapter.tokenizer, {})
    with safe_open(out / "model.safetensors", "pt") as a, safe_open(again / "model.safetensors", "pt") as b:
        for key in (k for k in a.keys() if ".layers.1.mlp." in k):
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
        keys = {k.rsplit(".mlp.", 1)[1] for k in a.keys() if ".layers.1.mlp." in k}
        assert keys == {k.rsplit(".mlp.", 1)[1] for k in b.keys() if ".layers.1.mlp." in k}
        assert keys == ({"gate_proj.weight", "up_proj.weight", "down_proj.weight"} if applies
                        else {"gate_up_proj.weight", "down_proj.weight"})
