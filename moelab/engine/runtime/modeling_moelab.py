"""moelab Mixture-of-Experts runtime: the config and the model class of an exported MoE.

The runtime is SELF-CONTAINED (torch, transformers and the standard library only): this file and
its ``moelab_*.py`` siblings are copied verbatim next to the weights of every exported model and
loaded from there through the ``auto_map`` of its config.json::

    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)

Files, read top to bottom (each imports only those above it)
-----------------------------------------------------------
``moelab_routers.py``       the router kinds (scores, cost, fit, init) and ``ffn_macs``, the cost
``moelab_native.py``        the native CPU kernels (C, compiled on first use; torch where they cannot run)
``moelab_triton.py``        the GPU decode kernels (Triton, where it is installed)
``moelab_kernels.py``       the routed experts' fast kernels and ``select_kernel``
``moelab_compat.py``        loading the keys earlier runtimes wrote
``moelab_moe.py``           ``MoeExperts`` (reference forward), ``MoeRouter`` and ``MoeFFN``, the sparse block
``moelab_dense.py``         the layers kept dense, at a decode step in the sparse block's native call
``moelab_layer.py``         a decoder layer's decode step in fewer Python and torch calls
``moelab_linear.py``        a decode step's projections outside the FFN (attention's, the LM head) in a native call
``moelab_abstopk.py``       ``AbsTopKGLU``: EW Eq. 2 baseline, per-token top-k neurons
``moelab_teal.py``          ``TealGLU``: TEAL baseline, magnitude thresholds on the projections' inputs
``moelab_hierarchical.py``  ``HierarchicalExperts``: AF Eq. 10, sub-experts inside every expert
``moelab_lowrank.py``       ``LowRankMoeFFN``: MIDAS (MI §3.2) low-rank experts
``modeling_moelab.py``      ``MoelabConfig`` (``base_config`` + ``moe_layers``, one spec a layer)
                            and ``MoelabForCausalLM``: the base architecture built from
                            ``base_config`` with each decoder layer's ``mlp`` replaced as its
                            ``moe_layers`` entry says (``LAYER_KINDS``)

Layer specs (JSON): ``{"kind": "moe", ...}`` (``moelab_moe``), ``{"kind": "abstopk", ...}``,
``{"kind": "teal", ...}``, ``{"kind": "hierarchical", ...}``, ``{"kind": "lowrank_moe", ...}`` (each
module's docstring), and ``{"kind": "dense"}`` (or ``null``): the base architecture's MLP is kept (a decode step
of it runs in the native call the MoE layers take, where it applies: ``moelab_dense``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from transformers import AutoConfig, GenerationMixin, PretrainedConfig, PreTrainedModel

try:  # transformers >= 5: composite configs declare their sub-configs
    from transformers.configuration_utils import SubConfigSpec
except ImportError:  # pragma: no cover - older transformers
    SubConfigSpec = None

from .moelab_abstopk import AbsTopKGLU
from .moelab_compat import is_legacy_expert_conversion, legacy_expert_conversion
from .moelab_dense import KernelDecode, kernel_decode
from .moelab_hierarchical import HierarchicalExperts, set_experts
from .moelab_kernels import EXPERTS_IMPLS, decode_layout
from .moelab_linear import kernel_projections
from .moelab_lowrank import LowRankMoeFFN
from .moelab_moe import MoeExperts, MoeFFN, MoeRouter
from .moelab_routers import COMBINES, ROUTERS
from .moelab_teal import TealGLU

#: a ``moe_layers`` entry's ``kind`` -> the module class built from it
LAYER_KINDS: dict[str, type[nn.Module]] = {"moe": MoeFFN, "abstopk": AbsTopKGLU, "teal": TealGLU,
                                           "hierarchical": HierarchicalExperts, "lowrank_moe": LowRankMoeFFN}


def build_layer_module(entry: dict | None) -> nn.Module | None:
    """The module a ``moe_layers`` entry describes, or None to keep the dense MLP."""
    if not entry:
        return None
    kind = entry.get("kind", "moe")
    if kind == "dense":
        return None
    if kind not in LAYER_KINDS:
        raise ValueError(f"unknown layer kind {kind!r} ({', '.join(LAYER_KINDS)} or dense)")
    return LAYER_KINDS[kind](entry)


def layer_spec(module: nn.Module | None) -> dict:
    """The ``moe_layers`` entry of a replacement module (``{"kind": "dense"}`` for None/other)."""
    spec = getattr(module, "spec", None) if module is not None else None
    return dict(spec) if isinstance(spec, dict) else {"kind": "dense"}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (get_decoder().layers)")
    return layers


def ffn_name(block: nn.Module) -> str:
    """The attribute of a decoder layer that holds its FFN (``mlp``; ``feed_forward`` in some families)."""
    return "mlp" if hasattr(block, "mlp") else "feed_forward"


def convert_in_place(model: nn.Module, layer_modules: dict[int, nn.Module | None]) -> nn.Module:
    """Replace ``layers[i].mlp`` by ``layer_modules[i]`` (None keeps the layer dense); a
    ``HierarchicalExperts`` replaces ``layers[i].mlp.experts`` instead."""
    layers = decoder_layers(model)
    for i, mod in layer_modules.items():
        if mod is None:
            continue
        if not 0 <= int(i) < len(layers):
            raise IndexError(f"layer {i} out of range (model has {len(layers)} layers)")
        block = layers[int(i)]
        if isinstance(mod, HierarchicalExperts):
            set_experts(block, mod, int(i))
            continue
        setattr(block, ffn_name(block), mod)
    return model


def realign_parameters(model: nn.Module, alignment: int = 64) -> int:
    """Copy CPU parameters/buffers whose data is not ``alignment``-byte aligned (safetensors
    memory-maps tensors at arbitrary offsets) into fresh, aligned storage, and give every
    ``MoeExperts.down_proj`` (and column-major ``gate_up_proj``), shared expert's down projection, kept dense MLP's
    down projection (``moelab_dense``) and ``TealGLU`` weight its decode layout (a loaded checkpoint arrives contiguous). BLAS
    kernels may round differently depending on alignment and layout, so a model loaded from disk
    and the in-memory model it was saved from only compute bit-identical logits once both are
    realigned. Tied parameters stay tied (the Parameter objects are kept). Returns the number copied."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, (TealGLU, MoeFFN, KernelDecode)):
            mod.use_decode_layout()
            continue
        if not isinstance(mod, MoeExperts):
            continue
        for p in (mod.down_proj, mod.gate_up_proj) if mod.column_major else (mod.down_proj,):
            if (relaid := decode_layout(p.data)) is not p.data:
                p.data = relaid
                n += 1
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "cpu" and t.numel() and t.data_ptr() % alignment:
            t.data = t.data.clone()
            n += 1
    return n


