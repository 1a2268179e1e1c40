"""A decoder layer's decode step in fewer calls (``runtime.moelab_layer``): transformers' logits to float rounding
at decode steps of one and of eight sequences, with a padded batch's mask, a sliding window, Qwen2's biases and
Qwen3's head norms, in the native calls and in the torch ops that stand in for them; transformers' own forward
everywhere else; the layer reads as the class it was, and goes back to it after a timing's rounds."""

from __future__ import annotations

import shutil
from unittest import mock

import pytest
import torch
import transformers
from torch import nn

from moelab.engine.runtime import moelab_layer
from moelab.engine.runtime.modeling_moelab import decoder_layers, layer_ffns
from moelab.engine.runtime.moelab_layer import LeanDecode, lean_layers, plain_layers
from moelab.engine.runtime.moelab_linear import projections_in_kernels

from tests.conftest import TINY

native = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler: no native kernels")

VOCAB = 300
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # biases on q, k and v
    "qwen3": ("Qwen3Config", {}),  # an RMSNorm on each q and k head
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral-window": ("MistralConfig", {"sliding_window": 5}),  # a mask that drops the oldest keys
}


def _model(name: str) -> nn.Module:
    cls, extra = CONFIGS[name]
    config = getattr(transformers, cls)(vocab_size=VOCAB, pad_token_id=0, **{**TINY, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    for p in model.parameters():  # large enough weights that a wrong head or position shows in the logits
        p.data.normal_(0, 0.2)
    return model


def _steps(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None, steps: int = 4) -> torch.Tensor:
    """Logits of ``steps`` cached decode steps of every row of ``ids`` after a prefill of the tokens before them;
    ``mask``: the rows' attention mask (0 on left padding)."""
    prompt = ids.shape[1] - steps
    with torch.no_grad():
        out = model(ids[:, :prompt], attention_mask=None if mask is None else mask[:, :prompt], use_cache=True)
        cache, logits = out.past_key_values, []
        for i in range(prompt, ids.shape[1]):
            out = model(ids[:, i:i + 1], attention_mask=None if mask is None else mask[:, :i + 1], cache=cache,
                        use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits)
    return torch.cat(logits, 1)


def _counting(name: str) -> tuple[list[int], mock._patch]:
    calls: list[int] = []
    real = getattr(moelab_layer, name)
    return calls, mock.patch.object(moelab_layer, name, lambda *a, **k: calls.append(1) or real(*a, **k))


@native
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_steps_give_transformers_logits_and_run_the_native_calls(name, threads, one_thread):
    """Batches of 1 and 8 sequences, 12 tokens of which the last 4 are decode steps; the window of 5 makes the mask
    drop keys; the calls' rows and heads shared among 1 or 3 threads. The layers go back to transformers' forward
    after the block."""
    model = _model(name)
    ids = torch.randint(1, VOCAB, (8, 12), generator=torch.Generator().manual_seed(1))
    expected = [_steps(model, rows) for rows in (ids[:1], ids)]
    calls, counting = _counting("attention_out")
    with (projections_in_kernels(model, layer_ffns(model)), counting,
          mock.patch("torch.get_num_threads", return_value=threads)):
        assert all(isinstance(layer, LeanDecode) for layer in decoder_layers(model))
        got = [_steps(model, rows) for rows in (ids[:1], ids)]
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max(), name
    assert len(calls) == 2 * 4 * TINY["num_hidden_layers"]  # every decode step's every layer, both batches
    assert not any(isinstance(layer, LeanDecode) for layer in decoder_layers(model))


@native
def test_a_left_padded_batch_masks_its_padding(one_thread):
    """Rows of different lengths, left-padded with an attention mask: each row's logits as transformers computes
    them (the mask reaches the native attention), and a row's logits as when it runs alone, unpadded."""
    model = _model("llama")
    ids = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    expected = _steps(model, ids, mask)
    calls, counting = _counting("attention_out")
    with projections_in_kernels(model, layer_ffns(model)), counting:
        got = _steps(model, ids, mask)
        alone = _steps(model, ids[2:, 5:])
    assert calls
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (got[2] - alone[0]).abs().max() <= 1e-4 * alone.abs().max()


@native
def test_transformers_forward_runs_where_the_lean_step_does_not_apply(one_thread):
    """A prefill, a hook on the attention, attention weights asked for (a hook too), training mode: no native call and
    transformers' bits; gradients enabled: the lean step in torch ops (no native call), the same values."""
    model = _model("llama")
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    expected = _steps(model, ids)
    calls, counting = _counting("attention_in")
    layers = lean_layers(model)
    try:
        with counting:
            with torch.no_grad():
                assert torch.equal(model(ids).logits, plain_forward(model, ids))  # a prefill of 9 tokens
            handles = [layer.self_attn.register_forward_hook(lambda *a: None) for layer in decoder_layers(model)]
            assert torch.equal(_steps(model, ids), _with_plain(model, lambda: _steps(model, ids)))
            for handle in handles:
                handle.remove()
            assert not calls
            with torch.no_grad():  # transformers hooks the attention modules to capture their weights
                out = model(ids[:, :1], output_attentions=True)
            assert torch.equal(out.logits, plain_forward(model, ids[:, :1]))
            model.train()
            with torch.no_grad():
                assert torch.equal(model(ids[:, :1]).logits, plain_forward(model, ids[:, :1]))
            model.eval()
            assert not calls
            with torch.enable_grad():
                out = model(ids[:, :1])
                out.logits.sum().backward()
            assert not calls and model.lm_head.weight.grad is not None
        assert (_steps(model, ids) - expected).abs().max() <= 1e-5 * expected.abs().max()
    finally:
        plain_layers(layers)


def _with_plain(model: nn.Module, run):
    layers = [layer for layer in decoder_layers(model) if isinstance(layer, LeanDecode)]
    plain_layers(layers)
    try:
        return run()
    finally:
        if layers:
            lean_layers(model)


def plain_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _with_plain(model, lambda: model(ids).logits)


def test_the_layer_keeps_its_class_name_keys_and_parameters():
    """``isinstance`` holds, the printed model and the state dict are unchanged, and ``plain_layers`` undoes it;
    a family it does not restate (Gemma 2) is left alone."""
    model = _model("qwen2")
    before, keys = repr(model), {k: v.data_ptr() for k, v in model.state_dict().items()}
    layers = lean_layers(model)
    assert len(layers) == TINY["num_hidden_layers"]
    assert all(isinstance(layer, transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer) for layer in layers)
    assert repr(model) == before and {k: v.data_ptr() for k, v in model.state_dict().items()} == keys
    plain_layers(layers)
    assert all(type(layer) is transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer for layer in layers)
    gemma = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma2Config(vocab_size=VOCAB, **TINY, hidden_activation="gelu_pytorch_tanh"))
    assert lean_layers(gemma) == []


@native
def test_generate_takes_the_native_step_and_picks_transformers_tokens(one_thread):
    """``generate()`` (what the Playground and a user call) passes nothing the lean step does not know: its decode
    steps run the native calls, and greedy decoding picks the tokens transformers' forward picks."""
    model = _model("llama")
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                  pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    calls, counting = _counting("attention_in")
    with projections_in_kernels(model, layer_ffns(model)), counting:
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    assert len(calls) == 5 * TINY["num_hidden_layers"]  # every step after the prompt's, every layer


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_the_torch_op_step_computes_what_transformers_does(name, one_thread):
    """With gradients enabled the native calls do not run: the lean step's torch ops give transformers' values (and
    the gradient flows)."""
    model = _model(name)
    ids = torch.randint(1, VOCAB, (3, 1), generator=torch.Generator().manual_seed(5))
    expected = plain_forward(model, ids)
    calls, counting = _counting("attention_in")
    with projections_in_kernels(model, layer_ffns(model)), counting, torch.enable_grad():
        got = model(ids).logits
        got.sum().backward()
    assert not calls and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert (got.detach() - expected).abs().max() <= 1e-5 * expected.abs().max()
