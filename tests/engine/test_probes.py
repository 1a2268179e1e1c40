"""Token-level routing and the playground on a tiny converted model: the experts a probe reports
for each token are the ones the router's own equation picks (recomputed here from the layer
input), the token pieces spell the text, and generation is the model's own greedy output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.conftest import tiny_conversion
from moelab.engine.evaluation.metrics import routed_modules
from moelab.engine.runs import heldout_sample, run_probe
from moelab.engine.runtime.export import load_exported

TEXT = "The quick brown fox jumps over the lazy dog, then def f(x): return x * 2"


@pytest.fixture(scope="module")
def conversion(tiny_model, data_dir, tmp_path_factory):
    return tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=8, alpha_min=0.2, alpha_max=0.5, sparsity=0.5)


def test_routing_probe_reports_the_routers_own_choice(conversion, data_dir):
    out = run_probe(conversion, kind="routing", text=TEXT, data_dir=data_dir)
    model = load_exported(conversion).eval()
    tokens = out["token_ids"]
    inputs: dict[int, torch.Tensor] = {}
    routed = routed_modules(model)
    hooks = [m.register_forward_pre_hook(lambda _m, args, i=i: inputs.__setitem__(i, args[0][0])) for i, m in routed.items()]
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    assert [lay["layer"] for lay in out["layers"]] == sorted(i for i, m in routed.items() if m.top_k > 0)
    assert out["layers"], "the conversion routes in some layer"
    for lay in out["layers"]:
        mod = routed[lay["layer"]]
        assert mod.router.kind == "centroid" and mod.combine == "sum"
        with torch.no_grad():
            expected = torch.topk(F.linear(inputs[lay["layer"]], mod.router_weight), mod.top_k, dim=-1).indices  # EW Eq. 9
        got = torch.tensor(lay["experts"])
        assert got.shape == (len(tokens), mod.top_k) and lay["n_routed"] == mod.n_routed
        assert torch.equal(got, expected)  # the same experts, best-scoring first
        assert lay["load"] == torch.bincount(got.reshape(-1), minlength=mod.n_routed).tolist()
        assert sum(lay["load"]) == len(tokens) * mod.top_k


def test_routing_probe_pieces_spell_the_text(conversion, data_dir):
    from transformers import AutoTokenizer

    out = run_probe(conversion, kind="routing", text=TEXT, data_dir=data_dir)
    tok = AutoTokenizer.from_pretrained(str(conversion), trust_remote_code=True)
    assert out["token_ids"] == tok(TEXT)["input_ids"]
    assert "".join(out["tokens"]) == tok.decode(out["token_ids"])
    with pytest.raises(ValueError, match="tokenises to nothing"):
        run_probe(conversion, kind="routing", text="", data_dir=data_dir)
    with pytest.raises(ValueError, match="unknown probe kind"):
        run_probe(conversion, kind="magic", text=TEXT, data_dir=data_dir)


def test_generation_probe_is_each_models_greedy_continuation(conversion, data_dir):
    out = run_probe(conversion, kind="generate", text="Once upon a time", max_new_tokens=6, data_dir=data_dir)
    model = load_exported(conversion).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(conversion), trust_remote_code=True)
    ids = tok("Once upon a time", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out["converted"]["text"] == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    for side in ("dense", "converted"):
        r = out[side]
        assert 1 <= r["new_tokens"] <= 6 and r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"])
        assert r["prefill_tokens"] == ids.shape[1]
    assert out["speedup"] == pytest.approx(out["converted"]["tokens_per_s"] / out["dense"]["tokens_per_s"])


def test_heldout_sample_is_stable_and_bounded(data_dir):
    assert heldout_sample("builtin:code", 3, data_dir=data_dir) == heldout_sample("builtin:code", 3, data_dir=data_dir)
    with pytest.raises(ValueError, match="choose sample 0 to 47"):
        heldout_sample("builtin:code", 48, data_dir=data_dir)
