"""How recovery fine-tuning starts an EW Eq. 11 layer from a training-free one: a softmax router
initialised from the expert centroids (EW Eq. 9; each router kind says which, ``Router.centroid``),
scaled so its logits start with a chosen spread (``training.finetune`` docstring, "EW router
initialisation"). Used by ``methods.expertweaver``'s recovery and by ``training.finetune``
(``is_router_param``); imports no method and nothing of ``training``."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..runtime.modeling_moelab import MoeFFN, MoelabForCausalLM
from .empty_module import empty_module


def is_router_param(name: str) -> bool:
    """A routed layer's router parameter or buffer (``router_weight``, ``router_scale``, ``router`` of a
    MIDAS layer …), by the name relative to the layer: fine-tuning trains these at ``router_lr``."""
    return name.split(".")[0].startswith("router")


@torch.no_grad()
def centroid_logit_std(moe: MoelabForCausalLM, modules: dict[int, MoeFFN], batch: torch.Tensor) -> dict[int, float]:
    """Per layer: std across experts of ``x · W_centroid^T`` on one batch (mean over tokens)."""
    stds: dict[int, list[float]] = {i: [] for i in modules}
    hooks = []
    for i, mod in modules.items():
        w = mod.router.scorer.centroid(mod)

        def pre(m, args, i=i, w=w):
            z = F.linear(args[0].reshape(-1, args[0].shape[-1]).float(), w.float())
            stds[i].append(float(z.std(dim=-1).mean()))

        hooks.append(mod.register_forward_pre_hook(pre))
    try:
        moe(input_ids=batch, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {i: float(np.mean(v)) for i, v in stds.items()}


@torch.no_grad()
def to_softmax_router(mod: MoeFFN, beta: float) -> MoeFFN:
    """EW Eq. 11 module from a training-free one: router ``softmax`` initialised to
    ``β·W_centroid``, combine ``weighted``, routed down projections × N_e (``training.finetune`` docstring).

    A skipped-expert compensation (``skip_mean``, ``--recipe best``) is dropped: EW Eq. 11 has none,
    and under the weighted combine an unweighted calibration mean is no longer what a skipped expert
    would have added (``core.params.check_compensation`` refuses that pairing at conversion time).
    Without it the fine-tuned layer is EW Eq. 11 exactly, which exports natively."""
    spec = {k: v for k, v in mod.spec.items() if k != "skip_mean"}
    spec.update(router="softmax", combine="weighted")
    new = empty_module(type(mod), spec, mod.experts.gate_up_proj)
    state = {k: v for k, v in mod.state_dict().items() if not is_router_param(k) and k != "skip_mean"}
    state["router_weight"] = mod.router.scorer.centroid(mod) * beta
    state["experts.down_proj"] = mod.experts.down_proj.detach() * mod.n_routed
    new.load_state_dict(state, strict=True)
    return new
