"""Weights on disk: where a model's safetensors live, reading them one tensor at a time, and loading a
module of a ``meta``-device model from them (and back to ``meta``) so only one layer is in memory."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..memory import give_back_freed_heap
from ..models import DEFAULT_MODEL, ModelError, cache_default_model, service_location


def weights_location(spec: str, data_dir: Path) -> Path:
    """The directory holding ``spec``'s config and safetensors (the default model: its cache)."""
    if spec == DEFAULT_MODEL:
        return cache_default_model(data_dir)
    checked = service_location(spec)  # a service worker: never the working directory, only inside the data roots
    if checked is not None:
        if checked[1] is not None:
            raise ModelError(f"{spec}: a GGUF file cannot be streamed layer by layer; save it as safetensors first")
        return checked[0]
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        raise ModelError(f"{spec}: a GGUF file cannot be streamed layer by layer; save it as safetensors first")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec}: a local model directory needs a config.json (a Hugging Face save)")
        return path
    from huggingface_hub import snapshot_download

    try:  # only what streaming reads: config, tokenizer and the safetensors shards
        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # the hub raises many types; all mean "not available"
        raise ModelError(f"could not find model {spec!r} locally or on the Hugging Face Hub: {exc}") from exc


class Checkpoint:
    """Tensor name → shard of a safetensors checkpoint; tensors read one at a time (memory-mapped)."""

    def __init__(self, location: Path) -> None:
        index = location / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: location / shard for name, shard in weight_map.items()}
        elif (location / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(location / "model.safetensors"), framework="pt") as fh:
                self.files = {name: location / "model.safetensors" for name in fh.keys()}
        else:
            raise ModelError(f"{location}: no safetensors weights (model.safetensors[.index.json]); streaming reads only those")

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        shard = self.files.get(name)
        if shard is None:
            raise ModelError(f"weight {name!r} is not in the checkpoint; this model cannot be streamed layer by layer")
        # One mapping per tensor: pages read through a mapping count as resident until it is
        # unmapped, so a shard kept open would add up to every layer read from it.
        with safe_open(str(shard), framework="pt") as fh:
            return fh.get_tensor(name)


def load_module(model: nn.Module, prefix: str, module: nn.Module, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype,
                skip: tuple[str, ...] = ()) -> None:
    """Read ``module``'s parameters (named ``prefix`` + name in ``model`` and the checkpoint; those under
    ``skip`` left alone) into ``model`` on ``device`` as ``dtype``, one tensor at a time."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in module.named_parameters():
        if name.startswith(skip):
            continue
        full = f"{prefix}{name}"
        set_module_tensor_to_device(model, full, device, value=ckpt.get(full), dtype=dtype)


def unload_module(module: nn.Module, skip: tuple[str, ...] = ()) -> None:
    """``module``'s parameters (but those under ``skip``) back to ``meta``: their memory is freed."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in module.named_parameters():
        if not name.startswith(skip):
            set_module_tensor_to_device(module, name, "meta")


class LayerLoader:
    """A ``meta``-device model's weights read from its checkpoint around each step of a layer-by-layer pass
    (``core.fitting.layerwise_inputs``): the decoder's own weights (embeddings, final norm) while ``decoder()`` is
    entered, one decoder layer's while ``layer(lay)`` is; back to ``meta`` on leaving."""

    def __init__(self, adapter: Any, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
        from ..layer_calls import layer_list_name

        self.model, self.ckpt, self.device, self.dtype = adapter.model, ckpt, device, dtype
        self.decoder_module = adapter.decoder()
        self.names = {id(m): name for name, m in self.model.named_modules()}  # a module's weights' name prefix
        prefix = self.names[id(self.decoder_module)]
        self.prefix = f"{prefix}." if prefix else ""
        self.layers_prefix = f"{layer_list_name(adapter)}."  # under the decoder: the layers, loaded one at a time

    @contextmanager
    def decoder(self) -> Iterator[None]:
        skip = (self.layers_prefix,)
        load_module(self.model, self.prefix, self.decoder_module, self.ckpt, self.device, self.dtype, skip=skip)
        try:
            yield
        finally:
            unload_module(self.decoder_module, skip=skip)

    @contextmanager
    def layer(self, lay: Any) -> Iterator[None]:
        load_module(self.model, f"{self.names[id(lay.block)]}.", lay.block, self.ckpt, self.device, self.dtype)
        try:
            yield
        finally:
            unload_module(lay.block)
            give_back_freed_heap()  # the layer's weights and what its step freed: resident memory stays bounded
