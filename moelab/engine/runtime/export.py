"""Assemble a converted model and publish it as a self-contained Hugging Face directory.

``build_moe_model`` wraps an already-loaded dense model (the adapter's HF model) in a
``MoelabForCausalLM`` without copying its weights: the wrapper's skeleton is built on the
meta device, the live dense model is put in its place and its MLPs are swapped for the given
MoE modules (the dense model is therefore converted in place).

``export_model`` writes, atomically (temp dir + rename)::

    out_dir/
      config.json            MoelabConfig: base_config, moe_layers (per-layer expert layout), auto_map
      generation_config.json
      model.safetensors      (tied lm_head/embeddings stored once, re-tied on load)
      modeling_moelab.py     verbatim copies of the runtime (RUNTIME_FILES): loaded with
      moelab_*.py            trust_remote_code=True
      tokenizer files
      conversion.json        the conversion record given by the caller
      README.md              model card (model_card.py): method, parameters, layout, cost, evaluation

``load_exported(path)`` = ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_directory, write_json_atomic
from .modeling_moelab import (
    MoelabConfig,
    MoelabForCausalLM,
    convert_in_place,
    decode_in_kernels,
    decoder_layers,
    layer_spec,
    realign_parameters,
)

MODELING_FILE = Path(__file__).with_name("modeling_moelab.py")
#: the exported runtime: the modeling file and the sibling modules it imports (torch and transformers only)
RUNTIME_FILES = (MODELING_FILE, *sorted(MODELING_FILE.parent.glob("moelab_*.py")))
AUTO_MAP = {
    "AutoConfig": "modeling_moelab.MoelabConfig",
    "AutoModelForCausalLM": "modeling_moelab.MoelabForCausalLM",
}
CONVERSION_FILE = "conversion.json"
#: the neuron partition of a partition method's conversion (``core.slicing.partition_arrays``), safetensors
PARTITION_FILE = "partition.safetensors"


def _hf_model(adapter_or_hf_model: Any) -> nn.Module:
    model = adapter_or_hf_model
    if not hasattr(model, "config") and hasattr(model, "model"):  # a ModelAdapter
        model = model.model
    if isinstance(model, MoelabForCausalLM):
        raise ValueError("the model is already a MoelabForCausalLM; pass the dense model")
    if not hasattr(model, "config"):
        raise TypeError(f"expected a ModelAdapter or a Hugging Face model, got {type(adapter_or_hf_model).__name__}")
    return model


def build_moe_model(
    adapter_or_hf_model: Any,
    layer_modules: dict[int, nn.Module | None],
    moe_layer_specs: list[dict] | None = None,
    *,
    provenance: dict | None = None,
) -> MoelabForCausalLM:
    """Wrap the loaded dense model in a MoelabForCausalLM with ``layer_modules`` as MLPs.

    ``layer_modules``: layer index -> replacement module (MoeFFN / AbsTopKGLU; None or absent
    keeps the layer dense). ``moe_layer_specs``: optional, one entry per decoder layer; its
    extra keys (e.g. allocation notes) are kept in config.json, while the structural keys
    always come from the module's own ``spec`` (a mismatching ``kind`` is an error).
    The dense model is modified in place (an adapter's ``layers`` still describe the old
    dense MLPs) and shares every tensor with the returned wrapper: no second weight copy.
    """
    hf = _hf_model(adapter_or_hf_model)
    n_layers = len(decoder_layers(hf))
    bad = [i for i in layer_modules if not 0 <= int(i) < n_layers]
    if bad:
        raise IndexError(f"layers {bad} out of range (model has {n_layers} layers)")
    given = list(moe_layer_specs) if moe_layer_specs is not None else [None] * n_layers
    if len(given) != n_layers:
        raise ValueError(f"{len(given)} layer specs for a model of {n_layers} layers")
    specs = []
    for i in range(n_layers):
        mod, extra = layer_modules.get(i), dict(given[i] or {})
        spec = layer_spec(mod)  # the module's own spec is authoritative for the structure
        if extra and extra.get("kind", "moe") != spec["kind"]:
            raise ValueError(f"layer {i}: spec kind {extra.get('kind', 'moe')!r} but module is {spec['kind']!r}")
        specs.append({**extra, **spec})
    param = next(hf.parameters())
    config = MoelabConfig(
        base_config=copy.deepcopy(hf.config),
        moe_layers=specs,
        moelab=dict(provenance or {}),
    )
    config.dtype = param.dtype
    with torch.device("meta"):  # skeleton only: its meta submodel is replaced right away
        moe = MoelabForCausalLM(config)
    moe.model = hf
    config.base_config = hf.config  # the live model's config, so both stay consistent
    convert_in_place(hf, {int(i): m for i, m in layer_modules.items()})
    decode_in_kernels(hf, specs, hf.config)
    realign_parameters(hf)  # same numerics as the model reloaded from disk (bit-identical logits)
    moe.all_tied_weights_keys = moe.get_expanded_tied_weights_keys(all_submodels=True)
    if getattr(hf, "generation_config", None) is not None:
        moe.generation_config = copy.deepcopy(hf.generation_config)
    moe.train(hf.training)
    return moe


def export_model(
    moe_model: MoelabForCausalLM,
    out_dir: Path,
    tokenizer: Any = None,
    conversion: dict | None = None,
    evaluation: dict | None = None,
    partition: dict[str, Any] | None = None,
) -> Path:
    """Write ``moe_model`` as a self-contained, trust_remote_code-loadable directory (atomic),
    with its model card (README.md, ``model_card``; ``evaluation``: the numbers to show) and, for
    partition methods, which dense neurons each expert holds (``partition``: PARTITION_FILE)."""
    from .model_card import write_model_card

    out_dir = Path(out_dir)
    moe_model.config.auto_map = dict(AUTO_MAP)
    moe_model.config.architectures = [MoelabForCausalLM.__name__]
    with atomic_directory(out_dir) as tmp:
        moe_model.save_pretrained(tmp)
        copy_runtime(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / CONVERSION_FILE, dict(conversion or {}))
        if partition:
            from safetensors.numpy import save_file

            save_file(partition, str(tmp / PARTITION_FILE))
        write_model_card(tmp, dict(conversion or {}), moe_model, fmt="moelab", evaluation=evaluation)
    return out_dir


def copy_runtime(out_dir: Path) -> None:
    """Put the runtime's files (``RUNTIME_FILES``) into an export directory."""
    for f in RUNTIME_FILES:
        shutil.copyfile(f, Path(out_dir) / f.name)


def runtime_is_current(export_dir: Path | str) -> bool:
    """Whether ``export_dir`` carries this moelab's runtime (``RUNTIME_FILES``) byte for byte: an export keeps the
    runtime it was written with and loads with it, so one written before a kernel changed runs without the change."""
    return all((Path(export_dir) / f.name).is_file() and (Path(export_dir) / f.name).read_bytes() == f.read_bytes()
               for f in RUNTIME_FILES)


def load_exported(path: Path | str, **kwargs: Any) -> nn.Module:
    """Load an exported MoE model (runs its bundled modeling_moelab.py)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, **kwargs)
