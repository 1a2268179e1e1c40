"""Engine test fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: thread hand-offs cost more than the math (10x on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_conversion(tiny_model, data_dir, tmp_path_factory, **params):
    """An ExpertWeaver conversion (``params``) of the tiny random-weight Llama, profiled on a small
    three-task set; returns its directory."""
    from tests.engine.test_profiling import make_set
    from moelab.engine.methods.expertweaver import ExpertWeaverParams
    from moelab.engine.models import load_model
    from moelab.engine.profiling.profiler import ProfileSettings, profile_model
    from moelab.engine.profiling.store import write_profile
    from moelab.engine.runs import run_conversion

    cset = make_set(n=12, tasks=3, seed=1)
    res = profile_model(load_model(str(tiny_model("llama")), data_dir=data_dir), cset, ProfileSettings(max_tokens=32, batch_tokens=128))
    prof = write_profile(res, cset, tmp_path_factory.mktemp("prof") / "p")
    out = tmp_path_factory.mktemp("conv") / "c"
    run_conversion(prof, ExpertWeaverParams(**params), out, data_dir=data_dir)
    return out


@pytest.fixture(autouse=True)
def auto_device_is_the_cpu(monkeypatch):
    """Engine tests compare against CPU fp32 references (exports reloaded on the CPU, bit-for-bit round
    trips), so device "auto" means the CPU here even on a GPU machine, where it would load tiny models on
    CUDA in bf16 (five round-trip tests failed there so). The CUDA paths have their own tests, which
    move tensors to the GPU explicitly."""
    from moelab.engine import models
    from moelab.engine.profiling import moe_experts
    from moelab.engine.streaming import plan
    from moelab.engine.training import finetune

    def resolve(device: str = "auto") -> torch.device:
        return torch.device("cpu" if device == "auto" else device)

    for module in (models, finetune, plan, moe_experts):
        monkeypatch.setattr(module, "resolve_device", resolve)
