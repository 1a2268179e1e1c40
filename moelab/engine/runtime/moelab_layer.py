"""A decoder layer's decode step in three native calls where transformers makes some fifty. Part of the exported
runtime (torch only).

Once a conversion's FFNs and projections run in native calls (``moelab_moe``, ``moelab_dense``, ``moelab_linear``),
what is left of a small model's decode step is Python: transformers' decoder layer is some fifty torch calls and a
dozen module calls (two RMSNorms of seven ops each, four projection modules, the rotary embedding's eight ops, the
attention module and its decorators), each run with the caches just emptied by the weights a native call streamed
through them. On the default model's ``best`` 0.5 conversion, 2 threads of a Xeon with a 480 MiB L3, that was about
360 µs of a layer's 1,000 at batch 1: a torch add that takes 1 µs in a loop took 13-20 µs right after the FFN's call,
an RMSNorm 60-80 µs against 19 in a loop. ``lean_layers`` gives such a layer a decode step of one token a sequence
(up to ``DECODE_TOKENS`` sequences) in

1. ``moelab_native.attention_in``: the input RMSNorm, the q, k and v projections (biases included), Qwen3's RMSNorm
   of each q and k head, and the rotary embedding (``x·cos + rotate_half(x)·sin``, transformers' cos and sin of each
   position);
2. the layer's own ``Cache.update`` (the KV cache is transformers', whatever its kind);
3. ``moelab_native.attention_out``: the attention of each query head over its KV head's cache (grouped-query; the
   mask transformers built, a padded batch's or a sliding window's, or none), the output projection, the residual
   add and the post-attention RMSNorm;
4. the FFN (its own module: a conversion's native block) and the second residual add.

On that machine the step ran 1.29-1.37× as fast as with transformers' layer forward (the same model, the two
interleaved; batch 8 and 1), and ``bench_recipe_speed`` before and after measured ``best`` 0.5 at 1.27× and 1.60-1.64×
dense, the dense model in moelab's kernels at 1.07× and 1.21-1.22× (three runs after). The logits agree with
transformers' to float32 rounding (3e-5 on logits of magnitude ~20): the sums run in another order. A step the native
calls do not take (gradients, another dtype, a mask of another shape, several new tokens a sequence) runs the same
steps in torch ops: ``F.rms_norm`` for each norm, the projections' ``forward`` without ``nn.Module.__call__``,
transformers' rotary formula and SDPA attention function with the layer's own arguments (a Qwen2 or Mistral layer's
sliding window).

Where it applies: the decoder layers of Llama (SmolLM, the default model's family), Qwen2, Qwen3 and Mistral as
transformers 5.2x writes them, in its SDPA attention (the default), with no hook on the layer's attention, norms or
projections (a request for attention weights installs one), no keyword to pass on (a packed batch's sequence lengths),
not in training mode. Anything else, a prefill of more than ``DECODE_TOKENS`` tokens included, runs transformers' own
forward.

The layer keeps its class for ``isinstance``, its printed name, parameters and keys: ``lean_layers`` gives it a
subclass of its own class, as ``moelab_dense`` does a kept MLP.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

try:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError:  # a transformers without it: no layer is changed
    sdpa_attention_forward = None

from .moelab_native import DECODE_TOKENS, attention_in, attention_out, library as native_library

#: the decoder layers whose forward ``LeanDecode`` restates: (module, layer class, how its attention names a sliding
#: window to the attention function: None (none), "attn" (the module's ``sliding_window``), "config" (the config's))
FAMILIES = (
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer", None),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "attn"),
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer", "config"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer", "attn"),  # and each head's q and k RMSNorm
)


@functools.cache
def _families() -> dict[type, str | None]:
    """The installed transformers' classes of ``FAMILIES`` whose forward is the one restated: it names the KV cache
    ``cache`` (transformers 5.2x; an earlier one's ``past_key_values`` would be a keyword the lean step does not
    know). A family this version lacks is left out. Looked up once a process: every timing round's baseline asks."""
    found = {}
    for module, name, window in FAMILIES:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if sdpa_attention_forward is not None and "cache" in inspect.signature(cls.forward).parameters:
            found[cls] = window
    return found


