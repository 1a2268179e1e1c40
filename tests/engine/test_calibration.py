"""Calibration sets: built-in sets (labels, determinism, calibration/held-out separation),
content ids, persistence, stats, user files with every kind of bad input, Hugging Face
loading from local files, and the BIG-bench install path on a synthetic sdist."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from moelab.engine.data import builtin as bd
from moelab.engine.data.calibration import (
    CalibrationError,
    CalibrationSet,
    Sample,
    chunk_text,
    load_calibration,
    load_hf_dataset,
    read_jsonl,
    read_txt,
)

OFFLINE_SETS = ["code", "prose", "literature", "chat", "code_problems", "math"]
LONG = "This is a perfectly reasonable calibration sentence, long enough to keep. "


# --------------------------------------------------------------------------------------------
# built-in sets
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OFFLINE_SETS + ["mixed"])
def test_builtin_nonempty_labelled_and_sized(name: str) -> None:
    cs = bd.builtin_set(name, n_samples=24, seed=0)
    assert len(cs) == 24
    assert cs.source == f"builtin:{name}" and cs.seed == 0 and cs.name == name
    expected_tasks = set(bd.MIXED_PARTS) if name == "mixed" else {name}
    assert set(cs.tasks()) == expected_tasks
    for s in cs.samples:
        assert s.domain, s
        # ~1000-1600 characters so a 256-token window is filled
        assert 900 <= len(s.text) <= bd.MAX_CHARS, (s.domain, len(s.text))
    if name == "math":
        assert set(cs.domains()) == set(bd.MATH_OPERATIONS)
        assert all("The answer is" in s.text for s in cs.samples)
    if name == "code_problems":
        assert cs.domains() == ["humaneval"] and all("def " in s.text for s in cs.samples)
    if name == "literature":
        assert not any("gutenberg" in s.text.lower() for s in cs.samples)
    if name == "code":
        assert not any(d in {"test", "site-packages"} for d in cs.domains())


@pytest.mark.parametrize("name", OFFLINE_SETS + ["mixed"])
def test_builtin_deterministic_per_seed(name: str) -> None:
    a = bd.builtin_set(name, n_samples=12, seed=3)
    b = bd.builtin_set(name, n_samples=12, seed=3)
    c = bd.builtin_set(name, n_samples=12, seed=4)
    assert a.samples == b.samples and a.id == b.id
    assert a.samples != c.samples and a.id != c.id


@pytest.mark.parametrize("name", OFFLINE_SETS)
def test_calibration_and_heldout_never_share_a_source_unit(name: str) -> None:
    cal = bd._build(name, 60, 0, "calibration", None)
    held = bd._build(name, 60, 1, "heldout", None)  # another seed too: the partition ignores seeds
    assert cal and held
    cal_units = {u for units, _ in cal for u in units}
    held_units = {u for units, _ in held for u in units}
    assert cal_units.isdisjoint(held_units)
    cal_texts = {s.text for _, s in cal}
    assert not any(s.text in cal_texts for _, s in held)
    if name in ("code", "prose", "literature"):  # the domain is the unit here
        assert {s.domain for _, s in cal}.isdisjoint({s.domain for _, s in held})


def test_code_and_prose_hold_out_the_same_modules() -> None:
    code_held = {s.domain for s in bd.builtin_set("code", 40, 0, split="heldout").samples}
    prose_cal = {s.domain for s in bd.builtin_set("prose", 80, 0).samples}
    assert code_held and code_held.isdisjoint(prose_cal)


def test_heldout_set_is_named_apart() -> None:
    held = bd.builtin_set("math", 6, 0, split="heldout")
    assert held.name == "math-heldout" and held.source == "builtin:math"


def test_mixed_is_balanced() -> None:
    cs = bd.builtin_set("mixed", n_samples=240, seed=0)
    assert len(cs) == 240
    assert Counter(s.task for s in cs.samples) == {t: 40 for t in bd.MIXED_PARTS}
    odd = bd.builtin_set("mixed", n_samples=20, seed=0)
    counts = Counter(s.task for s in odd.samples)
    assert sum(counts.values()) == 20 and max(counts.values()) - min(counts.values()) <= 1
    assert len(bd.builtin_set("mixed", 240, 0, split="heldout")) == 240


def test_a_mix_of_named_parts_leaves_the_others_out() -> None:
    """``builtin:a+b``: what the leave-domain-out frontier calibrates on; no sample of a part not named."""
    cs = load_calibration("builtin:prose+literature+chat", samples=30)
    assert Counter(s.task for s in cs.samples) == {"prose": 10, "literature": 10, "chat": 10}
    assert cs.source == "builtin:prose+literature+chat"
    held = bd.builtin_set("code+math", 8, 0, split="heldout")
    assert Counter(s.task for s in held.samples) == {"code": 4, "math": 4}
    # a mix keeps the split: its calibration samples come from calibration units only
    units = [u for us, _ in bd._build("code+chat", 40, 0, "calibration", None) for u in us]
    assert units and {bd.unit_split(u) for u in units if u.startswith("stdlib:")} == {"calibration"}
    with pytest.raises(CalibrationError, match="foo is not one"):
        bd.builtin_set("prose+foo", 4)
    with pytest.raises(CalibrationError, match="a part twice"):
        bd.builtin_set("prose+prose", 4)


def test_builtin_errors() -> None:
    with pytest.raises(CalibrationError, match="known: code, prose"):
        bd.builtin_set("nope")
    with pytest.raises(CalibrationError, match="heldout"):
        bd.builtin_set("math", split="test")
    with pytest.raises(CalibrationError, match="at least 1"):
        bd.builtin_set("math", n_samples=0)


def test_unit_split_is_stable_and_about_20_percent() -> None:
    assert bd.unit_split("stdlib:json") == bd.unit_split("stdlib:json")
    held = sum(bd.unit_split(f"u{i}") == "heldout" for i in range(5000))
    assert 850 < held < 1150


def test_strip_gutenberg() -> None:
    text = (
        "The Project Gutenberg EBook of Hamlet\n\nThis eBook is for the use of anyone\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nACT I.\n\nBer.\nWho's there?\n\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nlicence text"
    )
    out = bd.strip_gutenberg(text)
    assert out.startswith("ACT I.") and "Who's there?" in out
    assert "Gutenberg" not in out and "licence" not in out


def test_chunk_text_line_boundaries() -> None:
    text = "".join(f"line {i:04d} " + "x" * 40 + "\n" for i in range(200))
    chunks = chunk_text(text, target=500, max_chars=700, min_chars=300)
    assert chunks and all(300 <= len(c) <= 700 for c in chunks)
    assert all(c.startswith("line ") for c in chunks)  # never cut inside a line
    one_line = "word " * 1000
    assert all(len(c) <= 700 for c in chunk_text(one_line, target=500, max_chars=700))


# --------------------------------------------------------------------------------------------
# the set object
# --------------------------------------------------------------------------------------------


def _small_set() -> CalibrationSet:
    samples = [Sample(f"{LONG} number {i}", task=f"t{i % 3}", domain=f"d{i % 2}") for i in range(12)]
    samples.append(Sample(LONG + " unlabelled"))
    return CalibrationSet("small", samples, source="test", seed=None)


def test_id_is_content_addressed() -> None:
    a, b = _small_set(), _small_set()
    assert re.fullmatch(r"cs-[0-9a-f]{12}", a.id) and a.id == b.id
    b.source, b.seed = "elsewhere", 7  # provenance is not content
    assert a.id == b.id
    b.samples[0] = Sample(b.samples[0].text + "!", "t0", "d0")
    assert a.id != b.id
    assert CalibrationSet("other", a.samples, "test").id != a.id


def test_labels_frame_preview() -> None:
    cs = _small_set()
    assert cs.tasks() == ["t0", "t1", "t2"] and cs.domains() == ["d0", "d1"]
    df = cs.to_frame()
    assert list(df.columns) == ["text", "task", "domain"] and len(df) == 13
    assert df["task"].isna().sum() == 1
    prev = cs.preview(n=2, max_chars=20)
    assert len(prev) == 2 and prev[0]["text"].endswith("…") and len(prev[0]["text"]) <= 21
    assert prev[0]["task"] == "t0" and prev[0]["chars"] == len(cs.samples[0].text)


class WhitespaceTokenizer:
    """Stands in for a Hugging Face tokenizer: same call signature, counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, texts, add_special_tokens=True):
        self.calls += 1
        assert add_special_tokens is False
        return {"input_ids": [t.split() for t in texts]}


