"""Experts matched across conversions (``evaluation.expert_matching``): a conversion whose experts
are a permutation of another's is matched back exactly with Jaccard 1; partial overlaps give the
Jaccard values a hand count gives; conversions of different models are refused; layers without
neuron sets are skipped with the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from moelab.engine.evaluation.expert_matching import (
    CONFIG_FILE,
    CONVERSION_FILE,
    PARTITION_FILE,
    DifferentModels,
    jaccard_matrix,
    match_conversion_dirs,
    match_layer,
    set_jaccard,
)

from tests.conftest import REPO

from .conftest import tiny_conversion


@pytest.fixture(scope="module")
def conversion(tiny_model, data_dir, tmp_path_factory, one_thread):
    return tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=4, alpha_min=0.2, alpha_max=0.5)


def _copy(src, dst, edit_partition=None, edit_record=None, edit_config=None):
    """A copy of the conversion's three files matching reads, each optionally edited."""
    dst.mkdir()
    for name in (CONVERSION_FILE, CONFIG_FILE, PARTITION_FILE):
        shutil.copyfile(src / name, dst / name)
    if edit_partition:
        arrays = load_file(str(dst / PARTITION_FILE))
        save_file(edit_partition(arrays) or arrays, str(dst / PARTITION_FILE))
    for name, edit in ((CONVERSION_FILE, edit_record), (CONFIG_FILE, edit_config)):
        if edit:
            data = json.loads((dst / name).read_text())
            edit(data)
            (dst / name).write_text(json.dumps(data))
    return dst


def test_the_runtime_file_names_are_the_exports():
    from moelab.engine.runtime.export import CONVERSION_FILE as C, PARTITION_FILE as P

    assert (CONVERSION_FILE, PARTITION_FILE) == (C, P)


