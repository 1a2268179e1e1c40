"""Whole models timed in three phases (``evaluation.speed``): the ratio it reports is the ratio of times, the
inputs respect the models' positions and the text, and an evaluation carries the timing of its two models."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from tests.engine.conftest import tiny_conversion
from moelab.engine.evaluation.speed import PHASES, SpeedProtocol, describe, phase_label, time_phases
from moelab.engine.evaluation.kernel_gain import NAME as KERNEL_DENSE
from moelab.engine.models import load_model

QUICK = SpeedProtocol(repeats=3, decode_steps=4, context=8, batch=8, prefill_tokens=512)


class Slowed(nn.Module):
    """``inner`` that then waits as long again as each call took: exactly twice as slow in every phase."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, logits_to_keep=0, **kw):
        t0 = time.perf_counter()
        out = self.inner(logits_to_keep=logits_to_keep, **kw)
        time.sleep(time.perf_counter() - t0)
        return out


@pytest.fixture(scope="module")
def dense(tiny_model, data_dir):
    return load_model(str(tiny_model("llama")), data_dir=data_dir).model.eval()


def test_the_speedup_is_the_median_ratio_of_times_in_the_same_round(dense):
    tokens = torch.arange(5, 105)
    out = time_phases({"dense": dense, "slowed": Slowed(dense)}, tokens, protocol=QUICK)
    assert set(out["phases"]) == set(PHASES)
    for phase, entry in out["phases"].items():
        assert entry["speedup"]["dense"] == 1.0
        ratios = sorted(d / s for d, s in zip(entry["rounds"]["dense"], entry["rounds"]["slowed"]))
        assert len(ratios) == QUICK.repeats and entry["speedup"]["slowed"] == pytest.approx(ratios[len(ratios) // 2])
        assert entry["seconds"]["slowed"] == pytest.approx(sorted(entry["rounds"]["slowed"])[len(ratios) // 2])
        # twice the time (sleep overshoots a little); a loaded host (a CI beside it) stretched a dense round to 0.81x
        assert 0.15 < entry["speedup"]["slowed"] < 0.9, (phase, entry)
        rows = entry["batch"] * (entry["tokens"] or 1)
        assert entry["tokens_per_s"]["dense"] == pytest.approx(rows / entry["seconds"]["dense"])
    assert out["phases"]["decode_b8"]["batch"] == 8 and out["phases"]["decode_b1"]["batch"] == 1
    assert out["dtype"] == "float32" and out["threads"] == torch.get_num_threads() and out["device"].startswith("cpu")
    lines = [line for line in describe(out, "slowed") if "busy machine" not in line]  # a busy CI host may add one
    assert len(lines) == 4 and all("(slower)" in line for line in lines[1:]), lines
    assert "prefill of" in lines[3] and "median of 3 interleaved rounds" in lines[0]
    for line, entry in zip(lines[1:], out["phases"].values()):  # beside the median, the rounds' own ratios' range
        ratios = [d / s for d, s in zip(entry["rounds"]["dense"], entry["rounds"]["slowed"])]
        assert f"{entry['speedup']['slowed']:5.2f}× dense (rounds {min(ratios):.2f}–{max(ratios):.2f})" in line, line


def test_a_median_below_dense_says_whether_every_round_was():
    """The CLI's line: '(slower)' where every round was slower, '(slower in 2 of 3 rounds)' where one was not (the
    machine's drift, not the model), nothing at 1.0x or above."""
    def phase(dense: list[float], model: list[float]) -> dict:
        ratios = sorted(d / m for d, m in zip(dense, model))
        return {"seconds": {"dense": sorted(dense)[1], "m": sorted(model)[1]}, "speedup": {"dense": 1.0, "m": ratios[1]},
                "rounds": {"dense": dense, "m": model}, "batch": 1, "tokens": None}
    speed = {"reference": "dense", "protocol": {"repeats": 3}, "runtime": "PyTorch eager", "device": "cpu: x",
             "dtype": "float32", "threads": 2,
             "phases": {"decode_b1": phase([0.97, 0.98, 1.02], [1.0] * 3), "decode_b8": phase([0.9] * 3, [1.0] * 3),
                        "prefill": phase([1.0, 1.1, 1.2], [1.0] * 3)}}
    b1, b8, prefill = describe(speed)[1:]
    assert b1.endswith("0.98× dense (rounds 0.97–1.02)  (slower in 2 of 3 rounds)"), b1
    assert b8.endswith("0.90× dense (rounds 0.90–0.90)  (slower)"), b8
    assert prefill.endswith("1.10× dense (rounds 1.00–1.20)"), prefill


def test_a_prefill_computes_the_last_positions_logits_as_generation_does(dense):
    """Where a model's forward takes ``logits_to_keep``, the timed prefill asks for the last position only (the
    protocol says so); a forward without it computes every position's. Either returns the same last logits."""
    seen: list[tuple[int, int | None]] = []

    class Recorded(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids=None, logits_to_keep=None, **kw):
            out = self.inner(input_ids=input_ids, logits_to_keep=logits_to_keep or 0, **kw)
            if input_ids.shape[1] == 64:  # the timed prefill
                seen.append((out.logits.shape[1], logits_to_keep))
            return out

    class NoKeep(Recorded):
        def forward(self, input_ids=None, **kw):
            return super().forward(input_ids=input_ids, **kw)

    protocol = SpeedProtocol(repeats=1, decode_steps=2, context=8, prefill_tokens=64)
    out = time_phases({"dense": Recorded(dense), "plain": NoKeep(dense)}, torch.arange(5, 105), protocol=protocol)
    assert out["protocol"]["prefill_logits"] == out["phases"]["prefill"]["logits"] == "last"
    old = {k: v for k, v in out["phases"]["prefill"].items() if k != "logits"}  # a timing stored before the field
    assert phase_label("prefill", out["phases"]["prefill"]) == "prefill of 64 tokens"
    assert phase_label("prefill", old) == phase_label("prefill", {**old, "logits": "all"}) \
        == "prefill of 64 tokens, every position's logits"
    assert sorted(set(seen)) == [(1, 1), (64, None)]  # last position only where the forward takes it, else all 64
    ids = torch.arange(5, 69)[None]
    with torch.inference_mode():
        torch.testing.assert_close(dense(input_ids=ids, logits_to_keep=1).logits[:, -1], dense(input_ids=ids).logits[:, -1])


def test_inputs_fit_the_models_positions(dense):
    positions = dense.config.max_position_embeddings
    out = time_phases({"dense": dense}, torch.arange(5, 25), protocol=SpeedProtocol(repeats=1, decode_steps=2, prefill_tokens=10**6))
    assert out["phases"]["prefill"]["tokens"] == out["protocol"]["prefill_tokens"] == positions  # a short text repeated
    with pytest.raises(ValueError, match="not among"):
        time_phases({"dense": dense}, torch.arange(5, 25), reference="converted")
    with pytest.raises(ValueError, match=f"hold {positions} positions"):
        time_phases({"dense": dense}, torch.arange(5, 25), protocol=SpeedProtocol(decode_steps=positions))


def test_an_evaluation_times_its_converted_model_against_dense(tiny_model, data_dir, tmp_path_factory):
    from moelab.engine.runs import run_evaluation

    conversion = tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=4, alpha_max=0.5)
    report = run_evaluation(conversion, data_dir=data_dir, n_windows=2, seq_len=16, write=False, mc_per_task=0,
                            baselines=False, speed=QUICK)
    speed = report["speed"]
    assert speed["reference"] == "dense" and speed["protocol"]["decode_steps"] == 4
    # the record names the kernel the MoE layers ran: a machine without a C compiler decodes with torch's
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert speed["runtime"].endswith("+ moelab native CPU kernels") == bool(compiler), speed["runtime"]
    # beside them the dense model in moelab's kernels (evaluation.kernel_dense), where they are built
    timed = {"dense", "converted", *([KERNEL_DENSE] if compiler else [])}
    for entry in speed["phases"].values():
        assert set(entry["seconds"]) == timed and all(s > 0 for s in entry["seconds"].values())
    assert ("kernel_dense_note" in speed) != bool(compiler)
    assert "speed" not in run_evaluation(conversion, data_dir=data_dir, n_windows=2, seq_len=16, write=False, mc_per_task=0,
                                         baselines=False, speed=None)
    assert "old_runtime" not in speed  # written by this moelab: its runtime is the current one


def test_an_evaluation_says_when_the_conversion_carries_an_older_runtime(tiny_model, data_dir, tmp_path_factory):
    """An export runs the runtime it was written with: one whose runtime differs from this moelab's is timed as written
    and the evaluation's speed says so, naming the command that writes it with the current runtime; that command's output
    carries the current runtime and the note goes."""
    from moelab.engine.runs import run_evaluation
    from moelab.engine.runtime.export import runtime_is_current

    conversion = tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=4, alpha_max=0.5)
    assert runtime_is_current(conversion)
    with open(conversion / "moelab_linear.py", "a") as f:
        f.write("# as written by another moelab\n")
    assert not runtime_is_current(conversion)
    report = run_evaluation(conversion, data_dir=data_dir, n_windows=2, seq_len=16, write=False, mc_per_task=0,
                            baselines=False, speed=QUICK)
    note = report["speed"]["old_runtime"]
    assert f"moelab export {conversion} --format moelab --out NEW" in note and "timed with it" in note
    assert f"  {note}" in describe(report["speed"])  # what `moelab evaluate` prints
    out = conversion.parent / "current"
    done = subprocess.run([sys.executable, "-m", "moelab.cli", "export", str(conversion), "--format", "moelab", "--out",
                           str(out)], capture_output=True, text=True, env={**os.environ, "MOELAB_DATA_DIR": str(data_dir)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert runtime_is_current(out)


def test_a_timed_decode_step_continues_from_its_cache(dense, tiny_model, data_dir, tmp_path_factory):
    """The step timed is a real cached step: its logits are the full forward's at that position (were the cache
    dropped, the step would be a cheap one-token forward and the decode times would mean nothing)."""
    from moelab.engine.evaluation.speed import _cache
    from moelab.engine.runtime.export import load_exported

    conversion = tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=4, alpha_max=0.5)
    ids = torch.arange(5, 14)[None]
    for model in (dense, load_exported(conversion).eval()):
        with torch.inference_mode():
            first = model(input_ids=ids[:, :8], use_cache=True)
            step = model(input_ids=ids[:, 8:], cache=_cache(first), use_cache=True)
            whole = model(input_ids=ids)
        torch.testing.assert_close(step.logits[:, -1], whole.logits[:, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 8])
def test_the_static_cache_steps_a_cuda_graph_captures_choose_the_eager_loops_tokens(dense, tiny_model, data_dir,
                                                                                     tmp_path_factory, batch):
    """``_StaticCacheDecode``'s step (a ``StaticCache`` whose filled length the model reads and advances on the device,
    the token read from and written to one tensor) is what a CUDA graph captures; run here without a graph, it picks
    the tokens the eager loop on a dynamic cache picks, step after step, for the dense model and for a converted one
    loaded from its export (``MoelabForCausalLM``)."""
    from moelab.engine.evaluation.speed import _EagerDecode, _StaticCacheDecode
    from moelab.engine.runtime.export import load_exported

    conversion = tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=4, alpha_max=0.5)
    context = torch.arange(5, 5 + 8 * batch).reshape(batch, 8)
    for model in (dense, load_exported(conversion).eval()):
        with torch.inference_mode():
            eager, static = _EagerDecode(model, context, 6), _StaticCacheDecode(model, context, 6, graph=False)
            assert torch.equal(eager.token, static.token)
            for _ in range(6):
                eager.step()
                static.step()
                assert torch.equal(eager.token, static.token), type(model).__name__


def test_cpu_timing_says_nothing_of_cuda_graphs(dense):
    out = time_phases({"dense": dense}, torch.arange(5, 25), protocol=SpeedProtocol(repeats=1, decode_steps=2, prefill_tokens=16))
    assert "CUDA graphs" not in out["runtime"] and all("cuda_graphs" not in e for e in out["phases"].values())
    assert out["protocol"]["cuda_graphs"] is True  # asked for; they apply on a CUDA device only


def test_a_timing_beside_a_busy_process_records_its_cpu_share_and_says_so(dense):
    """Every ratio assumes the models had the cores to themselves: a timing beside another busy process records the
    share of the CPUs it took (one spinning process on this 2-core machine: about half) and ``describe`` warns."""
    quick = SpeedProtocol(repeats=1, decode_steps=4, context=8, batch=8, prefill_tokens=64)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        out = time_phases({"dense": dense, "slowed": Slowed(dense)}, torch.arange(5, 105), protocol=quick)
    finally:
        spinner.kill()
        spinner.wait()
    share = out["others_cpu_share"]
    cpus = os.cpu_count() or 1
    assert 0.5 / cpus <= share <= 1.0, share  # one process spinning on one of the CPUs (and whatever else ran)
    lines = describe(out, "slowed")
    assert lines[1].startswith(f"  timed on a busy machine: other processes took {share:.0%} of the CPUs"), lines