def test_stats_with_and_without_tokenizer() -> None:
    cs = _small_set()
    st = cs.stats()
    json.dumps(st)
    assert st["n_samples"] == 13 and st["n_chars"] == sum(len(s.text) for s in cs.samples)
    assert set(st["tasks"]) == {"t0", "t1", "t2"} and st["tasks"]["t0"]["samples"] == 4
    assert "tokens" not in st["tasks"]["t0"] and "n_tokens" not in st
    tok = WhitespaceTokenizer()
    st = cs.stats(tok)
    json.dumps(st)
    assert tok.calls == 1  # one batched call
    assert st["n_tokens"] == sum(len(s.text.split()) for s in cs.samples)
    assert st["domains"]["d0"]["tokens"] == sum(len(s.text.split()) for s in cs.samples if s.domain == "d0")
    assert sum(v["samples"] for v in st["domains"].values()) == 12


def test_stats_with_real_tokenizer(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    st = bd.builtin_set("mixed", 12, 0).stats(tok)
    json.dumps(st)
    # samples are sized to fill a 256-token profiling window
    assert st["tokens_per_sample"]["min"] >= 200
    assert set(st["tasks"]) == set(bd.MIXED_PARTS)


def test_save_load_round_trip(tmp_path: Path) -> None:
    cs = _small_set()
    out = cs.save(tmp_path / "sets" / "small")
    assert (out / "samples.parquet").is_file()
    meta = json.loads((out / "calibration.json").read_text())
    assert meta["id"] == cs.id and meta["n_samples"] == 13 and meta["name"] == "small" and meta["created_at"]
    back = CalibrationSet.load(out)
    assert back.samples == cs.samples and back.id == cs.id and back.source == "test" and back.seed is None
    cs.samples.pop()
    cs.save(out)  # overwrite atomically
    assert len(CalibrationSet.load(out)) == 12
    assert load_calibration(str(out)).id == cs.id


def test_load_refuses_incomplete_or_altered(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="no such"):
        CalibrationSet.load(tmp_path / "missing")
    out = _small_set().save(tmp_path / "s")
    (out / "samples.parquet").unlink()
    with pytest.raises(CalibrationError, match="missing samples.parquet"):
        CalibrationSet.load(out)
    out = _small_set().save(tmp_path / "s")
    meta = json.loads((out / "calibration.json").read_text())
    meta["id"] = "cs-000000000000"
    (out / "calibration.json").write_text(json.dumps(meta))
    with pytest.raises(CalibrationError, match="do not match"):
        CalibrationSet.load(out)


def test_subsample_is_deterministic_and_task_balanced() -> None:
    samples = [Sample(f"{LONG} a{i}", "big") for i in range(30)] + [Sample(f"{LONG} b{i}", "small") for i in range(4)]
    cs = CalibrationSet("s", samples, "test")
    a, b = cs.subsample(8, seed=1), cs.subsample(8, seed=1)
    assert a.samples == b.samples and len(a) == 8 and a.seed == 1
    assert Counter(s.task for s in a.samples) == {"big": 4, "small": 4}
    assert cs.subsample(8, seed=2).samples != a.samples
    order = [samples.index(s) for s in a.samples]
    assert order == sorted(order)  # original order kept
    assert len(cs.subsample(100, seed=0)) == 34


# --------------------------------------------------------------------------------------------
# user files
# --------------------------------------------------------------------------------------------


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return p


def test_read_jsonl_ok(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "good.jsonl",
        json.dumps({"text": LONG, "task": "qa", "domain": "web"}) + "\n\n"
        + json.dumps({"text": "too short"}) + "\n"
        + json.dumps({"text": LONG + "2", "extra": 1}) + "\n",
    )
    samples = read_jsonl(p)
    assert samples == [Sample(LONG, "qa", "web"), Sample(LONG + "2")]
    arr = _write(tmp_path, "arr.json", json.dumps([{"text": LONG}, {"text": LONG + "x", "task": "t"}]))
    assert len(read_jsonl(arr)) == 2


BAD_JSONL = {
    "not valid JSON": (json.dumps({"text": LONG}) + "\n{broken\n", ":2:"),
    "expected a JSON object": (json.dumps({"text": LONG}) + "\n" + json.dumps([1, 2]) + "\n", ":2:"),
    "missing 'text'": ("\n" + json.dumps({"text": LONG}) + "\n" + json.dumps({"body": LONG}) + "\n", ":3:"),
    "'text' must be a string": (json.dumps({"text": 5}) + "\n", ":1:"),
    "'task' must be a string": (json.dumps({"text": LONG, "task": 3}) + "\n", ":1:"),
    "'domain' must be a string": (json.dumps({"text": LONG}) + "\n" + json.dumps({"text": LONG, "domain": ["a"]}) + "\n", ":2:"),
    "every sample is shorter than 20 characters": (json.dumps({"text": "short"}) + "\n", ""),
}


@pytest.mark.parametrize("problem", list(BAD_JSONL))
def test_read_jsonl_rejects(tmp_path: Path, problem: str) -> None:
    content, where = BAD_JSONL[problem]
    p = _write(tmp_path, "bad.jsonl", content)
    with pytest.raises(CalibrationError) as err:
        read_jsonl(p)
    msg = str(err.value)
    assert str(p) + where in msg and problem in msg


def test_files_missing_empty_or_not_utf8(tmp_path: Path) -> None:
    for reader in (read_jsonl, read_txt):
        with pytest.raises(CalibrationError, match=r"nothere\.x: file not found"):
            reader(tmp_path / "nothere.x")
        empty = _write(tmp_path, "empty.x", "  \n\n")
        with pytest.raises(CalibrationError, match=r"empty\.x: file is empty"):
            reader(empty)
    latin = _write(tmp_path, "latin.jsonl", (json.dumps({"text": LONG}) + "\n").encode() * 2 + '{"text": "café au lait"}\n'.encode("latin-1"))
    with pytest.raises(CalibrationError, match=r"latin\.jsonl:3: bytes that are not UTF-8"):
        read_jsonl(latin)
    txt = _write(tmp_path, "latin.txt", "first paragraph is fine\n\nsecond line\n".encode() + "na\xefve\n".encode("latin-1"))
    with pytest.raises(CalibrationError, match=r"latin\.txt:4: bytes that are not UTF-8"):
        read_txt(txt)


def test_read_txt(tmp_path: Path) -> None:
    p = _write(tmp_path, "paras.txt", f"{LONG}one\r\n\r\n{LONG}two\n   \nshort\n\n{LONG}\nthree continues\n")
    assert [s.text for s in read_txt(p)] == [f"{LONG}one", f"{LONG}two", f"{LONG}\nthree continues"]
    single = _write(tmp_path, "single.txt", "".join(f"{LONG}{i}\n" for i in range(100)))
    chunks = read_txt(single)
    assert len(chunks) > 3 and all(len(s.text) <= 2000 for s in chunks)
    assert all(s.text.startswith("This is") for s in chunks)  # cut at line boundaries
    short = _write(tmp_path, "short.txt", "tiny\n\nalso tiny\n")
    with pytest.raises(CalibrationError, match=r"short\.txt: every sample is shorter than 20"):
        read_txt(short)


def test_load_calibration_dispatch(tmp_path: Path) -> None:
    cs = load_calibration("builtin:math", samples=6, seed=2)
    assert len(cs) == 6 and cs.source == "builtin:math" and cs.seed == 2
    assert load_calibration("builtin:math", samples=6, seed=2, split="heldout").name == "math-heldout"
    rows = "".join(json.dumps({"text": f"{LONG}{i}", "task": f"t{i % 2}"}) + "\n" for i in range(10))
    p = _write(tmp_path, "up.jsonl", rows)
    full = load_calibration(str(p))
    assert full.name == "up" and len(full) == 10 and full.source == str(p)
    sub = load_calibration(str(p), samples=4, seed=0)
    assert len(sub) == 4 and Counter(s.task for s in sub.samples) == {"t0": 2, "t1": 2}
    t = _write(tmp_path, "notes.txt", f"{LONG}a\n\n{LONG}b\n")
    assert len(load_calibration(str(t))) == 2
    with pytest.raises(CalibrationError, match="builtin:NAME") as err:
        load_calibration(str(tmp_path / "data.csv"))
    assert "data.csv" in str(err.value)
    with pytest.raises(CalibrationError, match="no calibration.json"):
        load_calibration(str(tmp_path))
    with pytest.raises(CalibrationError, match="unknown built-in"):
        load_calibration("builtin:unknown")


# --------------------------------------------------------------------------------------------
# Hugging Face datasets (local files only: no network here)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_rows() -> list[dict]:
    return [{"text": f"{LONG}{i}", "task": f"t{i % 2}", "label": i} for i in range(8)]


def test_hf_local_jsonl_and_parquet(tmp_path: Path, hf_rows: list[dict]) -> None:
    import pandas as pd

    p = _write(tmp_path, "rows.jsonl", "".join(json.dumps(r) + "\n" for r in hf_rows))
    cs = load_hf_dataset(str(p))
    assert len(cs) == 8 and cs.tasks() == ["t0", "t1"] and cs.domains() == [] and cs.name == "rows"
    assert cs.source == f"hf:{p}@train"
    assert len(load_hf_dataset(str(p), limit=3)) == 3
    q = tmp_path / "rows.parquet"
    pd.DataFrame(hf_rows).rename(columns={"text": "content"}).to_parquet(q)
    with pytest.raises(CalibrationError, match="available columns: content, task, label"):
        load_hf_dataset(str(q))
    cs = load_hf_dataset(str(q), text_field="content", task_field="label", split="validation")
    assert len(cs) == 8 and cs.tasks()[:2] == ["0", "1"]
    cs = load_calibration(f"hf:{p}@calib", samples=4)
    assert len(cs) == 4 and cs.source.endswith("@calib")


def test_hf_save_to_disk(tmp_path: Path, hf_rows: list[dict]) -> None:
    import datasets

    ds = datasets.Dataset.from_list(hf_rows)
    ds.save_to_disk(str(tmp_path / "one"))
    cs = load_hf_dataset(str(tmp_path / "one"))
    assert [s.text for s in cs.samples] == [r["text"] for r in hf_rows]
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_calibration(f"hf:{tmp_path / 'dd'}@test")) == 2
    with pytest.raises(CalibrationError, match=r"no split 'nope'.*\['test', 'train'\]"):
        load_hf_dataset(str(tmp_path / "dd"), split="nope")


