"""A decode step's projections outside the FFN in moelab's native call (``runtime.moelab_linear``): the values of
``nn.Linear`` to float32 rounding, a token's bits independent of its step's other tokens and of the thread count,
torch's own forward wherever the call does not apply, every converted model's attention and LM head in it (its FFNs
and keys untouched), and a baseline swapped into the dense model timed in it for the time of its rounds only."""

from __future__ import annotations

import shutil
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moelab.engine.core.speed_prediction import predict
from moelab.engine.evaluation.kernel_dense import kernel_dense_mlps
from moelab.engine.evaluation.metrics import swapped_mlps
from moelab.engine.models import load_model
from moelab.engine.runtime import moelab_native
from moelab.engine.runtime.export import load_exported
from moelab.engine.runtime.modeling_moelab import decoder_layers, layer_ffns
from moelab.engine.runtime.moelab_linear import KernelLinear, kernel_projections, projections, projections_in_kernels

from tests.engine.test_kernel_dense import _decode_logits

native = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler: no native kernels")


def _kernel_linear(n: int, d: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(d, n, bias=bias)
    lin.__class__ = KernelLinear
    return lin


@native
@pytest.mark.parametrize("n, d, bias", [(37, 100, True), (200, 576, False), (96, 64, True), (1, 7, False)])
def test_the_call_computes_nn_linear_and_a_tokens_bits_do_not_depend_on_its_step(n, d, bias):
    """Widths the 32-wide loop tiles and ones it does not; 1-8 tokens on 1-3 threads: ``F.linear``'s values, and each
    token's output row the same bits as when it runs alone on one thread."""
    lin = _kernel_linear(n, d, bias)
    x = torch.randn(8, d, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), mock.patch("torch.get_num_threads", return_value=1):
        alone = torch.cat([lin(x[t:t + 1]) for t in range(8)])
    assert torch.allclose(alone, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    for threads in (1, 2, 3):
        for T in range(1, 9):
            with torch.no_grad(), mock.patch("torch.get_num_threads", return_value=threads):
                out = lin(x[:T].reshape(T, 1, d))  # a decode step's [batch, 1, d]
            assert out.shape == (T, 1, n)
            assert torch.equal(out[:, 0], alone[:T]), (threads, T)


@native
def test_torchs_forward_runs_wherever_the_call_does_not_apply():
    """A gradient to compute, more tokens than a decode step, float64, a transposed weight: ``nn.Linear``'s bits."""
    lin = _kernel_linear(48, 64, True)
    x = torch.randn(3, 64)
    reference = F.linear(x, lin.weight, lin.bias)
    with mock.patch.object(moelab_native, "linear_decode", side_effect=AssertionError("the native call ran")):
        assert torch.equal(lin(x), reference)  # grad enabled, the weight requires it
        with torch.no_grad():
            many = torch.randn(moelab_native.DECODE_TOKENS + 1, 64)
            assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))
            lin64 = _kernel_linear(48, 64, True).double()
            assert torch.equal(lin64(x.double()), F.linear(x.double(), lin64.weight, lin64.bias))
            lin.weight.data = lin.weight.data.t().contiguous().t()
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


