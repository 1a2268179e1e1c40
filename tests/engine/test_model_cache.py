"""The worker's model cache (``workers.model_cache``): bounded by count and by bytes of weights, a
converted model kept between jobs and given back only unchanged, and reloaded once its conversion's
files are rewritten; an evaluation and a probe run on the cached models give the numbers of a fresh
load."""

from __future__ import annotations

import os

import pytest
from torch import nn

from tests.engine.conftest import tiny_conversion
from workers import model_cache
from workers.model_cache import ModelCache, weight_bytes


def _module(n_floats: int) -> nn.Module:
    return nn.Linear(n_floats, 1, bias=False)  # n_floats float32 weights


def test_byte_budget_evicts_least_recent_and_refuses_one_too_large():
    mib = 1 << 20
    cache = ModelCache(size=10, max_bytes=3 * mib)
    a, b, c = _module(mib // 4), _module(mib // 4), _module(mib // 4)  # 1 MiB each
    assert weight_bytes(a) == mib
    cache.give(("a",), a)
    cache.give(("b",), b)
    cache.give(("c",), c)
    assert cache.nbytes == 3 * mib and len(cache) == 3
    cache.give(("d",), _module(mib // 2))  # 2 MiB: a and b leave, oldest first
    assert cache.keys() == [("c",), ("d",)] and cache.nbytes == 3 * mib
    cache.give(("huge",), _module(mib))  # 4 MiB > the whole budget: not kept, nothing else evicted
    assert cache.keys() == [("c",), ("d",)]


@pytest.fixture(scope="module")
def conversion(tiny_model, data_dir, tmp_path_factory):
    return tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=4, alpha_max=0.5)


@pytest.fixture
def cache():
    saved = (model_cache.CACHE.size, model_cache.CACHE.max_bytes)
    model_cache.CACHE.clear()
    model_cache.install(4, 1 << 30)
    yield model_cache.CACHE
    model_cache.CACHE.clear()
    model_cache.install(*saved)


def test_a_converted_model_is_reused_and_reloaded_when_rewritten(conversion, cache):
    with model_cache.job_models(give_back=True):
        first = model_cache.cached_load_converted(conversion)
    with model_cache.job_models(give_back=True):
        assert model_cache.cached_load_converted(conversion) is first  # kept between jobs
        assert model_cache.cached_load_converted(conversion) is not first  # checked out: never shared by two users
    with model_cache.job_models(give_back=False):  # a job that changes its model never gives it back
        model_cache.cached_load_converted(conversion)
    config = conversion / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the conversion's files rewritten in place
    with model_cache.job_models(give_back=True):
        assert model_cache.cached_load_converted(conversion) is not first


def test_evaluation_and_probe_on_cached_models_match_a_fresh_load(conversion, cache, data_dir):
    from moelab.engine.runs import run_evaluation, run_probe

    kw = dict(data_dir=data_dir, n_windows=2, seq_len=32, baselines=False, mc_per_task=0, write=False, source="builtin:code")
    fresh = run_evaluation(conversion, **kw)
    for _ in range(2):  # the second run takes both models from the cache the first gave them back to
        with model_cache.job_models(give_back=True):
            cached = run_evaluation(conversion, loader=model_cache.cached_load_model,
                                    load_converted=model_cache.cached_load_converted, **kw)
    assert len(cache) == 2  # the dense model and the converted one
    for variant in ("dense", "converted"):
        assert cached["results"][variant]["perplexity"] == pytest.approx(fresh["results"][variant]["perplexity"], rel=1e-6)
    assert cached["results"]["converted"]["routing"]["load"] == fresh["results"]["converted"]["routing"]["load"]
    text = "def add(a, b):\n    return a + b"
    want = run_probe(conversion, kind="routing", text=text, data_dir=data_dir)
    with model_cache.job_models(give_back=True):
        got = run_probe(conversion, kind="routing", text=text, data_dir=data_dir, loader=model_cache.cached_load_model,
                        load_converted=model_cache.cached_load_converted)
    assert [lay["experts"] for lay in got["layers"]] == [lay["experts"] for lay in want["layers"]]