# --------------------------------------------------------------------------- config + model


_SUB_CONFIGS = (
    {"base_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")} if SubConfigSpec else {}
)


#: What ``MoelabConfig`` answers from its base model's config (``MoelabConfig.__getattr__``).
STANDARD_ATTRIBUTES = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings",
                                 "num_attention_heads", "num_key_value_heads", "head_dim"})


class MoelabConfig(PretrainedConfig):
    """``base_config``: the dense model's config (dict or config, with its model_type);
    ``moe_layers``: one spec per decoder layer (see module docstring); ``moelab``: free-form
    provenance (converter version, method)."""

    model_type = "moelab"
    sub_configs_defaults = _SUB_CONFIGS

    base_config: Any = None
    moe_layers: list | None = None
    moelab: dict | None = None

    def __post_init__(self, **kwargs):
        if not SubConfigSpec and isinstance(self.base_config, dict):  # pragma: no cover
            self.base_config = AutoConfig.for_model(**self.base_config)
        super().__post_init__(**kwargs)
        if self.moe_layers is None:
            self.moe_layers = []
        self.moe_layers = [dict(e) if e else {"kind": "dense"} for e in self.moe_layers]

    def get_text_config(self, decoder=None, encoder=None):
        """Generation, caches and embeddings read the base model's text config."""
        return self.base_config if self.base_config is not None else self

    def __getattr__(self, name: str) -> Any:
        """The base model's standard attributes, read where tools look for them: transformers' generation,
        PEFT, lm-eval and vLLM ask ``config.vocab_size`` (…) of the top-level config. Only consulted when
        normal lookup fails, so nothing is copied and ``config.json`` is unchanged."""
        if name in STANDARD_ATTRIBUTES:
            base = self.__dict__.get("base_config")
            value = base.get(name) if isinstance(base, dict) else getattr(base, name, None)
            if value is not None:
                return value
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def _base_causal_lm_class(base_config: PretrainedConfig) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)]
    except KeyError:
        raise ValueError(
            f"base model type {getattr(base_config, 'model_type', '?')!r} has no causal-LM class in "
            "this transformers version"
        ) from None


def _activation_name(config: Any) -> str:
    """The activation a base config names for its MLPs (Gemma's ``hidden_activation``, else ``hidden_act``)."""
    config = getattr(config, "text_config", None) or config
    return str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", ""))


def decode_in_kernels(model: nn.Module, moe_layers: list[dict], base_config: Any) -> None:
    """The layers ``model`` keeps dense (``{"kind": "dense"}`` in ``moe_layers``, or past its end) decode in the MoE
    layers' whole-block call (``moelab_dense.kernel_decode``), their down projections in its layout, and the
    projections outside the FFNs in the native decode call and the decoder layers' lean decode step
    (``moelab_linear.kernel_projections``, ``moelab_layer``): a model built in
    memory (``export.build_moe_model``) as one loaded from disk, so that both run the same calls on the same layouts
    and compute the same bits."""
    act = _activation_name(base_config)
    for i, block in enumerate(decoder_layers(model)):
        if i >= len(moe_layers) or moe_layers[i].get("kind") == "dense":
            kernel_decode(getattr(block, "mlp", None), act)
    kernel_projections(model, layer_ffns(model))