def test_matching_never_loads_torch(conversion):
    """The API computes matchings in its own process, which must never import torch."""
    probe = ("import sys; from moelab.engine.evaluation.expert_matching import match_conversion_dirs; "
             f"match_conversion_dirs({str(conversion)!r}, {str(conversion)!r}); print(sorted({{'torch', 'transformers'}} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:] or out.stdout


def test_permuted_experts_are_matched_back_exactly(conversion, tmp_path):
    partition = load_file(str(conversion / PARTITION_FILE))
    layers = sorted({int(k.split(".")[1]) for k in partition if len(partition[k]) and k.endswith("routed")})
    rng = np.random.default_rng(0)
    perms = {i: rng.permutation(len(partition[f"layer.{i}.routed"])) for i in layers}
    n = len(perms[layers[0]])  # n_experts counts the shared expert: 3 routed
    assert n >= 3 and len(layers) == 3 and any((p != np.arange(n)).any() for p in perms.values())

    def permute(arrays):
        for i, p in perms.items():  # B's expert j is A's expert p[j]
            arrays[f"layer.{i}.routed"] = np.ascontiguousarray(arrays[f"layer.{i}.routed"][p])

    b = _copy(conversion, tmp_path / "b", edit_partition=permute)
    got = match_conversion_dirs(conversion, b)
    assert [m.layer for m in got.layers] == layers and got.skipped == []
    for m in got.layers:
        p = perms[m.layer]
        assert m.match_b == p.tolist()  # B's expert j ≙ A's expert p[j]
        assert m.match_a == np.argsort(p).tolist()
        assert m.mean_jaccard == 1.0 and m.shared_jaccard == 1.0
        assert np.allclose(m.jaccard[p, np.arange(n)], 1.0)
        off = ~np.eye(n, dtype=bool)[:, p]
        assert (m.jaccard[off] == 0).all()  # a partition's experts are disjoint
        d = m.to_dict()
        assert [e["best"] for e in d["b"]] == p.tolist() and all(e["jaccard"] == 1.0 for e in d["a"] + d["b"])
    same = match_conversion_dirs(conversion, conversion, names=("A", "A"))
    assert all(m.match_a == list(range(n)) for m in same.layers) and same.a.name == "A"


def test_partial_overlaps_match_a_hand_count():
    a = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    b = np.array([[4, 5, 6, 0], [0, 1, 2, 8], [9, 10, 11, 3]])
    j = jaccard_matrix(a, b, 14)
    # |A0∩B0| = 1 ({0}), union 7; |A0∩B1| = 3, union 5; |A0∩B2| = 1 ({3}); A1∩B0 = 3; A2∩B1 = 1 ({8}); A2∩B2 = 3
    expected = np.array([[1 / 7, 3 / 5, 1 / 7], [3 / 5, 0, 0], [0, 1 / 7, 3 / 5]])
    assert np.allclose(j, expected)
    m = match_layer(5, a, b, np.array([12, 13]), np.array([13, 7]), 14)
    assert m.match_a == [1, 0, 2] and m.match_b == [1, 0, 2]
    assert m.mean_jaccard == pytest.approx(3 / 5)
    assert m.shared_jaccard == pytest.approx(1 / 3)  # {13} of {7, 12, 13}
    assert set_jaccard(np.array([], dtype=int), np.array([], dtype=int)) is None


def test_unequal_counts_leave_the_surplus_unmatched():
    a = np.array([[0, 1], [2, 3], [4, 5]])
    b = np.array([[2, 3, 4], [0, 1, 9]])  # sizes may differ too
    m = match_layer(0, a, b, np.zeros(0, int), np.zeros(0, int), 10)
    assert m.match_a == [1, 0, None] and m.match_b == [1, 0]
    assert m.jaccard[0, 1] == pytest.approx(2 / 3) and m.jaccard[1, 0] == pytest.approx(2 / 3)
    assert m.mean_jaccard == pytest.approx(2 / 3) and m.shared_jaccard is None
    d = m.to_dict(with_matrix=True)
    assert d["a"][2] == {"expert": 2, "size": 2, "match": None, "jaccard": None, "best": 0, "best_jaccard": 0.25}
    assert d["jaccard"][2] == [0.25, 0.0] and (d["n_a"], d["n_b"]) == (3, 2)
    # disjoint experts: the assignment pairs them, but a pair without a common neuron is no match
    z = match_layer(0, np.array([[0, 1]]), np.array([[2, 3]]), np.zeros(0, int), np.zeros(0, int), 4)
    assert z.match_a == [None] and z.match_b == [None] and z.to_dict()["a"][0]["best"] is None


def test_conversions_of_different_models_are_refused(conversion, tmp_path):
    def wider(record):
        record["model"]["d_ffn"] = [128] * len(record["model"]["d_ffn"])

    other = _copy(conversion, tmp_path / "wide", edit_record=wider)
    with pytest.raises(DifferentModels, match=r"d_ffn 96\).*d_ffn 128\).*models of different shapes.*same model"):
        match_conversion_dirs(conversion, other, names=("conv-a", "conv-b"))

    def elsewhere(record):
        record["model"]["source"] = "/models/another-llama"

    other = _copy(conversion, tmp_path / "other", edit_record=elsewhere)
    with pytest.raises(DifferentModels, match="conv-b is a conversion of /models/another-llama.*different dense models"):
        match_conversion_dirs(conversion, other, names=("conv-a", "conv-b"))
    with pytest.raises(ValueError, match="layer 3 does not exist: the model has 3 layers, use 0 … 2"):
        match_conversion_dirs(conversion, conversion, layers=[3])


def test_layers_without_neuron_sets_are_skipped_with_the_reason(conversion, tmp_path):
    def one_dense(config):
        config["moe_layers"][0] = {"kind": "dense"}

    def drop_layer_0(arrays):
        return {k: v for k, v in arrays.items() if not k.startswith("layer.0.")}

    b = _copy(conversion, tmp_path / "b", edit_partition=drop_layer_0, edit_config=one_dense)
    got = match_conversion_dirs(conversion, b, names=("A", "B"))
    assert [m.layer for m in got.layers] == [1, 2]
    assert got.skipped == [(0, "layer 0 of B is kept dense (no experts)")]

    def midas(record):
        record["params"] = {"method": "midas"}

    def lowrank(config):
        config["moe_layers"] = [{"kind": "lowrank_moe"}] * 3

    c = _copy(conversion, tmp_path / "c", edit_record=midas, edit_config=lowrank)
    (c / PARTITION_FILE).unlink()
    got = match_conversion_dirs(conversion, c, names=("A", "C"))
    assert got.layers == [] and [i for i, _ in got.skipped] == [0, 1, 2]
    assert "low-rank experts (MIDAS)" in got.skipped[0][1]
    d = _copy(conversion, tmp_path / "d", edit_record=lambda r: r.update(params={"method": "dense2moe"}))
    (d / PARTITION_FILE).unlink()
    reason = match_conversion_dirs(d, conversion, layers=[1], names=("D", "A")).skipped
    assert reason == [(1, "D (dense2moe) records no neuron partition: its experts are not sets of the dense FFN's neurons "
                          "(only ExpertWeaver and CMoE conversions have one)")]