def test_hf_missing_dataset_is_a_calibration_error(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="unsupported data file type"):
        load_hf_dataset(str(_write(tmp_path, "x.docx", "hello")))


# --------------------------------------------------------------------------------------------
# BIG-bench (synthetic sdist; the real one is 358 MB and never downloaded in tests)
# --------------------------------------------------------------------------------------------

BB_TASKS = {
    "general_knowledge": ["common sense", "multiple choice"],
    "code_line_description": ["computer code", "multiple choice"],
    "simple_arithmetic_json": ["mathematics", "free response"],
    "logical_deduction": ["logical reasoning", "multiple choice"],
    "emoji_movie": ["analogical reasoning", "multiple choice"],
}


def _bb_task(name: str, keywords: list[str], n: int = 40, mc: bool = True) -> dict:
    examples = []
    for i in range(n):
        if mc:
            examples.append({"input": f"{name} question {i}: which option is right?",
                             "target_scores": {f"option {j}": int(j == i % 3) for j in range(3)}})
        else:
            examples.append({"input": f"{i} + {i} =", "target": str(2 * i)})
    return {"canary": "BENCHMARK DATA SHOULD NEVER APPEAR", "name": name, "description": f"{name} task",
            "keywords": keywords, "metrics": ["multiple_choice_grade"], "examples": examples}


