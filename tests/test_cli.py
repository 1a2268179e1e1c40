"""The ``moelab`` command as a user runs it: a real process, real files, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moelab.engine.profiling.store import StoredProfile


def moelab(*args: str, data_dir, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, MOELAB_DATA_DIR=str(data_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "moelab.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"moelab {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_profile_tiny_model_from_jsonl(tmp_path, tiny_model, data_dir):
    calib = tmp_path / "calib.jsonl"
    rows = [{"text": f"sample {i} " + "word " * (10 + i), "task": f"t{i % 3}"} for i in range(9)]
    calib.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "p1"
    proc = moelab(
        "profile", "--model", str(tiny_model("qwen3")), "--calib", str(calib), "--samples", "9",
        "--max-tokens", "32", "--out", str(out), "--quiet", data_dir=data_dir,
    )
    assert "CV by layer" in proc.stdout
    prof = StoredProfile.open(out)
    assert prof.manifest["cv_basis"] == "task" and prof.manifest["model"]["family"] == "qwen3"
    assert len(prof.samples) == 9


@pytest.mark.parametrize(
    "args, message",
    [
        (["--calib", "missing.jsonl"], "missing.jsonl"),
        (["--calib", "builtin:nope"], "unknown built-in set"),
        (["--model", "/nonexistent/model"], "nonexistent"),
        (["--max-tokens", "1"], "max-tokens"),
    ],
)
def test_profile_bad_input_fails_cleanly(tmp_path, args, message, data_dir):
    out = tmp_path / "p"
    proc = moelab("profile", "--out", str(out), "--quiet", *args, data_dir=data_dir, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_bad_jsonl_names_file_and_line(tmp_path, data_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a perfectly fine first sample line"}\n{"txt": "no text field here at all"}\n')
    proc = moelab("data", "show", str(bad), data_dir=data_dir, check=False)
    assert proc.returncode == 1 and "bad.jsonl" in proc.stderr and "bad.jsonl:2:" in proc.stderr


def test_data_commands(tmp_path, data_dir):
    assert "builtin:mixed" in moelab("data", "list", data_dir=data_dir).stdout
    shown = json.loads(moelab("data", "show", "builtin:math", "--samples", "6", "--json", data_dir=data_dir).stdout)
    assert shown["stats"]["n_samples"] == 6 and shown["id"].startswith("cs-")
    moelab("data", "build", "builtin:mixed", "--samples", "12", "--out", str(tmp_path / "set"), data_dir=data_dir)
    again = json.loads(moelab("data", "show", str(tmp_path / "set"), "--json", data_dir=data_dir).stdout)
    assert again["stats"]["n_samples"] == 12


@pytest.mark.slow
def test_profile_default_model_on_builtin_mixed(tmp_path, default_model_dir, data_dir):
    out = tmp_path / "p-default"
    moelab(
        "profile", "--model", "default", "--calib", "builtin:mixed", "--samples", "12", "--max-tokens", "64",
        "--out", str(out), "--quiet", data_dir=data_dir,
    )
    prof = StoredProfile.open(out)
    m = prof.manifest
    assert m["n_layers"] == 30 and m["d_ffn"][0] == 1536 and m["cv_basis"] == "task"
    assert len(m["groups"]) == 6 and m["settings"]["max_tokens"] == 64
    assert prof.neurons.cv.notna().all() and (prof.neurons.rate.groupby(prof.neurons.layer).sum() > 0).all()
    assert prof.xtx(0).shape == (576, 576)


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory, tiny_model, data_dir):
    out = tmp_path_factory.mktemp("cli") / "p"
    moelab(
        "profile", "--model", str(tiny_model("llama")), "--calib", "builtin:mixed", "--samples", "12",
        "--max-tokens", "32", "--out", str(out), "--quiet", data_dir=data_dir,
    )
    return out


def test_convert_evaluate_and_reload(tmp_path, tiny_profile, data_dir):
    out = tmp_path / "c1"
    proc = moelab(
        "convert", "--profile", str(tiny_profile), "--method", "expertweaver", "--alpha-min", "0.2",
        "--alpha-max", "0.7", "--tau", "0.6", "--experts", "8", "--sparsity", "0.25", "--out", str(out),
        "--quiet", data_dir=data_dir,
    )
    assert "converted model written" in proc.stdout
    record = json.loads((out / "conversion.json").read_text())
    assert record["params"]["tau"] == 0.6 and len(record["layers"]) == 3
    assert (out / "modeling_moelab.py").is_file() and (out / "model.safetensors").is_file()
    report = json.loads(
        moelab("evaluate", str(out), "--windows", "3", "--seq-len", "32", "--json", data_dir=data_dir).stdout
    )
    assert set(report["results"]) >= {"dense", "converted", "abstopk", "uniform", "teal"}
    assert report["results"]["teal"]["ffn_flops_fraction"] == pytest.approx(record["summary"]["ffn_flops_fraction"], abs=1e-3)
    assert report["heldout"]["split"] == "heldout"
    routing = report["results"]["converted"]["routing"]  # recorded on the exported model's modules
    assert len(routing["load"]) == 3 and all(sum(c) > 0 for c in routing["load"].values())
    assert json.loads((out / "evaluation.json").read_text())["results"]["dense"]["perplexity"] > 1
    # Anyone can load and run the export with plain transformers.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Once upon a time", return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=4, do_sample=False).shape[1] == ids["input_ids"].shape[1] + 4


def test_convert_cmoe_sae(tmp_path, tiny_profile, data_dir):
    out = tmp_path / "c2"
    moelab("convert", "--profile", str(tiny_profile), "--method", "cmoe", "--shared", "3", "--active", "3",
           "--experts", "8", "--out", str(out), "--quiet", data_dir=data_dir)
    record = json.loads((out / "conversion.json").read_text())
    assert all((r["n_shared"], r["top_k"], r["n_routed"]) == (3, 3, 5) for r in record["layers"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--alpha-min", "0.8", "--alpha-max", "0.7"], "alpha_min"),
        (["--tau", "0"], "tau"),
        (["--sparsity", "1.5"], "sparsity"),
        (["--experts", "500"], "do not fit"),
        (["--method", "cmoe", "--shared", "6", "--active", "4", "--experts", "8"], "exceeds"),
    ],
)
def test_convert_bad_parameters(tmp_path, tiny_profile, args, message, data_dir):
    out = tmp_path / "bad"
    proc = moelab("convert", "--profile", str(tiny_profile), "--out", str(out), "--quiet", *args, data_dir=data_dir, check=False)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_evaluate_shows_progress_bars_with_json(tmp_path, tiny_profile, data_dir):
    out = tmp_path / "c"
    moelab("convert", "--profile", str(tiny_profile), "--method", "expertweaver", "--experts", "4", "--out", str(out), "--quiet",
           data_dir=data_dir)
    proc = moelab("evaluate", str(out), "--windows", "2", "--seq-len", "16", "--json", data_dir=data_dir)
    report = json.loads(proc.stdout)
    assert report["heldout"]["windows"] == 2  # stdout stays the JSON
    for stage in ("load converted model", "load model", "read held-out text", "evaluate converted", "reconstruction error",
                  "time dense and converted"):
        assert stage in proc.stderr, proc.stderr  # one bar per stage on stderr, from the first second on
    assert set(report["speed"]["phases"]) == {"decode_b1", "decode_b8", "prefill"}
    text = moelab("evaluate", str(out), "--windows", "2", "--seq-len", "16", "--quiet", data_dir=data_dir)
    assert "evaluate converted" not in text.stderr
    assert "teal: ffn_flops_fraction" in text.stdout and "note (teal): TEAL's saving needs" in text.stdout, text.stdout
    # the whole model's time per phase beside dense's, and where it was measured
    repeats = report["speed"]["protocol"]["repeats"]  # MOELAB_SPEED_REPEATS (the suite's: 1)
    assert repeats == int(os.environ["MOELAB_SPEED_REPEATS"])
    assert "speed, whole model against dense (PyTorch eager" in text.stdout and f"threads; median of {repeats}" in text.stdout
    for phase in ("decode, batch 1", "decode, batch 8", "prefill of "):
        assert f"\n  {phase}" in text.stdout, text.stdout
    quick = moelab("evaluate", str(out), "--windows", "2", "--seq-len", "16", "--quiet", "--no-baselines", "--no-speed",
                   data_dir=data_dir)
    assert "speed, whole model" not in quick.stdout


def test_inspect_prints_json_and_a_load_bar(tiny_model, data_dir):
    proc = moelab("inspect", str(tiny_model("llama")), data_dir=data_dir)
    assert json.loads(proc.stdout)["n_layers"] == 3 and "load model" in proc.stderr


def test_convert_unknown_profile_and_evaluate_non_conversion(tmp_path, data_dir):
    proc = moelab("convert", "--profile", str(tmp_path / "nope"), "--out", str(tmp_path / "c"), data_dir=data_dir, check=False)
    assert proc.returncode == 1 and "no such profile" in proc.stderr
    proc = moelab("evaluate", str(tmp_path), data_dir=data_dir, check=False)
    assert proc.returncode == 1 and "moelab convert" in proc.stderr


def _convert_and_evaluate(tmp_path, data_dir, *args: str) -> tuple[dict, dict]:
    out = tmp_path / "c"
    record = json.loads(moelab("convert", *args, "--out", str(out), "--json", "--quiet", data_dir=data_dir).stdout)
    report = json.loads(moelab("evaluate", str(out), "--windows", "2", "--seq-len", "32", "--json", data_dir=data_dir).stdout)
    return record, report


def test_convert_dense2moe_fuses_layers_and_evaluates(tmp_path, tiny_profile, data_dir):
    record, report = _convert_and_evaluate(
        tmp_path, data_dir, "--method", "dense2moe", "--profile", str(tiny_profile), "--fuse-layer", "0", "--fuse-count", "1",
        "--top-k", "1",
    )
    s = record["summary"]
    assert s["method"] == "dense2moe" and s["n_layers"] == 2  # 3 layers, one fused away
    assert s["total_params"] > s["active_params"] and s["active_params"] < s["dense_active_params"]
    # two FFNs run per token where three did (the fused layer's top-1 of 2 experts), plus its router
    d_model = json.loads((tiny_profile / "manifest.json").read_text())["model"]["d_model"]
    router = 2 * d_model / json.loads((tiny_profile / "manifest.json").read_text())["model"]["n_ffn_parameters"]
    assert s["ffn_flops_fraction"] == pytest.approx(2 / 3 + router)
    assert report["method"] == "dense2moe" and set(report["results"]) == {"dense", "converted"}
    assert report["results"]["converted"]["routing"]["load_cv"]  # the fused layer's router was recorded


def test_convert_midas_from_two_profiles(tmp_path, tiny_profile, tiny_model, data_dir):
    other = tmp_path / "p-code"
    moelab("profile", "--model", str(tiny_model("llama")), "--calib", "builtin:code", "--samples", "12",
           "--max-tokens", "32", "--out", str(other), "--quiet", data_dir=data_dir)
    record, report = _convert_and_evaluate(
        tmp_path, data_dir, "--method", "midas", "--profile", str(tiny_profile), "--profile", str(other),
        "--keep-ratio", "0.5", "--top-k", "1",
    )
    assert record["summary"]["method"] == "midas" and len(record["profiles"]) == 2
    assert set(report["load_cv_by_set"]) == {"builtin:mixed", "builtin:code"}
    for per_set in report["load_cv_by_set"].values():
        assert len(per_set["load_cv"]) == 3  # every layer routed


def test_convert_hierarchical_needs_an_moe_model(tmp_path, tiny_profile, tiny_model, data_dir):
    proc = moelab("convert", "--method", "hierarchical", "--model", str(tiny_model("llama")), "--calib", "builtin:mixed",
                  "--samples", "4", "--out", str(tmp_path / "h"), "--quiet", data_dir=data_dir, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and not (tmp_path / "h").exists()
    proc = moelab("convert", "--method", "midas", "--profile", str(tiny_profile), "--out", str(tmp_path / "m"),
                  data_dir=data_dir, check=False)
    assert proc.returncode != 0 and "at least 2" in proc.stderr


def test_convert_hierarchical_tiny_mixtral_and_evaluate(tmp_path, default_model_dir, data_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    config = MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.1,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    src = tmp_path / "mixtral"
    AutoModelForCausalLM.from_config(config).save_pretrained(src)
    tok.save_pretrained(src)
    record, report = _convert_and_evaluate(
        tmp_path, data_dir, "--method", "hierarchical", "--model", str(src), "--calib", "builtin:mixed", "--samples", "6",
        "--experts", "8", "--shared", "2", "--active", "2",
    )
    assert record["summary"]["method"] == "hierarchical" and record["summary"]["active_params"] < record["summary"]["dense_active_params"]
    assert 0 < record["summary"]["ffn_flops_fraction"] < 1  # over the original MoE's per-token FFN cost
    assert report["results"]["converted"]["perplexity"] > 0 and report["results"]["dense"]["perplexity"] > 0
    assert report["results"]["converted"]["routing"]["load_cv"]


def test_finetune_cmoe_conversion_resumable_work_dir(tmp_path, tiny_profile, data_dir):
    conv = tmp_path / "c"
    moelab("convert", "--profile", str(tiny_profile), "--method", "cmoe", "--experts", "8", "--shared", "2", "--active", "2",
           "--out", str(conv), "--quiet", data_dir=data_dir)
    work = tmp_path / "ft"
    args = ("finetune", str(conv), "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--checkpoint-every", "1",
            "--out", str(work), "--json")
    proc = moelab(*args, data_dir=data_dir)
    summary = json.loads(proc.stdout)
    assert summary["steps"] == 2 and (work / "model" / "conversion.json").is_file()
    assert "load converted model" in proc.stderr and "train" in proc.stderr  # bars on stderr, the JSON alone on stdout
    assert json.loads((work / "model" / "conversion.json").read_text())["finetune"]
    bad = moelab("finetune", str(conv), "--mode", "midas", "--steps", "1", "--out", str(tmp_path / "x"), data_dir=data_dir, check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_every_json_command_prints_json_alone_on_a_cold_cache(tmp_path, tiny_model):
    """``--json`` means stdout is JSON only: every command that takes it, run as a user runs it (a real process)
    in a data dir where nothing is cached yet, so the first command to touch the default model de-quantises it
    (transformers' progress bar) and the first to read a built-in set builds it. Progress goes to stderr. The
    commands after the first run on a tiny model: what they print is the subject, not the default model's numbers."""
    cold = tmp_path / "cold"
    assert not (cold / "models").exists()

    def run(*args: str) -> dict | list:
        proc = moelab(*args, "--json", data_dir=cold)
        try:
            return json.loads(proc.stdout)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"moelab {' '.join(args)} --json: stdout is not JSON alone ({exc}):\n{proc.stdout[:2000]}")

    assert json.loads(moelab("inspect", "default", data_dir=cold).stdout)["n_layers"] == 30  # JSON without the flag
    assert (cold / "models").is_dir()  # the cold cache was filled by that command
    tiny = str(tiny_model("llama"))
    exported = run("export", tiny, "--format", "gguf", "--type", "f16", "--out", str(tmp_path / "gguf"))
    assert exported["format"] == "gguf" and Path(exported["file"]).is_file()
    assert {m["name"] for m in run("methods")} >= {"expertweaver", "cmoe", "dense2moe", "midas"}
    assert run("data", "show", "builtin:mixed", "--samples", "8")["stats"]["n_samples"] == 8
    assert run("tasks")[0]["name"] == "moelab_chat_qa"
    prof = run("profile", "--model", tiny, "--calib", "builtin:mixed", "--samples", "8", "--max-tokens", "32",
               "--out", str(tmp_path / "p"))
    assert prof["n_layers"] == 3
    conv = run("convert", "--profile", str(tmp_path / "p"), "--method", "cmoe", "--experts", "8", "--shared", "2",
               "--active", "2", "--out", str(tmp_path / "c"))
    assert 0 < conv["summary"]["ffn_flops_fraction"] < 1
    report = run("evaluate", str(tmp_path / "c"), "--windows", "2", "--seq-len", "32", "--no-baselines", "--tasks",
                 "moelab_lastword", "--limit", "4")  # lm-eval prints to stdout unless told otherwise
    assert report["tasks"]["moelab_lastword"]["converted"]["n"] == 4
    assert report["heldout"]["windows"] == 2
    tuned = run("finetune", str(tmp_path / "c"), "--steps", "1", "--batch-size", "1", "--seq-len", "32", "--out", str(tmp_path / "ft"))
    assert tuned["steps"] == 1
    native = run("export", str(tmp_path / "ft" / "model"), "--format", "moelab", "--out", str(tmp_path / "x"))
    assert Path(native["out"]).is_dir()
    probe = run("probe", "activation", "--profile", str(tmp_path / "p"), "--layer", "0", "--neuron", "3", "--text", "def f(x):")
    assert probe["neurons"] == [3]
