"""Progress that moves: the stages a tiny-model evaluation reports, in order — loading, baselines
(their clustering named as the baselines'), held-out text, one stage per variant, reconstruction —
never a conversion's bare 'cluster experts' and never a stage left without its end."""

from __future__ import annotations

import pytest

from tests.engine.conftest import tiny_conversion
from moelab.engine.progress import Cancelled, Progress
from moelab.engine.runs import run_evaluation


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, stage: str, current: int, total: int) -> None:
        self.calls.append((stage, current, total))

    def stages(self) -> list[str]:
        """Stage names in order, consecutive repeats merged."""
        out: list[str] = []
        for stage, _, _ in self.calls:
            if not out or out[-1] != stage:
                out.append(stage)
        return out


@pytest.fixture(scope="module")
def conversion(tiny_model, data_dir, tmp_path_factory):
    return tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=4, alpha_min=0.2, alpha_max=0.7)


def test_step_and_within():
    rec = Recorder()
    p = Progress(callback=rec)
    with p.step("load"):
        p.within("baselines").update("cluster experts", 1, 3)
    assert rec.calls == [("load", 0, 1), ("baselines: cluster experts", 1, 3), ("load", 1, 1)]
    stop = Progress(callback=rec, should_cancel=lambda: True)
    with pytest.raises(Cancelled, match="baselines: cluster experts"):  # a prefixed step still stops the job
        stop.within("baselines").update("cluster experts", 0, 3)


def test_evaluation_reports_real_stages_in_order(conversion, data_dir):
    import shutil

    from moelab.engine.evaluation import reference_scores

    shutil.rmtree(data_dir / reference_scores.DIR, ignore_errors=True)  # the dense model is scored, not reused
    rec = Recorder()
    report = run_evaluation(conversion, data_dir=data_dir, n_windows=2, seq_len=16, progress=Progress(callback=rec),
                            write=False, mc_per_task=0)
    variants = list(report["results"])
    assert variants[:3] == ["dense", "converted", "abstopk"] and variants[-1] == "teal"
    expected = ["load converted model", "load model", "build baselines"]
    if "uniform" in variants:  # EW's uniform-α baseline clusters experts: named as the baselines' step
        expected += ["baselines: cluster experts", "build baselines"]
    # TEAL at the conversion's cost: a calibration forward pass, then its thresholds layer by layer
    expected += ["baselines: teal: fit: calibration forward", "baselines: teal: thresholds", "build baselines"]
    expected += ["read held-out text", *[f"evaluate {v}" for v in variants], "reconstruction error", "time dense and converted"]
    assert rec.stages() == expected, rec.stages()
    last = {}
    for stage, current, total in rec.calls:
        last[stage] = (current, total)
    assert all(c == t for c, t in last.values()), last  # every stage reaches its end
    assert "cluster experts" not in rec.stages()

    # A second evaluation on the same text reuses the dense model's perplexity instead of running it.
    again = Recorder()
    second = run_evaluation(conversion, data_dir=data_dir, n_windows=2, seq_len=16, progress=Progress(callback=again),
                            write=False, mc_per_task=0, baselines=False)
    assert "evaluate dense" not in again.stages() and "evaluate converted" in again.stages()
    dense, first = second["results"]["dense"], report["results"]["dense"]
    assert dense["perplexity"] == first["perplexity"] and dense["tokens_per_s"] is None and "reused" in dense
    assert second["results"]["converted"]["perplexity"] == pytest.approx(report["results"]["converted"]["perplexity"], rel=1e-6)
    assert second["results"]["converted"]["perplexity_ratio"] == pytest.approx(report["results"]["converted"]["perplexity_ratio"], rel=1e-6)
    # Other text: the dense model runs again.
    third = Recorder()
    run_evaluation(conversion, data_dir=data_dir, n_windows=3, seq_len=16, progress=Progress(callback=third),
                   write=False, mc_per_task=0, baselines=False)
    assert "evaluate dense" in third.stages()


def test_finetune_reports_loading_and_setup_before_training(conversion, data_dir, tmp_path):
    from moelab.engine.training.finetune import FinetuneParams, run_finetune

    rec = Recorder()
    params = FinetuneParams(mode="expertweaver", steps=2, batch_size=1, seq_len=16, eval_windows=1, checkpoint_every=100)
    run_finetune(conversion, params, tmp_path / "ft", data_dir=data_dir, device="cpu", progress=Progress(callback=rec))
    stages = rec.stages()
    assert stages[:3] == ["load converted model", "read training and held-out text", "perplexity before"], stages
    assert stages.index("set up expertweaver training") < stages.index("train") < stages.index("export"), stages


def test_a_finetunes_peak_memory_is_its_own_not_the_processs(conversion, data_dir, tmp_path):
    """A worker runs many jobs in one process: a fine-tune after a job that peaked 1.5 GiB higher reports its own
    peak (ru_maxrss would report the earlier job's)."""
    import resource

    import numpy as np

    from moelab.engine.training.finetune import FinetuneParams, run_finetune

    earlier = np.ones(1536 << 17)  # 1.5 GiB of float64, every page touched
    del earlier
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = FinetuneParams(mode="expertweaver", steps=1, batch_size=1, seq_len=16, eval_windows=1, checkpoint_every=100)
    summary = run_finetune(conversion, params, tmp_path / "ft", data_dir=data_dir, device="cpu")
    assert summary["peak_rss_mib"] < process_peak - 1024, (summary["peak_rss_mib"], process_peak)