def make_bigbench_sdist(path: Path) -> Path:
    """A tiny tar.gz laid out like bigbench-1.0.0.tar.gz."""
    files: dict[str, bytes] = {"bigbench-1.0.0/setup.py": b"raise SystemExit(1)\n",
                               "bigbench-1.0.0/bigbench/benchmark_tasks/README.md": b"tasks",
                               "bigbench-1.0.0/bigbench/benchmark_tasks/programmatic_only/task.py": b"# code",
                               "bigbench-1.0.0/bigbench/benchmark_tasks/broken/task.json": b"{not json"}
    for name, kws in BB_TASKS.items():
        task = _bb_task(name, kws, mc=name != "simple_arithmetic_json")
        files[f"bigbench-1.0.0/bigbench/benchmark_tasks/{name}/task.json"] = json.dumps(task).encode()
    parent = {"name": "goal_step_wikihow", "description": "wikihow", "keywords": ["causal reasoning", "multiple choice"]}
    files["bigbench-1.0.0/bigbench/benchmark_tasks/goal_step_wikihow/task.json"] = json.dumps(parent).encode()
    for sub in ("goal_inference", "step_inference"):
        files[f"bigbench-1.0.0/bigbench/benchmark_tasks/goal_step_wikihow/{sub}/task.json"] = json.dumps(
            _bb_task(f"goal_step_wikihow:{sub}", ["causal reasoning"], n=20)).encode()
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_bigbench_not_installed(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="moelab data install bigbench"):
        bd.builtin_set("bigbench", data_dir=tmp_path)
    with pytest.raises(CalibrationError, match="needs data_dir"):
        bd.builtin_set("bigbench")
    assert not bd.bigbench_installed(tmp_path) and not bd.bigbench_installed(None)


