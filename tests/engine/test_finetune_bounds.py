"""A fine-tune step is bounded in tokens: a step of batch_size × seq_len tokens beyond STEP_TOKENS runs as
micro-batches (gradients accumulated, the same update up to rounding) with a cancellation check between
them; a LoRA rank above the model's d_model and sequences beyond its positions are refused up front."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.conftest import tiny_conversion
from moelab.engine.progress import Cancelled, Progress
from moelab.engine.training import finetune as ft
from moelab.engine.training.finetune import FinetuneError, FinetuneParams, read_train_log, run_finetune

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def conv(tiny_model, data_dir, tmp_path_factory):
    return tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=8, alpha_max=0.5)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("ftb-text") / "train.jsonl"
    line = "the cat sat on the mat and the dog sat on the log. "
    path.write_text("".join(json.dumps({"text": line * 6}) + "\n" for _ in range(12)))
    return str(path)


def _params(text: str, **kw) -> FinetuneParams:
    base = dict(mode="expertweaver", steps=2, batch_size=4, seq_len=32, lr=1e-2, router_lr=1e-2, lora_rank=4, lora_alpha=8.0,
                lb_coef=0.0, checkpoint_every=100, source=text, eval_source="builtin:mixed", eval_windows=1)
    return FinetuneParams(**{**base, **kw})


def test_large_steps_run_as_bounded_micro_batches(conv, text, data_dir, tmp_path, monkeypatch):
    params = _params(text)
    whole = run_finetune(conv, params, tmp_path / "whole", data_dir=data_dir, device="cpu")

    monkeypatch.setattr(ft, "STEP_TOKENS", 64)  # 4 windows × 32 tokens → two micro-batches of 2
    seen: list[int] = []
    original = ft.load_conversion_for_training

    def load(*a, **kw):
        model = original(*a, **kw)
        model.get_input_embeddings().register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].numel()) if torch.is_grad_enabled() else None)
        return model

    monkeypatch.setattr(ft, "load_conversion_for_training", load)
    train_updates: list[int] = []
    split = run_finetune(conv, params, tmp_path / "split", data_dir=data_dir, device="cpu",
                         progress=Progress(callback=lambda s, c, t: train_updates.append(c) if s == "train" else None))
    # forwards with gradients: the set-up's check of which parameters train (one window), then 2 micro-batches a step
    assert max(seen) <= 64 and seen[-2 * params.steps:] == [64] * (2 * params.steps), seen
    assert train_updates == [0, 0, 1, 1, 2], "a cancellation check between the micro-batches of each step"
    a, b = read_train_log(tmp_path / "whole"), read_train_log(tmp_path / "split")
    for x, y in zip(a["steps"], b["steps"]):
        assert y["ntp_loss"] == pytest.approx(x["ntp_loss"], rel=1e-4)
        assert y["tokens"] == x["tokens"]
    wa, wb = load_file(str(tmp_path / "whole" / "model" / "model.safetensors")), load_file(str(tmp_path / "split" / "model" / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-4, rtol=1e-3) for k in wa)
    assert split["perplexity_after"] == pytest.approx(whole["perplexity_after"], rel=1e-3)


def test_cancel_lands_between_micro_batches(conv, text, data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ft, "STEP_TOKENS", 32)  # one window a forward: four forwards a step
    calls = {"train": 0}

    def callback(stage, current, total):
        if stage == "train":
            calls["train"] += 1

    progress = Progress(callback=callback, should_cancel=lambda: calls["train"] >= 2)  # asked during step 1's first forward
    with pytest.raises(Cancelled):
        run_finetune(conv, _params(text, steps=1), tmp_path / "run", data_dir=data_dir, device="cpu", progress=progress)
    assert read_train_log(tmp_path / "run")["steps"] == []  # stopped inside step 1, before it completed
    assert calls["train"] == 2


@pytest.mark.parametrize("kw, words", [({"lora_rank": 65}, "lora_rank 65 exceeds d_model (64)"),
                                       ({"seq_len": 1024}, "max_position_embeddings (512)")])
def test_refused_for_the_model_before_anything_runs(conv, text, data_dir, tmp_path, kw, words):
    with pytest.raises(FinetuneError, match=words.replace("(", r"\(").replace(")", r"\)")):
        run_finetune(conv, _params(text, **kw), tmp_path / "run", data_dir=data_dir, device="cpu")
    assert not (tmp_path / "run").exists()
    _params(text, lora_rank=64).validate_for(json.loads((conv / "config.json").read_text()))  # = d_model is allowed
