"""Every path a user can take, through the service: each method × recipe × router it offers goes
convert → evaluate *with baselines* → compare data → fine-tune (its own mode, the modes that refuse
it, and on a few rows the other modes that train it) → export (the API's zip and the CLI's native
format) → reload and generate, against the real API, Redis and worker.

A combination that cannot work must be refused up front (HTTP 422 / a CLI error) with a message
that says what to change: the matrix states which ones and asserts the message. It registers a
dense model of every supported family and the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE), and
converts the MoE models hierarchically through the API.

The matrix is written to ``test-artifacts/journey-matrix.md`` (the closing note's table).
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from moelab.engine.methods import conversion_label
from tests.conftest import FAMILIES, REPO, build_tiny_model, build_tiny_moe, tiny_models_root

from .helpers import succeeded, wait_job

API = "/api/v1"
MODES = ("expertweaver", "cmoe", "dense2moe", "midas")
EVAL = {"n_windows": 2, "seq_len": 32, "baselines": True, "multiple_choice_per_task": 0}
FINETUNE = {"steps": 1, "batch_size": 1, "seq_len": 16, "eval_windows": 1, "checkpoint_every": 100, "lora_rank": 2}
PROMPT = "The capital of France is"

# What a refusal must say, by cause: the layer kind a mode trains, or the combine it extends.
KIND_MOE = "trains layers of kind 'moe'"
KIND_LOWRANK = "trains layers of kind 'lowrank_moe'"
EW_SUM = "expertweaver fine-tuning starts from the training-free 'sum' combine"
#: native export refusals name what to do instead (runtime/native_export.py)
NATIVE_REMEDY = ("fine-tune in mode expertweaver", "convert with", "native export needs", "export with --format moelab",
                 "supports", "use --format moelab")


def _best(method: str, recipe: str = "best") -> dict[str, Any]:
    from moelab.engine.methods import get_method

    return dict(get_method(method).recipes[recipe])


# row name -> (method, params, {mode: None (trains) | refusal substring})
ROWS: dict[str, tuple[str, dict[str, Any], dict[str, str | None]]] = {
    "expertweaver · paper · centroid": ("expertweaver", {"n_experts": 8}, {"expertweaver": None, "cmoe": None, "dense2moe": None, "midas": KIND_LOWRANK}),
    "expertweaver · paper · gate_mass": ("expertweaver", {"n_experts": 8, "router": "gate_mass"}, {"expertweaver": None, "midas": KIND_LOWRANK}),
    "expertweaver · paper · ridge": ("expertweaver", {"n_experts": 8, "router": "ridge"}, {"expertweaver": None, "midas": KIND_LOWRANK}),
    "expertweaver · best": ("expertweaver", {**_best("expertweaver"), "n_experts": 8}, {"expertweaver": None, "cmoe": None, "midas": KIND_LOWRANK}),
    "expertweaver · portable": ("expertweaver", {"n_experts": 8, **_best("expertweaver", "portable")},
                                {"expertweaver": None, "cmoe": None, "midas": KIND_LOWRANK}),
    "cmoe · paper · representative": ("cmoe", {}, {"cmoe": None, "midas": KIND_LOWRANK}),
    "cmoe · paper · gate_mass": ("cmoe", {"router": "gate_mass"}, {"cmoe": None, "midas": KIND_LOWRANK}),
    "cmoe · paper · ridge": ("cmoe", {"router": "ridge"}, {"cmoe": None, "midas": KIND_LOWRANK}),
    "dense2moe · paper (sum)": ("dense2moe", {"layer": 0, "n_fused": 1}, {"dense2moe": None, "midas": KIND_LOWRANK}),
    "dense2moe · weighted": ("dense2moe", {"layer": 0, "n_fused": 1, "combine": "weighted"},
                             {"dense2moe": None, "expertweaver": None, "cmoe": "cmoe fine-tuning extends the training-free 'sum' combine",
                              "midas": KIND_LOWRANK}),
    "midas · paper": ("midas", {"top_k": 1}, {"midas": None, "expertweaver": KIND_MOE, "cmoe": KIND_MOE, "dense2moe": KIND_MOE}),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")

MATRIX: dict[str, dict[str, str]] = {}  # row -> column -> "✓" or the refusal


def _post(client, path: str, body: dict[str, Any]):
    return client.post(f"{API}{path}", json=body)


def _run(client, path: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    r = _post(client, path, body)
    assert r.status_code == 202, (path, body, r.text)
    job = wait_job(client, r.json()["job_id"], timeout)
    assert job["state"] == "succeeded", (path, body, job.get("error"))
    return r.json()


def _cell(row: str, column: str, value: str) -> None:
    MATRIX.setdefault(row, {})[column] = value


def _short(message: str) -> str:
    return message if len(message) <= 140 else message[:137] + "…"


@pytest.fixture(scope="module")
def second_profile_id(client, model_id) -> str:
    """MIDAS reads one profile per calibration set: a code set beside the mixed one."""
    cset = _run(client, "/calibration-sets", {"source": "builtin", "name": "code", "samples": 8})
    return _run(client, "/profiles", {"model_id": model_id, "calibration_set_id": cset["id"], "max_tokens": 32,
                                      "batch_tokens": 256})["id"]


def _zip_model(client, conversion_id: str, into: Path) -> Path:
    r = client.get(f"{API}/artifacts/conversions/{conversion_id}/archive")
    assert r.status_code == 200, r.text
    zipfile.ZipFile(io.BytesIO(r.content)).extractall(into)
    return into / conversion_id


def _greedy(model, tokenizer, n: int = 6) -> list[int]:
    enc = tokenizer(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def _check_exports(client, settings, row: str, conversion_id: str, tmp: Path) -> None:
    """The API's zip (moelab format) reloads outside moelab and generates what the service's own
    generation probe generates; the CLI's native export either writes a stock architecture that
    computes the same logits, or refuses saying what would export."""
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moelab.cli import main

    probe = _run(client, "/probes", {"conversion_id": conversion_id, "kind": "generate", "text": PROMPT, "max_new_tokens": 6})
    result = client.get(f"{API}/probes/{probe['id']}/result").json()
    path = _zip_model(client, conversion_id, tmp / "zip")
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tokens = _greedy(model, tok)
    assert tok.decode(tokens, skip_special_tokens=True) == result["converted"]["text"], (row, result["converted"])
    _cell(row, "zip → reload → generate", "✓")

    out = tmp / "native"
    src = settings.resolved_artifacts_dir() / "conversions" / conversion_id
    res = CliRunner().invoke(main, ["export", str(src), "--format", "native", "--out", str(out)])
    if res.exit_code == 0:
        native = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False).eval()
        ids = tok(PROMPT, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            diff = (native(ids).logits - model(ids).logits).abs().max().item()
        assert diff < 1e-4, (row, diff)
        assert _greedy(native, tok) == tokens
        _cell(row, "native export", f"✓ ({type(native).__name__}, max |Δlogit| {diff:.1e})")
    else:
        message = res.output.strip().splitlines()[-1] if res.output.strip() else repr(res.exception)
        assert res.exit_code != 0 and any(r in message for r in NATIVE_REMEDY), (row, res.output)
        _cell(row, "native export", "refused: " + _short(message.removeprefix("Error: ")))


def _check_compare(client, row: str, conversion: dict[str, Any], variants: dict[str, Any]) -> None:
    """What Compare draws for this conversion (its pure row builder) is the evaluation's ratio."""
    from frontend.figures import perplexity_rows

    evals = client.get(f"{API}/evaluations", params={"conversion_id": conversion["id"]}).json()["items"]
    shown = next(r for r in perplexity_rows([conversion], {conversion["id"]: evals}) if r["variant"] == "converted")
    assert shown["ratio_to_dense"] == pytest.approx(variants["converted"]["perplexity_ratio"])
    _cell(row, "compare", f"✓ ×{shown['ratio_to_dense']:.2f}")