def test_install_bigbench_from_sdist_then_build(tmp_path: Path) -> None:
    sdist = make_bigbench_sdist(tmp_path / "bigbench-1.0.0.tar.gz")
    seen: list[str] = []
    root = bd.install_bigbench(tmp_path / "data", progress=lambda stage, cur, tot: seen.append(stage), sdist=sdist)
    assert root == tmp_path / "data" / "bigbench" and "extract" in seen
    assert (root / "tasks" / "general_knowledge" / "task.json").is_file()
    assert (root / "tasks" / "goal_step_wikihow" / "goal_inference" / "task.json").is_file()
    assert not (root / "tasks" / "programmatic_only").exists()
    index = json.loads((root / "index.json").read_text())
    assert index["skipped"] == ["broken"]
    assert not [p for p in (tmp_path / "data").iterdir() if p.name.startswith(".")]  # temp dirs gone
    names = bd.bigbench_task_names(tmp_path / "data")
    assert "goal_step_wikihow/goal_inference" in names and "goal_step_wikihow" not in names

    data = tmp_path / "data"
    cs = bd.builtin_set("bigbench", n_samples=30, seed=0, data_dir=data)
    assert len(cs) == 30 and cs.source == "builtin:bigbench"
    assert set(cs.tasks()) == set(BB_TASKS) | {"goal_step_wikihow"}
    assert Counter(s.task for s in cs.samples) == {t: 5 for t in cs.tasks()}
    domains = {s.task: s.domain for s in cs.samples}
    assert domains["general_knowledge"] == "common sense" and domains["goal_step_wikihow"] == "causal reasoning"
    mc = next(s.text for s in cs.samples if s.task == "general_knowledge")
    assert mc.startswith("Q: ") and "\n  choice: option 0" in mc and mc.count("\nA: option") >= 2  # few-shot
    free = next(s.text for s in cs.samples if s.task == "simple_arithmetic_json")
    assert re.search(r"Q: (\d+) \+ \1 =\nA: \d+", free)
    assert bd.builtin_set("bigbench", 30, 0, data_dir=data).samples == cs.samples
    assert bd.builtin_set("bigbench", 30, 1, data_dir=data).samples != cs.samples

    cal = bd._build("bigbench", 30, 0, "calibration", data)
    held = bd._build("bigbench", 30, 0, "heldout", data)
    assert {u for us, _ in cal for u in us}.isdisjoint({u for us, _ in held for u in us})
    held_idx = {e["index"] for e in bd.bigbench_examples("general_knowledge", "heldout", data)}
    cal_idx = {e["index"] for e in bd.bigbench_examples("general_knowledge", "calibration", data)}
    assert held_idx and cal_idx and held_idx.isdisjoint(cal_idx) and len(held_idx | cal_idx) == 40
    assert len(load_calibration("builtin:bigbench", samples=12, data_dir=data)) == 12


