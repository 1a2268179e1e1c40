"""Training checkpoints without pickle: safetensors for tensors, JSON for everything else.

One checkpoint is one directory, published atomically (``atomic.atomic_directory``)::

    checkpoints/step-000040/
      trainable.safetensors   trainable parameters and training buffers, by parameter name
      optimizer.safetensors   optimizer state tensors, as "<parameter name>/<state key>"
      rng.safetensors         torch RNG states (CPU, and CUDA when present)
      state.json              step, data cursor, optimizer param groups (by parameter name),
                              and whatever the trainer adds (``meta``)

Parameters are identified by name, never by position, so a checkpoint restores into a freshly
built model whose parameters were created in any order, and a mismatch is reported by name.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..atomic import atomic_directory

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint cannot be restored into this run; the message says why and what to do."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    state: dict[str, Any]


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first (temporaries ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _named_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict, list]:
    """Optimizer state keyed by parameter name (``names``: id(param) -> name)."""
    tensors: dict[str, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise CheckpointError(f"{len(missing)} optimizer parameters have no name; name every trained parameter")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"optimizer state {key!r} is not a tensor; only tensor state can be saved")
                tensors[f"{names[id(p)]}/{key}"] = value.detach().cpu().contiguous().clone()
    return tensors, groups


def save_checkpoint(
    root: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    meta: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically, then delete all but the newest ``keep``."""
    opt_tensors, groups = _named_optimizer_state(optimizer, names)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda/{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    final = step_dir(root, step)
    with atomic_directory(final) as tmp:
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(tmp / "trainable.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        save_file(rng, str(tmp / "rng.safetensors"))
        state = {"format": FORMAT_VERSION, "step": int(step), "param_groups": groups, **meta}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    for _, old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> Checkpoint:
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, expected {FORMAT_VERSION}")
    # clone: tensors read from a file may sit at unaligned addresses (see realign_parameters)
    read = lambda name: {k: v.clone() for k, v in load_file(str(path / name)).items()}  # noqa: E731
    return Checkpoint(path, int(state["step"]), read("trainable.safetensors"), read("optimizer.safetensors"),
                      read("rng.safetensors"), state)


def latest_checkpoint(root: Path) -> Checkpoint | None:
    found = list_checkpoints(root)
    return load_checkpoint(found[-1][1]) if found else None


@torch.no_grad()
def restore(ckpt: Checkpoint, tensors: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
            names: dict[int, str]) -> None:
    """Copy the checkpoint into the live ``tensors`` (by name), ``optimizer`` and RNG states."""
    if set(ckpt.tensors) != set(tensors):
        extra, missing = sorted(set(ckpt.tensors) - set(tensors)), sorted(set(tensors) - set(ckpt.tensors))
        raise CheckpointError(
            f"{ckpt.path}: the checkpoint's trained tensors do not match this run (only in checkpoint: "
            f"{extra[:3]}, only in run: {missing[:3]}); resume with the parameters it was made with or use a new output dir"
        )
    for name, t in tensors.items():
        src = ckpt.tensors[name]
        if src.shape != t.shape:
            raise CheckpointError(f"{ckpt.path}: {name} has shape {tuple(src.shape)}, the run has {tuple(t.shape)}")
        t.copy_(src)
    by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    groups = ckpt.state["param_groups"]
    if [g["params"] for g in groups] != [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]:
        raise CheckpointError(f"{ckpt.path}: optimizer parameter groups differ from this run's")
    index = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in ckpt.optimizer.items():
        name, _, field = key.rpartition("/")
        if name not in by_name:
            raise CheckpointError(f"{ckpt.path}: optimizer state for unknown parameter {name!r}")
        p = by_name[name]
        # AdamW keeps "step" on the CPU unless capturable; moments live with the parameter
        state.setdefault(index[name], {})[field] = value if field == "step" else value.to(p.device, p.dtype)
    optimizer.load_state_dict({"state": state, "param_groups": [
        {**g, "params": [index[n] for n in g["params"]]} for g in groups]})
    torch.set_rng_state(ckpt.rng["cpu"])
    cuda = sorted((k for k in ckpt.rng if k.startswith("cuda/")), key=lambda k: int(k.split("/")[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([ckpt.rng[k] for k in cuda])