def _hooked(*modules: nn.Module) -> bool:
    """Whether a forward hook (of a module, or global) would see what ``LeanDecode`` skips."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in modules))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecode:
    """The mixin ``lean_layers`` puts before a decoder layer's class: a decode step in fewer calls (module doc)."""

    _window_from: str | None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> Any:
        attn = self._modules["self_attn"]
        norms = self._modules["input_layernorm"], self._modules["post_attention_layernorm"]
        projections = [attn._modules[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        head_norms = [attn._modules[name] for name in ("q_norm", "k_norm") if name in attn._modules]  # Qwen3's
        if (kwargs or self.training or position_embeddings is None or hidden_states.dim() != 3
                or hidden_states.shape[0] * hidden_states.shape[1] > DECODE_TOKENS
                or attn.config._attn_implementation != "sdpa" or _hooked(attn, *norms, *projections, *head_norms)):
            return super().forward(hidden_states, attention_mask=attention_mask,  # type: ignore[misc]
                                   position_ids=position_ids, cache=cache, use_cache=use_cache,
                                   position_embeddings=position_embeddings, **kwargs)
        B, T, d = hidden_states.shape
        q_proj, k_proj, v_proj, o_proj = projections
        cos, sin = position_embeddings
        shape = (B, T, -1, attn.head_dim)
        native = T == 1 and _native_fits(hidden_states, norms, projections, head_norms, cos)
        if native:  # norm, q/k/v, the heads' norms and the rotary embedding in one call
            q2, k, v = attention_in(hidden_states.reshape(B, d), (norms[0].weight, norms[0].variance_epsilon),
                                    attn.head_dim, tuple(p.weight for p in projections[:3]),
                                    tuple(p.bias for p in projections[:3]), *_position_rows(position_embeddings, B),
                                    (*(n.weight for n in head_norms), head_norms[0].variance_epsilon)
                                    if head_norms else None)
            k, v = (t.view(shape).transpose(1, 2) for t in (k, v))
            q = None
        else:
            x = F.rms_norm(hidden_states, (d,), norms[0].weight, norms[0].variance_epsilon)
            q, k = q_proj.forward(x).view(shape), k_proj.forward(x).view(shape)
            if head_norms:
                q, k = (F.rms_norm(t, (t.shape[-1],), n.weight, n.variance_epsilon) for t, n in zip((q, k), head_norms))
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v_proj.forward(x).view(shape).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx)
        if native and _cache_fits(k, v, attention_mask):  # attention, o_proj, the residual and the next norm in one
            hs, x = attention_out(q2, k, v, attention_mask, attn.scaling, (o_proj.weight, o_proj.bias),
                                  hidden_states.reshape(B, d), (norms[1].weight, norms[1].variance_epsilon))
            return hs.view(B, T, d) + self._modules["mlp"](x.view(B, T, d))
        if q is None:  # the native inputs, attended in torch (a cache or mask the native call does not read)
            q = q2.view(shape).transpose(1, 2)
        window = ({} if self._window_from is None else
                  {"sliding_window": attn.sliding_window if self._window_from == "attn"
                   else getattr(attn.config, "sliding_window", None)})
        out, _ = sdpa_attention_forward(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **window)
        hidden_states = hidden_states + o_proj.forward(out.reshape(B, T, -1))
        x = F.rms_norm(hidden_states, (d,), norms[1].weight, norms[1].variance_epsilon)
        return hidden_states + self._modules["mlp"](x)


#: the last step's position embeddings and its cos and sin as one contiguous row a sequence (every layer of a step
#: gets the same tuple); one tuple, replaced whole, so that a thread reads a key and its rows together
_ROWS: tuple[Any, Any] = (None, None)


def _position_rows(position_embeddings: tuple[torch.Tensor, torch.Tensor], B: int) -> tuple[torch.Tensor, ...]:
    """cos and sin ``[B or 1, 1, hd]`` as ``[B, hd]`` contiguous rows, built once a step: the tuple is the key (held,
    so that no other tuple can take its identity)."""
    global _ROWS
    last = _ROWS
    if last[0] is not position_embeddings:
        last = _ROWS = (position_embeddings,
                        tuple(t.expand(B, 1, t.shape[-1]).reshape(B, -1).contiguous() for t in position_embeddings))
    return last[1]


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_cpu and t.is_contiguous())


def _native_fits(x: torch.Tensor, norms: tuple[nn.Module, ...], projections: list[nn.Module],
                 head_norms: list[nn.Module], cos: torch.Tensor) -> bool:
    """Whether the native calls compute this step: float32 on the CPU, no gradient, plain linear projections of
    contiguous weights, q and k heads' norms of one eps (or none), the kernels built."""
    return (x.dtype == torch.float32 and x.is_cpu and cos.dtype == torch.float32 and not torch.is_grad_enabled()
            and all(isinstance(p, nn.Linear) and _f32(p.weight) and _f32(p.bias) for p in projections)
            and all(_f32(n.weight) for n in (*norms, *head_norms))
            and len({n.variance_epsilon for n in head_norms}) <= 1 and native_library() is not None)


def _cache_fits(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether ``moelab_attn_out`` reads this cache and mask: float32, each position's head dim contiguous, and a
    boolean mask of one query row per sequence (or none)."""
    return (keys.dtype == values.dtype == torch.float32 and keys.stride(-1) == values.stride(-1) == 1
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1
                                  and mask.shape[0] in (1, keys.shape[0]) and mask.shape[3] == keys.shape[2]
                                  and mask.stride(3) == 1)))


_SUBCLASSES: dict[type, type] = {}


def lean_layers(model: nn.Module) -> list[nn.Module]:
    """Give every decoder layer of ``model`` of a family ``LeanDecode`` restates its decode step (module doc); returns
    the layers changed (``plain_layers`` takes them back). In training mode a layer runs its own forward (dropout)."""
    families = _families()
    changed = []
    for layer in model.modules():
        cls = type(layer)
        if cls not in families or not hasattr(layer, "self_attn"):
            continue
        if cls not in _SUBCLASSES:  # named as its base, so that a printed model reads as before
            _SUBCLASSES[cls] = type(cls.__name__, (LeanDecode, cls), {"__module__": cls.__module__})
        layer.__class__ = _SUBCLASSES[cls]
        layer._window_from = families[cls]
        changed.append(layer)
    return changed


def plain_layers(layers: list[nn.Module]) -> None:
    """Give ``layers`` (``lean_layers``' return) back their own forward."""
    for layer in layers:
        if isinstance(layer, LeanDecode):
            layer.__class__ = type(layer).__mro__[2]