def test_install_bigbench_with_pip_keeps_unpacked_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip fails to build the sdist's metadata but --no-clean leaves its source tree behind."""
    calls: list[list[str]] = []

    def fake_run(cmd, env, capture_output, text):
        calls.append(cmd)
        tree = Path(env["TMPDIR"]) / "pip-req-build-abc" / "bigbench" / "benchmark_tasks" / "general_knowledge"
        tree.mkdir(parents=True)
        (tree / "task.json").write_text(json.dumps(_bb_task("general_knowledge", ["common sense"])))
        return subprocess.CompletedProcess(cmd, 1, "", "error: metadata-generation-failed")

    monkeypatch.setattr(bd.bigbench.subprocess, "run", fake_run)
    root = bd.install_bigbench(tmp_path)
    assert len(calls) == 1 and "--no-clean" in calls[0] and "bigbench==1.0.0" in calls[0]
    assert calls[0][-2:] == ["-d", calls[0][-1]] and "--no-deps" in calls[0]
    assert bd.bigbench_task_names(tmp_path) == ["general_knowledge"] and root.is_dir()


def test_install_bigbench_reports_pip_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        bd.bigbench.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")
    )
    with pytest.raises(CalibrationError, match="No matching distribution.*--sdist"):
        bd.install_bigbench(tmp_path)
    assert not (tmp_path / "bigbench").exists()
    with pytest.raises(CalibrationError, match="no bigbench/benchmark_tasks"):
        empty = tmp_path / "empty.tar.gz"
        with tarfile.open(empty, "w:gz") as tf:
            tf.addfile(tarfile.TarInfo("x/README"), io.BytesIO(b""))
        bd.install_bigbench(tmp_path, sdist=empty)
    assert not (tmp_path / "bigbench").exists()