def _finetunes(client, settings, row: str, conversion_id: str, expected: dict[str, str | None], own: str | None,
               tmp: Path) -> None:
    for mode in MODES:
        body = {"conversion_id": conversion_id, "mode": mode, **FINETUNE}
        want = expected.get(mode, "not run")
        if want == "not run":
            continue
        r = _post(client, "/finetunes", body)
        if want is not None:
            assert r.status_code == 422 and want in r.text, (row, mode, r.status_code, r.text)
            _cell(row, f"fine-tune {mode}", "refused: " + _short(r.json()["detail"].removeprefix("mode: ")))
            continue
        assert r.status_code == 202, (row, mode, r.text)
        job = wait_job(client, r.json()["job_id"], 300)
        assert job["state"] == "succeeded", (row, mode, job.get("error"))
        ft = client.get(f"{API}/finetunes/{r.json()['id']}").json()
        s = ft["summary"]
        assert s["perplexity_after"] > 0 and ft["result_conversion_id"], ft
        _cell(row, f"fine-tune {mode}", f"✓ ({s['perplexity_before']:.0f} → {s['perplexity_after']:.0f})")
        if mode == own:  # what a fine-tune makes can leave moelab too
            result = client.get(f"{API}/conversions/{ft['result_conversion_id']}").json()
            assert result["status"] == "ready"
            config = client.get(f"{API}/artifacts/conversions/{result['id']}/files/config.json").json()
            if mode == "expertweaver":  # EW Eq. 11 everywhere: softmax, weighted, no skipped-expert means
                routed = [s for s in config["moe_layers"] if s and s.get("kind") == "moe" and s.get("n_routed")]
                assert all((s["router"], s["combine"], s.get("skip_mean")) == ("softmax", "weighted", None) for s in routed)
            _check_exports(client, settings, f"{row} → fine-tuned ({mode})", result["id"], tmp / f"ft-{mode}")


