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
    from workers.engine.methods.expertweaver import ExpertWeaverParams
    from workers.engine.models import load_model
    from workers.engine.profiling.profiler import ProfileSettings, profile_model
    from workers.engine.profiling.store import write_profile
    from workers.engine.runs import run_conversion

    cset = make_set(n=12, tasks=3, seed=1)
    res = profile_model(load_model(str(tiny_model("llama")), data_dir=data_dir), cset, ProfileSettings(max_tokens=32, batch_tokens=128))
    prof = write_profile(res, cset, tmp_path_factory.mktemp("prof") / "p")
    out = tmp_path_factory.mktemp("conv") / "c"
    run_conversion(prof, ExpertWeaverParams(**params), out, data_dir=data_dir)
    return out