@native
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma2"])
def test_a_converted_model_decodes_its_projections_in_the_call_and_keeps_its_keys(family, tiny_model, data_dir,
                                                                                   tmp_path, one_thread):
    """Every plain linear outside the FFNs (attention's, with Qwen2's biases and Phi-3's fused qkv, and the LM head,
    tied or not) is a ``KernelLinear`` printed as ``Linear``; nothing inside an FFN is; the keys and values saved are the
    dense model's; decode steps of 1 and 8 sequences give torch's logits to float rounding, and ran the call."""
    from moelab.engine.runtime.export import build_moe_model, export_model

    adapter = load_model(str(tiny_model(family)), data_dir=data_dir)
    dense_state = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    ids = torch.randint(0, 500, (8, 12), generator=torch.Generator().manual_seed(0))
    expected = [_decode_logits(adapter.model.eval(), rows) for rows in (ids[:1], ids)]
    moe = build_moe_model(adapter, {})  # every layer kept dense: the same function as the dense model
    export_model(moe, tmp_path / "m", adapter.tokenizer, {"model": {"source": family}})
    loaded = load_exported(tmp_path / "m").eval()
    for model in (moe, loaded):  # the loaded one runs the runtime bundled with it: its own KernelLinear class
        inner = model.model
        kernel = [m for m in inner.modules() if type(m).__name__ == "KernelLinear"]
        ffn_modules = {id(m) for ffn in layer_ffns(inner) for m in ffn.modules()}
        assert kernel and not any(id(m) in ffn_modules for m in kernel)
        assert not projections(inner, layer_ffns(inner))  # none left in torch's forward
        assert type(inner.get_output_embeddings()).__name__ == "KernelLinear"
        attention = decoder_layers(inner)[0].self_attn
        assert all(type(m).__name__ == "KernelLinear" for m in attention.modules() if isinstance(m, nn.Linear))
        assert "Linear(in_features" in repr(attention) and "KernelLinear" not in repr(model)
    state = loaded.model.state_dict()
    assert set(state) == set(dense_state) and all(torch.equal(state[k], v) for k, v in dense_state.items())
    runtime = sys.modules[type(loaded.model.get_output_embeddings()).__module__]
    calls = []
    real = runtime.linear_decode
    with mock.patch.object(runtime, "linear_decode", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b)):
        for rows, dense in zip((ids[:1], ids), expected):
            got = _decode_logits(loaded, rows)
            assert (got - dense).abs().max() <= 1e-4 * dense.abs().max(), family
    assert 1 in calls and 8 in calls  # decode steps of one and of eight sequences ran the call


@native
def test_a_baseline_swapped_into_the_dense_model_runs_its_projections_in_the_call_for_its_rounds_only(
        tiny_model, data_dir, one_thread):
    """``swapped_mlps`` (how a baseline is timed, and the kernel-dense one) puts the projections outside the FFNs in
    the call, and leaves the dense model's plain ``nn.Linear`` after, and with no modules changes nothing."""
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    model = adapter.model
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    mods = kernel_dense_mlps(adapter)
    with swapped_mlps(adapter, mods):
        assert isinstance(model.lm_head, KernelLinear)
        assert isinstance(decoder_layers(model)[1].self_attn.o_proj, KernelLinear)
        assert not any(isinstance(m, KernelLinear) for mod in mods.values() for m in mod.modules())
    assert all(type(m) is nn.Linear for m in plain)
    with swapped_mlps(adapter, None):
        assert not any(isinstance(m, KernelLinear) for m in model.modules())
    with projections_in_kernels(model, layer_ffns(model)):
        assert not any(type(m) is nn.Linear for m in model.modules()
                       if not any(m is x for ffn in layer_ffns(model) for x in ffn.modules()))
    assert kernel_projections(nn.Sequential(nn.ReLU()), []) == []


def test_the_prediction_takes_the_rest_of_a_step_as_the_runtime_runs_it():
    """A table that timed the rest of the step in the runtime (``rest_share``) predicts with it; one from before,
    with the dense model's rest (``1 - ffn_share``)."""
    phase = {"coef": [0.0], "tokens": 1, "dense_ffn_s": 1.0, "ffn_share": 0.4, "dense_model_s": 0.1}
    table = {"phases": {"decode_b1": phase}, "n_layers": 2, "native": False}
    dense_layers = [{"kind": "dense"}, {"kind": "dense"}]
    assert predict(table, dense_layers)["decode_b1"]["speedup"] == pytest.approx(1.0)
    phase["rest_share"] = 0.3  # the rest runs in 0.3 of the dense step, the FFNs in 0.4 as before
    assert predict(table, dense_layers)["decode_b1"]["speedup"] == pytest.approx(1 / 0.7)
    # above 8 tokens the projections run torch's own forward: the rest is the dense model's, whatever was timed
    prefill = {**phase, "tokens": 512, "rest_share": 0.62}
    table["phases"] = {"prefill": prefill}
    assert predict(table, dense_layers)["prefill"]["speedup"] == pytest.approx(1.0)