def layer_ffns(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer's FFN module (``ffn_name``)."""
    return [getattr(block, ffn_name(block)) for block in decoder_layers(model)]


class MoelabPreTrainedModel(PreTrainedModel):
    config_class = MoelabConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module):
        if isinstance(module, (MoeFFN, LowRankMoeFFN)):
            module.reset_parameters(getattr(self.config.get_text_config(), "initializer_range", 0.02))
        elif isinstance(module, MoeExperts):
            module.reset_parameters(getattr(self.config.get_text_config(), "initializer_range", 0.02))
        else:
            super()._init_weights(module)


class MoelabForCausalLM(MoelabPreTrainedModel, GenerationMixin):
    """``self.model`` is the base architecture's own causal LM (e.g. LlamaForCausalLM) whose
    MLPs are replaced per ``config.moe_layers``; ``forward`` returns its CausalLMOutput.
    Tied embeddings are the inner model's business: its ``_tied_weights_keys`` are collected
    under the ``model.`` prefix by ``post_init``, so save/load tie exactly as the base does."""

    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        base_cls = _base_causal_lm_class(config.base_config)
        self.model = base_cls(config.base_config)
        layers = decoder_layers(self.model)
        if len(config.moe_layers) > len(layers):
            raise ValueError(f"{len(config.moe_layers)} moe_layers for a model of {len(layers)} layers")
        convert_in_place(self.model, {i: build_layer_module(e) for i, e in enumerate(config.moe_layers)})
        decode_in_kernels(self.model, config.moe_layers, config.base_config)
        self.post_init()

    # delegation ...............................................................
    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.model.set_output_embeddings(value)

    def get_decoder(self):
        return self.model.get_decoder()

    def set_decoder(self, decoder):
        self.model.set_decoder(decoder)

    def moe_modules(self) -> dict[int, nn.Module]:
        """Layer index -> replaced MLP module (MoeFFN / AbsTopKGLU / TealGLU), or the HierarchicalExperts
        inside a sparse-MoE block."""
        out = {}
        for i, block in enumerate(decoder_layers(self.model)):
            mlp = getattr(block, "mlp", None)
            if isinstance(mlp, (MoeFFN, AbsTopKGLU, TealGLU, LowRankMoeFFN)):
                out[i] = mlp
            elif isinstance(getattr(mlp, "experts", None), HierarchicalExperts):
                out[i] = mlp.experts
        return out

    def set_recorder(self, recorder_factory: Callable[[int], Callable[[torch.Tensor], None]] | None) -> None:
        """Install ``recorder_factory(layer)`` as every MoE layer's recorder (None removes them)."""
        for i, mod in self.moe_modules().items():
            mod.recorder = None if recorder_factory is None else recorder_factory(i)

    def save_pretrained(self, *args, **kwargs):
        """Writes the runtime's own layout: ``save_original_format`` defaults to False, because
        reverting the base family's weight conversions (e.g. Mixtral's per-expert ``w1``/``w3``)
        would also split the stacked ``experts.gate_up_proj`` of moelab's own MoE layers."""
        kwargs.setdefault("save_original_format", False)
        return super().save_pretrained(*args, **kwargs)

    def set_experts_implementation(self, impl: str) -> None:
        """Experts kernel of every ``MoeFFN`` (hierarchical sub-MoEs included): one of
        ``EXPERTS_IMPLS`` (``loop`` is the reference, ``auto`` the default)."""
        if impl not in EXPERTS_IMPLS:
            raise ValueError(f"unknown experts implementation {impl!r}; one of {EXPERTS_IMPLS}")
        for mod in self.modules():
            if isinstance(mod, MoeExperts):
                mod.experts_impl = impl

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        with legacy_expert_conversion(cls.__name__):
            model = super().from_pretrained(*args, **kwargs)
        # saving writes the current layout, not the converted-from one
        used = getattr(model, "_weight_conversions", None)
        if used:
            model._weight_conversions = [c for c in used if not is_legacy_expert_conversion(c)]
        realign_parameters(model)
        return model

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self.model.prepare_inputs_for_generation(*args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ):
        if past_key_values is not None:  # transformers >= 5.2x calls it ``cache`` (passed in kwargs)
            kwargs["past_key_values"] = past_key_values
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


__all__ = [
    "COMBINES",
    "EXPERTS_IMPLS",
    "LAYER_KINDS",
    "ROUTERS",
    "AbsTopKGLU",
    "HierarchicalExperts",
    "LowRankMoeFFN",
    "MoeExperts",
    "MoeFFN",
    "MoeRouter",
    "MoelabConfig",
    "MoelabForCausalLM",
    "MoelabPreTrainedModel",
    "TealGLU",
    "build_layer_module",
    "convert_in_place",
    "decode_in_kernels",
    "decoder_layers",
    "layer_spec",
    "realign_parameters",
]