def test_one_line_text_is_split_in_linear_time(tmp_path):
    """A .txt upload that is one 24 MB line (no blank lines, no newlines): cutting it re-sliced the
    rest of the line once per piece (quadratic: 16 MB took 10 s, 49 MB 516 s inside the request).
    Walking an index, twice the text costs about twice the time, and every character is kept."""
    import time

    from moelab.engine.data.calibration import TXT_CHUNK_CHARS, read_txt

    words = "rivers engines bread lanterns orbit sauce ".split()
    times = {}
    for mb in (6, 24):
        path = tmp_path / f"one-{mb}.txt"
        text = " ".join(words[i % len(words)] for i in range(mb * 1_000_000 // 7))
        path.write_text(text)
        runs = []
        for _ in range(3):  # the fastest of three: one pass on a loaded CI machine once took 36x the other size's
            t0 = time.perf_counter()
            samples = read_txt(path)
            runs.append(time.perf_counter() - t0)
        times[mb] = min(runs)
        assert all(len(s.text) <= TXT_CHUNK_CHARS * 4 // 3 for s in samples)
        assert sum(len(s.text) for s in samples) >= len(text) - len(samples)  # only the cut spaces go
    assert times[24] < 15.0, times  # the quadratic version: ~40 s for 24 MB (a loaded CI machine may take 3x the quiet 1-2 s)
    assert times[24] < 8 * times[6] + 2.0, times  # linear: ×4 the size is not ×16 the time (quadratic: 6 MB ~1.4 s, a bound near 13 s, 24 MB ~40 s)