@pytest.mark.parametrize("row", list(ROWS))
def test_journey(row, client, settings, profile_id, second_profile_id, tmp_path):
    method, params, expected = ROWS[row]
    body: dict[str, Any] = {"method": method, "profile_id": profile_id, method: params}
    if method == "midas":
        body["extra_profile_ids"] = [second_profile_id]
    conv = _run(client, "/conversions", body)
    c = client.get(f"{API}/conversions/{conv['id']}").json()
    # every page names it by the words its method declares, for any method (GET /conversions too)
    assert c["label"] == conversion_label(c["params"]) and c["label"]
    assert next(x for x in client.get(f"{API}/conversions").json()["items"] if x["id"] == c["id"])["label"] == c["label"]
    cost = c["summary"].get("ffn_flops_fraction")
    _cell(row, "convert", f"✓ (cost {cost:.2f})" if cost is not None else "✓")

    ev = _run(client, "/evaluations", {"conversion_id": conv["id"], **EVAL})
    summary = client.get(f"{API}/evaluations/{ev['id']}").json()["summary"]
    variants = summary["variants"]
    want = {"dense", "converted"} | ({"abstopk"} if method in ("expertweaver", "cmoe") else set())
    assert want <= set(variants), (row, variants)
    if method == "expertweaver" and "uniform" in variants:
        assert variants["uniform"]["perplexity"] > 0
    extra = sorted(set(variants) - {"dense", "converted"})
    _cell(row, "evaluate (baselines)", "✓ " + ", ".join(extra) if extra else "✓ (no baseline for this method)")
    _check_compare(client, row, c, variants)

    _finetunes(client, settings, row, conv["id"], expected, method, tmp_path)
    _check_exports(client, settings, row, conv["id"], tmp_path / "conv")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_dense_family_registers(family, client, tmp_path_factory, default_model_dir):
    path = tiny_models_root(tmp_path_factory) / f"journey-{family}"
    if not path.exists():
        build_tiny_model(family, path, default_model_dir, seed=1)
    r = _post(client, "/models", {"source": str(path)})
    assert r.status_code in (200, 202), r.text
    if r.status_code == 202:
        succeeded(client, r.json())
    layers = client.get(f"{API}/models/{r.json()['id']}/layers").json()
    assert layers["family"] == family and layers["n_layers"] == 3, layers
    _cell(f"register {family}", "register", "✓ dense")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_model_registers_and_converts_hierarchically(family, client, settings, tmp_path_factory, default_model_dir,
                                                         tmp_path):
    path = tiny_models_root(tmp_path_factory) / f"journey-{family}"
    if not path.exists():
        build_tiny_moe(family, path, default_model_dir)
    r = _post(client, "/models", {"source": str(path)})
    assert r.status_code in (200, 202), r.text
    if r.status_code == 202:
        succeeded(client, r.json())
    model = client.get(f"{API}/models/{r.json()['id']}").json()
    assert model["status"] == "ready" and model["info"]["kind"] == "moe" and model["info"]["family"] == family, model
    row = f"hierarchical · {family}"
    _cell(row, "register", f"✓ moe ({model['info']['num_experts']} experts)")
    conv = _run(client, "/conversions", {"method": "hierarchical", "model_id": model["id"], "calibration": "builtin:mixed",
                                         "hierarchical": {"n_experts": 4, "shared": 1, "active": 1, "samples": 6,
                                                          "max_tokens": 48, "min_expert_tokens": 16}})
    _cell(row, "convert", "✓")
    ev = _run(client, "/evaluations", {"conversion_id": conv["id"], **EVAL})
    variants = client.get(f"{API}/evaluations/{ev['id']}").json()["summary"]["variants"]
    assert {"dense", "converted"} <= set(variants)
    _cell(row, "evaluate (baselines)", "✓ (no baseline; the original MoE is the reference)")
    _check_compare(client, row, client.get(f"{API}/conversions/{conv['id']}").json(), variants)
    nodefault = _post(client, "/finetunes", {"conversion_id": conv["id"], **FINETUNE})
    assert nodefault.status_code == 422 and "pass mode explicitly" in nodefault.text, nodefault.text
    for mode in MODES:
        r = _post(client, "/finetunes", {"conversion_id": conv["id"], "mode": mode, **FINETUNE})
        assert r.status_code == 422 and "trains layers of kind" in r.text, (mode, r.text)
        _cell(row, f"fine-tune {mode}", "refused: " + _short(r.json()["detail"].removeprefix("mode: ")))
    _check_exports(client, settings, row, conv["id"], tmp_path)


def test_write_the_matrix():
    """The table of the closing note (rows: paths; columns: steps), written after the journeys ran."""
    if not MATRIX:
        pytest.skip("no journey ran in this session")
    columns: list[str] = []
    for cells in MATRIX.values():
        columns += [c for c in cells if c not in columns]
    lines = ["| path | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row, cells in MATRIX.items():
        lines.append(f"| {row} | " + " | ".join(cells.get(c, "") for c in columns) + " |")
    out = REPO / "test-artifacts"
    out.mkdir(exist_ok=True)
    (out / "journey-matrix.md").write_text("\n".join(lines) + "\n")
    (out / "journey-matrix.json").write_text(json.dumps(MATRIX, indent=2, ensure_ascii=False))
