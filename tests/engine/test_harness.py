"""Downstream accuracy through lm-evaluation-harness (``evaluation.harness``): the built-in tasks, the harness's
log-likelihoods against moelab's own, a conversion with every expert active scoring the dense accuracy, a user's
task directory, offline failures, HumanEval's limited execution, and the converted config's standard attributes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from moelab.engine.evaluation.harness import BUILTIN_TASKS, TaskError, TaskRequest, list_tasks, load_tasks, task_table
from moelab.engine.evaluation.lm_tasks import moelab_tasks
from moelab.engine.evaluation.metrics import ChoiceItem, choice_loglikelihoods


def moelab(*args, data_dir, check=True):
    import os

    proc = subprocess.run([sys.executable, "-m", "moelab.cli", *args], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, MOELAB_DATA_DIR=str(data_dir)))
    if check and proc.returncode != 0:
        raise AssertionError(f"moelab {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_builtin_tasks_come_first_and_build_offline_and_deterministically():
    listed = list_tasks()
    n = len(BUILTIN_TASKS)
    assert [t["name"] for t in listed[:n]] == list(BUILTIN_TASKS) and all(t["offline"] for t in listed[:n])
    assert listed[n - 1] == {"name": "moelab_bigbench_mc", "source": "builtin", "offline": True, "domain": "builtin:bigbench",
                             "needs": "moelab data install bigbench"}
    assert {"arc_easy", "piqa", "boolq", "hellaswag", "winogrande"} <= {t["name"] for t in listed}
    qa = moelab_tasks.chat_qa()["test"]
    assert len(qa) > 800 and qa[0] == moelab_tasks.chat_qa()["test"][0]  # a fixed draw
    for row in qa.select(range(50)):
        assert len(set(row["choices"])) == 4 and 0 <= row["gold"] < 4
    words = moelab_tasks.lastword()["test"]
    assert len(words) == moelab_tasks.LASTWORD_ITEMS
    assert all(t.isalpha() and t.islower() and len(t) >= 3 for t in words["target"])
    assert len(moelab_tasks.humaneval()["test"]) == 164
    math = moelab_tasks.math_qa()["test"]
    assert len(math) > 450 and len(set(math["operation"])) == 6
    for row in math.select(range(30)):
        assert len(set(row["choices"])) == 4 and row["question"].endswith("?")


def test_an_unknown_or_unreachable_task_fails_fast_and_names_itself(tmp_path):
    with pytest.raises(TaskError, match="unknown task.*no_such_task"):
        load_tasks(TaskRequest(tasks=("no_such_task",)))
    t0 = time.perf_counter()
    with pytest.raises(TaskError, match=r"task 'arc_easy' cannot load its data here.*HF_HOME.*--online"):
        load_tasks(TaskRequest(tasks=("arc_easy",)))
    assert time.perf_counter() - t0 < 30
    with pytest.raises(TaskError, match=r"task 'moelab_bigbench_mc' needs its data installed: run `moelab data install bigbench`"):
        load_tasks(TaskRequest(tasks=("moelab_bigbench_mc",), data_dir=tmp_path))


def test_humaneval_runs_completions_in_a_limited_process():
    row = moelab_tasks.humaneval()["test"][0]
    doc = dict(row)
    assert moelab_tasks.humaneval_pass(doc, [row["canonical_solution"]]) == {"pass@1": 1.0}
    assert moelab_tasks.humaneval_pass(doc, ["    return None\n"]) == {"pass@1": 0.0}
    t0 = time.perf_counter()
    assert not moelab_tasks.passes("while True:\n    pass\n")
    assert time.perf_counter() - t0 < moelab_tasks.EXEC_TIMEOUT_S + 5
    assert not moelab_tasks.passes("x = bytearray(4 << 30)\n")  # beyond the memory limit
    assert not moelab_tasks.passes("import os\nopen(os.path.expanduser('~/x'), 'w')\nraise SystemExit(1)\n")


@pytest.mark.slow
def test_the_harness_loglikelihoods_equal_moelabs_own(default_model_dir, data_dir):
    """lm-eval's HFLM scores every (question, choice) of moelab_chat_qa as moelab's own multiple-choice scorer does."""
    from lm_eval.models.huggingface import HFLM

    from moelab.engine.models import load_model

    adapter = load_model("default", data_dir=data_dir, device="cpu", dtype="float32")
    task = load_tasks(TaskRequest(tasks=("moelab_chat_qa",)))["moelab_chat_qa"]
    task.build_all_requests(limit=12, rank=0, world_size=1)
    lm = HFLM(pretrained=adapter.model, tokenizer=adapter.tokenizer, batch_size=1)  # one sequence a forward, as below
    harness = lm.loglikelihood(task.instances)
    docs = [task.eval_docs[i] for i in range(12)]
    items = [ChoiceItem("chat_qa", f"Q: {d['question']}\nA:", list(d["choices"]), d["gold"]) for d in docs]
    sums, counts = choice_loglikelihoods(adapter.model, adapter.tokenizer, items, batch_size=1)
    by_doc = {}
    for inst, (ll, _) in zip(task.instances, harness):
        by_doc.setdefault(inst.doc_id, []).append(ll)
    got = np.array([by_doc[i] for i in range(12)])
    assert got.shape == sums.shape == (12, 4)
    # One sequence per forward on both sides: batched, the two pad differently, BLAS picks other blockings, and a
    # float32 log-prob near -20 moves by up to 2e-5 (seen at batch 8), which is rounding, not a scoring difference.
    # The harness also takes a float32 log_softmax, whose normaliser sums 49,152 exponentials in float32, so its
    # log-probs are off float64 (moelab's logsumexp − logit is within 1e-6 of it) by the CPU's own rounding of that sum:
    # 7e-6 a token below on an AVX-512 CPU (the two differing by up to 1.02e-5 a token there), 0.4–2.1e-5 a token
    # above (1.5e-5 on average) on an AVX2-only EPYC (Zen 2). That is rounding summed over a choice's tokens (3.8e-4
    # over a 38-token choice); a choice scored differently (a token more or less, another prompt) moves by 1e-2 a
    # token or more.
    assert (np.abs(got - sums) / counts).max() <= 4e-5, (np.abs(got - sums) / counts).max()
    assert (got.argmax(1) == sums.argmax(1)).all()


@pytest.fixture(scope="module")
def all_active(tmp_path_factory, default_model_dir, data_dir):
    """A CMoE conversion of the default model with every expert active (2 shared + 6 of 6 routed)."""
    root = tmp_path_factory.mktemp("harness")
    moelab("profile", "--model", "default", "--calib", "builtin:mixed", "--samples", "8", "--max-tokens", "32",
           "--out", str(root / "p"), "--quiet", data_dir=data_dir)
    moelab("convert", "--profile", str(root / "p"), "--method", "cmoe", "--experts", "8", "--shared", "2",
           "--active", "6", "--out", str(root / "c"), "--quiet", data_dir=data_dir)
    return root / "c"


@pytest.mark.slow
def test_a_conversion_with_every_expert_active_scores_the_dense_accuracy(all_active, data_dir):
    # --no-speed: accuracy is the subject here (timing is test_speed.py's)
    proc = moelab("evaluate", str(all_active), "--windows", "2", "--seq-len", "32", "--no-baselines", "--no-speed", "--tasks",
                  "moelab_chat_qa,moelab_lastword", "--limit", "40", "--json", data_dir=data_dir)
    report = json.loads(proc.stdout)
    assert report["task_settings"] == {"tasks": ["moelab_chat_qa", "moelab_lastword"], "num_fewshot": None, "limit": 40,
                                       "task_dir": None}
    for task in ("moelab_chat_qa", "moelab_lastword"):
        dense, conv = report["tasks"][task]["dense"], report["tasks"][task]["converted"]
        assert dense["n"] == conv["n"] == 40 and dense["acc_stderr"] is not None
        assert conv["acc"] == dense["acc"], (task, dense, conv)
    assert report["tasks"]["moelab_chat_qa"]["dense"]["acc"] > 0.25  # above chance (4 choices) on 40 items


def test_a_users_task_directory_runs_through_the_cli(tmp_path, tiny_model, data_dir):
    """A task YAML written outside moelab, over a local JSONL file, run through --task-dir; accuracy checked by hand."""
    tasks = tmp_path / "my-tasks"
    tasks.mkdir()
    rows = [{"q": f"{a} plus {b} is", "choices": [str(a + b), str(a + b + 1)], "label": 0} for a, b in [(1, 2), (3, 4), (5, 6)]]
    (tasks / "sums.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tasks / "sums.yaml").write_text(
        "task: my_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(tasks / "sums.jsonl") + "\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    listed = json.loads(moelab("tasks", "--task-dir", str(tasks), "--json", data_dir=data_dir).stdout)
    assert {"name": "my_sums", "source": "task_dir", "offline": True, "domain": None} in listed
    prof, conv = tmp_path / "p", tmp_path / "c"
    moelab("profile", "--model", str(tiny_model("llama")), "--calib", "builtin:mixed", "--samples", "6", "--max-tokens", "32",
           "--out", str(prof), "--quiet", data_dir=data_dir)
    moelab("convert", "--profile", str(prof), "--method", "cmoe", "--experts", "8", "--shared", "2", "--active", "2",
           "--out", str(conv), "--quiet", data_dir=data_dir)
    report = json.loads(moelab("evaluate", str(conv), "--windows", "2", "--seq-len", "16", "--no-baselines", "--no-speed", "--tasks",
                               "my_sums", "--task-dir", str(tasks), "--json", data_dir=data_dir).stdout)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(conv)
    model = AutoModelForCausalLM.from_pretrained(conv, trust_remote_code=True, dtype=torch.float32).eval()
    items = [ChoiceItem("s", r["q"], r["choices"], 0) for r in rows]
    sums, _ = choice_loglikelihoods(model, tok, items)
    assert report["tasks"]["my_sums"]["converted"]["acc"] == pytest.approx(float((sums.argmax(1) == 0).mean()))
    assert report["tasks"]["my_sums"]["converted"]["n"] == 3
    # the same as a paper-style table (one row per model)
    table = moelab("evaluate", str(conv), "--windows", "2", "--seq-len", "16", "--no-baselines", "--no-speed", "--tasks",
                   "my_sums", "--task-dir", str(tasks), "--table", "csv", "--quiet", data_dir=data_dir).stdout.splitlines()
    acc = {m: 100 * report["tasks"]["my_sums"][m]["acc"] for m in ("dense", "converted")}
    assert table[0] == "model,my_sums" and table[1].startswith(f"dense,{acc['dense']:.1f} ± ") and \
        table[2].startswith(f"converted,{acc['converted']:.1f} ± "), table
    # The export's config answers what transformers, PEFT and lm-eval ask of it.
    cfg = AutoConfig.from_pretrained(conv, trust_remote_code=True)
    base = AutoConfig.from_pretrained(tiny_model("llama"))
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "num_attention_heads"):
        assert getattr(cfg, name) == getattr(base, name), name
    assert "vocab_size" not in json.loads((conv / "config.json").read_text())  # read through, not copied
    # lm-eval loads the export by path, as it loads any Hub model, and scores it as moelab's evaluation did
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(conv), trust_remote_code=True, device="cpu", batch_size=2, dtype="float32")
    res = simple_evaluate(model=lm, tasks=["my_sums"], task_manager=TaskManager(include_path=str(tasks)), log_samples=False)
    assert res["results"]["my_sums"]["acc,none"] == report["tasks"]["my_sums"]["converted"]["acc"]
    # PEFT wraps it, and transformers' generation runs it
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert peft_model.get_nb_trainable_parameters()[0] > 0
    ids = tok("1 plus 2 is", return_tensors="pt")
    assert peft_model.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] == ids["input_ids"].shape[1] + 3
    bad = moelab("evaluate", str(conv), "--tasks", "arc_easy", data_dir=data_dir, check=False)
    assert bad.returncode == 1 and "task 'arc_easy' cannot load its data here" in bad.stderr and "Traceback" not in bad.stderr
    assert json.loads((conv / "evaluation.json").read_text())["tasks"]["my_sums"]  # the refused run wrote nothing


def test_the_paper_style_table():
    tasks = {"a": {"dense": {"acc": 0.5, "acc_stderr": 0.05}, "converted": {"acc": 0.25, "acc_stderr": None}},
             "b": {"dense": {"pass@1": 0.1, "pass@1_stderr": 0.01}}}
    assert task_table(tasks) == ("| model | a | b |\n|---|---|---|\n| dense | 50.0 ± 5.0 | 10.0 ± 1.0 |\n"
                                 "| converted | 25.0 |  |\n")
    assert task_table(tasks, fmt="csv") == "model,a,b\ndense,50.0 ± 5.0,10.0 ± 1.0\nconverted,25.0,\n"
