"""Recovery fine-tuning (CM §3.3, EW Eqs. 11-12, MI Alg. 1, D2 §2) on tiny random-weight models.

Conversions are made once per module from a tiny profiled Llama; every run trains a few steps
on a short, repetitive text (learnable in a few steps) and measures perplexity on two held-out
windows, so the whole file stays fast.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.test_profiling import make_set
from moelab.engine.training.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, restore, save_checkpoint
from moelab.engine.methods.cmoe import CMoEParams
from moelab.engine.methods.expertweaver import EW_INIT_LOGIT_STD, ExpertWeaverParams
from moelab.engine.methods.dense2moe import Dense2MoEParams
from moelab.engine.runtime.export import load_exported
from moelab.engine.training.finetune import (
    FinetuneError, FinetuneParams, RoutingTap, apply_mode, distillation_loss, load_balancing_loss,
    load_conversion_for_training, merge_adapters, read_train_log, run_finetune,
    lr_factor, update_router_bias, window_indices,
)
from moelab.engine.core.router_init import to_softmax_router
from moelab.engine.core.slicing import expert_rows, moe_from_dense
from moelab.engine.methods.midas import MidasParams
from moelab.engine.runtime.modeling_moelab import MoeFFN
from moelab.engine.models import load_model
from moelab.engine.profiling.store import write_profile
from moelab.engine.profiling.profiler import ProfileSettings, profile_model
from moelab.engine.progress import Cancelled, Progress
from moelab.engine.runs import run_conversion

CPU = torch.device("cpu")
IDS = torch.tensor([[1, 17, 256, 999, 42, 5, 77, 3001, 12, 640, 8, 91, 2048, 33, 7, 400]])


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def convs(tiny_model, data_dir, tmp_path_factory):
    """Exported tiny conversions: cmoe (representative router), expertweaver (centroid),
    dense2moe (layers 0+1 fused, softmax router) and midas (two calibration sets)."""
    root = tmp_path_factory.mktemp("ft-convs")
    model_dir = tiny_model("llama")
    adapter = load_model(str(model_dir), data_dir=data_dir)
    cset = make_set(n=24, tasks=4, seed=5)
    res = profile_model(adapter, cset, ProfileSettings(max_tokens=48, batch_tokens=192, atopk_k=8))
    prof = write_profile(res, cset, root / "prof")
    cset2 = make_set(n=24, tasks=3, seed=6)
    res2 = profile_model(adapter, cset2, ProfileSettings(max_tokens=48, batch_tokens=192, atopk_k=8))
    prof2 = write_profile(res2, cset2, root / "prof2")
    out = {}
    plans = {
        "cmoe": CMoEParams(shared=2, active=2, n_experts=8),
        "expertweaver": ExpertWeaverParams(n_experts=8, sparsity=0.25, alpha_min=0.2, alpha_max=0.5, tau=0.3),
        "dense2moe": Dense2MoEParams(layer=0, n_fused=1, own_copies=2, fused_copies=1, top_k=1),
    }
    for name, params in plans.items():
        run_conversion(prof, params, root / name, data_dir=data_dir)
        out[name] = root / name
    run_conversion(prof, MidasParams(keep_ratio=0.5, top_k=1, surrogate_samples=256), root / "midas", data_dir=data_dir, extra_profiles=[prof2])
    out["midas"] = root / "midas"
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A short repetitive training text: a few steps visibly lower its loss."""
    path = tmp_path_factory.mktemp("ft-text") / "train.jsonl"
    line = "the cat sat on the mat and the dog sat on the log. "
    path.write_text("".join(json.dumps({"text": line * 6}) + "\n" for _ in range(12)))
    return str(path)


def quick(mode: str, source: str, **kw) -> FinetuneParams:
    base = dict(mode=mode, steps=4, batch_size=2, seq_len=32, lr=1e-2, router_lr=1e-2, lora_rank=4,
                lora_alpha=8.0, checkpoint_every=100, source=source, eval_source="builtin:mixed", eval_windows=2)
    return FinetuneParams(**{**base, **kw})


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("change, words", [
    ({"mode": "adam"}, "mode"), ({"steps": 0}, "steps"), ({"lr": 0.0}, "lr"), ({"router_lr": float("nan")}, "router_lr"),
    ({"lb_coef": -1.0}, "lb_coef"), ({"seq_len": 4}, "seq_len"), ({"lora_rank": 0}, "lora_rank"),
    ({"source": "  "}, "source"), ({"source": "/data/set", "eval_source": "/data/other"}, "eval_source"),
    ({"checkpoint_every": 0}, "checkpoint_every"), ({"batch_size": 2.5}, "batch_size"),
    ({"warmup": 1.0}, "warmup"), ({"router_first": -0.1}, "router_first"), ({"distill": 1.5}, "distill"),
])
def test_bad_params_say_what_to_fix(change, words):
    with pytest.raises(FinetuneError, match=words):
        FinetuneParams(**change).validate()


def test_schedule_warms_up_then_decays_and_adapters_can_wait_for_the_routers():
    steps = 100
    f = [lr_factor(s, steps, warmup=0.1) for s in range(steps)]
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)]) and f[9] == 1.0
    assert f[-1] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in zip(f[10:], f[11:]))
    late = [lr_factor(s, steps, warmup=0.1, start=25) for s in range(steps)]
    assert late[:25] == [0.0] * 25 and late[25] == pytest.approx(1 / 8) and late[-1] == pytest.approx(0.1, abs=1e-3)


def test_params_round_trip_and_unknown_keys():
    p = FinetuneParams(mode="expertweaver", steps=7, lb_coef=0.02, eval_source="builtin:code")
    p.validate()
    assert FinetuneParams.from_dict(p.to_dict()) == p
    assert FinetuneParams(mode="cmoe", lb_coef=0.5).lb_used == 0.0  # CMoE balances with b instead
    FinetuneParams(mode="expertweaver", lora_rank=0).validate()  # router-only EW is allowed
    assert FinetuneParams(source="/data/set").heldout_source() == "builtin:mixed"  # stored sets have no held-out split
    assert FinetuneParams(source="builtin:code").heldout_source() == "builtin:code"
    with pytest.raises(FinetuneError, match="unknown fine-tuning parameters"):
        FinetuneParams.from_dict({**p.to_dict(), "epochs": 3})


# ----------------------------------------------------------------------------- equations


def test_load_balancing_loss_is_eq12_on_a_hand_example():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    selected = torch.tensor([[0, 1], [1, 2]])
    # f = (1/4, 2/4, 1/4) of the four selections; P = column means (0.4, 0.4, 0.2)
    expected = 3 * (0.25 * 0.4 + 0.5 * 0.4 + 0.25 * 0.2)
    assert float(load_balancing_loss(probs, selected, 3)) == pytest.approx(expected, rel=1e-6)
    uniform = torch.full((4, 4), 0.25)
    assert float(load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [3]]), 4)) == pytest.approx(1.0)
    p = probs.clone().requires_grad_(True)
    load_balancing_loss(p, selected, 3).backward()  # the gradient reaches P only: 3·f_i/T
    torch.testing.assert_close(p.grad, torch.tensor([[0.375, 0.75, 0.375]] * 2))


def test_distillation_loss_is_the_kl_from_the_dense_distribution_per_position():
    student = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]])
    teacher = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]]])
    # position 1: KL(p_t ‖ p_s) with p_t, p_s mirror images: Σ p_t log p_t − Σ p_t log p_s
    pt = torch.softmax(teacher[0, 1], -1)
    kl1 = float((pt * (pt.log() - torch.log_softmax(student[0, 1], -1))).sum())
    assert kl1 > 0.5
    assert float(distillation_loss(student, teacher)) == pytest.approx(kl1 / 2, rel=1e-6), "mean over the 2 positions"
    assert float(distillation_loss(teacher + 3.0, teacher)) == pytest.approx(0.0, abs=1e-6), "logits are shift-invariant"
    assert float(distillation_loss(student, student)) == pytest.approx(0.0, abs=1e-7)


def test_bias_update_direction():
    b = torch.zeros(4)
    update_router_bias(b, torch.tensor([6, 2, 3, 1]), 1e-3)  # p = .5 .17 .25 .08 vs p* = .25
    assert b.tolist() == pytest.approx([-1e-3, 1e-3, 0.0, 1e-3])
    update_router_bias(b, torch.tensor([5, 5, 5, 5]), 1e-3)  # balanced: unchanged
    assert b.tolist() == pytest.approx([-1e-3, 1e-3, 0.0, 1e-3])


def random_moe(router: str, combine: str = "sum", seed: int = 0) -> MoeFFN:
    g = torch.Generator().manual_seed(seed)
    d, f = 32, 48
    w = [torch.randn(f, d, generator=g) * 0.2, torch.randn(f, d, generator=g) * 0.2, torch.randn(d, f, generator=g) * 0.2]
    routed = torch.arange(8, 48).reshape(8, 5)
    return moe_from_dense(*w, "silu", torch.arange(8), routed, top_k=3, router=router, combine=combine)


@pytest.mark.parametrize("router", ["representative", "centroid", "gate_mass"])
def test_scaled_combine_with_zero_u_and_b_is_the_sum_model(router):
    mod = random_moe(router)
    x = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(1))
    picks = {}
    mod.recorder = lambda idx: picks.__setitem__("sum", idx.sort(-1).values)
    ref = mod(x)
    mod.use_scaled_combine()
    mod.recorder = lambda idx: picks.__setitem__("scaled", idx.sort(-1).values)
    assert mod.spec["combine"] == "scaled" and float(mod.router_scale.abs().sum()) == 0
    assert torch.equal(mod(x), ref), "CM §3.3: u = b = 0 must not perturb the training-free model"
    assert torch.equal(picks["sum"], picks["scaled"])
    # b shifts the selection (TopK(s' + b)); u scales the selected experts (1 + s'·u)
    with torch.no_grad():
        mod.router_bias[5] = 2.0
    mod(x)
    assert bool((picks["scaled"] == 5).any(-1).all()), "a large b_5 puts expert 5 in every token's top-k"
    with torch.no_grad():
        mod.router_bias.zero_()
        mod.router_scale.fill_(0.5)
    assert not torch.allclose(mod(x), ref)
    # the spec rebuilds the module, u and b included
    again = MoeFFN(mod.spec)
    again.load_state_dict(mod.state_dict())
    assert torch.equal(again(x), mod(x)) and "router_bias" in mod.state_dict()


def test_ew_router_init_keeps_topk_and_starts_near_the_sum_model():
    mod = random_moe("centroid")
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(2))
    z = x @ mod.router_weight.detach().t()
    beta = EW_INIT_LOGIT_STD / float(z.std(-1).mean())
    new = to_softmax_router(mod, beta)
    assert (new.router.kind, new.combine) == ("softmax", "weighted")
    picks = []
    for m in (mod, new):
        m.recorder = lambda idx: picks.append(idx.sort(-1).values)
        m(x)
    assert torch.equal(picks[0], picks[1]), "β > 0 keeps the TopK order of the centroid router"
    gates = new.n_routed * torch.softmax(x @ new.router_weight.detach().t(), -1)
    assert 0.7 < float(gates.min()) and float(gates.max()) < 1.4  # N_e·softmax(β z) ≈ 1
    rel = float((new(x) - mod(x)).norm() / mod(x).norm())
    assert rel < 0.1


def test_window_order_is_a_seeded_permutation_per_epoch():
    order = [int(i) for c in range(0, 10, 2) for i in window_indices(c, 2, 5, seed=3)]
    assert sorted(order[:5]) == list(range(5)) and sorted(order[5:]) == list(range(5))
    assert order == [int(i) for c in range(0, 10, 5) for i in window_indices(c, 5, 5, seed=3)], "batch size does not matter"
    assert order[:5] != order[5:], "each epoch is reshuffled"


# ----------------------------------------------------------------------------- modes


def test_mode_parameter_selection(convs):
    x = IDS[:, :8]
    moe = load_conversion_for_training(convs["cmoe"], CPU)
    ref = logits(moe)
    setup = apply_mode(moe, quick("cmoe", "builtin:mixed"), x)
    names = trainable(setup.model)
    assert names and all("lora_" in n or n.endswith("router_scale") for n in names)
    assert sum(n.endswith("router_scale") for n in names) == 3  # u of every layer; router weights frozen
    assert any(".self_attn.q_proj.lora_A" in n for n in names) and any("shared_gate.lora_A" in n for n in names)
    assert any(".mlp.experts." in n and n.endswith("lora_A.default.weight") for n in names), \
        "routed experts (3-D gate_up_proj/down_proj of the experts module) get LoRA too"
    assert len(setup.buffers) == 3 and all(k.endswith("router_bias") for k in setup.buffers)
    # u = b = 0 and LoRA B = 0: the model is unchanged, up to float rounding: W + 0 of the stacked down
    # projections is a contiguous tensor, not the runtime's decode layout, so BLAS sums in another order
    assert torch.allclose(logits(setup.model), ref, rtol=0, atol=1e-5), "u = b = 0 and LoRA B = 0: the model is unchanged"

    moe = load_conversion_for_training(convs["expertweaver"], CPU)
    setup = apply_mode(moe, quick("expertweaver", "builtin:mixed"), x)
    names = trainable(setup.model)
    assert all("lora_" in n or n.endswith("router_weight") for n in names)
    assert sum(n.endswith("router_weight") for n in names) == len(setup.modules)
    assert all((m.router.kind, m.combine) == ("softmax", "weighted") for m in setup.modules.values())
    assert setup.changes_function

    moe = load_conversion_for_training(convs["dense2moe"], CPU)
    ref = logits(moe)
    setup = apply_mode(moe, quick("dense2moe", "builtin:mixed"), x)
    assert setup.model is moe, "dense2moe trains routers only: no adapters"
    assert trainable(moe) == {f"model.model.layers.{i}.mlp.{n}" for i in setup.modules for n in ("router_weight", "router_scale")}
    assert {m.combine for m in setup.modules.values()} == {"scaled"} and not setup.buffers, "b stays 0: D2 has no bias"
    torch.testing.assert_close(logits(moe), ref, rtol=0, atol=1e-5)  # the switch keeps the training-free function

    moe = load_conversion_for_training(convs["midas"], CPU)
    ref = logits(moe)
    setup = apply_mode(moe, quick("midas", "builtin:mixed"), x)
    names = trainable(setup.model)
    assert sum(n.endswith("router.weight") for n in names) == 3, "the gating network G of every layer"
    assert all("lora_" in n or n.endswith("router.weight") for n in names)
    assert any(".self_attn.v_proj.lora_B" in n for n in names)
    stacked = setup.notes["lora_targets"]["stacked_parameters"]
    assert stacked == 3 * 6, "MI Alg. 1 line 15: LoRA on the six factors of every layer's experts"
    assert torch.equal(logits(setup.model), ref)

    with pytest.raises(FinetuneError, match="lowrank_moe"):
        apply_mode(load_conversion_for_training(convs["cmoe"], CPU), quick("midas", "builtin:mixed"), x)
    with pytest.raises(FinetuneError, match="kind 'moe'"):
        apply_mode(load_conversion_for_training(convs["midas"], CPU), quick("cmoe", "builtin:mixed"), x)


def test_dense2moe_refuses_to_train_nothing_and_counts_what_trains(convs, monkeypatch):
    """Without the scaled-combine switch a 'sum' router only ranks: with λ = 0 no gradient reaches
    anything, and the run is refused; with λ > 0 only Eq. 12 reaches W_g, and only W_g is counted."""
    import dataclasses

    from moelab.engine.methods import REGISTRY

    method = REGISTRY["dense2moe"]
    monkeypatch.setitem(REGISTRY, "dense2moe", dataclasses.replace(
        method, recovery=dataclasses.replace(method.recovery, prepare=None, router_params=None)))
    x = IDS[:, :8]
    with pytest.raises(FinetuneError, match=r"no trainable parameter receives a gradient.*combine 'sum', top-1 of 3 experts"):
        apply_mode(load_conversion_for_training(convs["dense2moe"], CPU), quick("dense2moe", "builtin:mixed", lb_coef=0.0), x)
    moe = load_conversion_for_training(convs["dense2moe"], CPU)
    setup = apply_mode(moe, quick("dense2moe", "builtin:mixed", lb_coef=0.01), x)
    assert [n for n, _ in setup.trainable().items()] == ["model.model.layers.0.mlp.router_weight"]
    assert setup.notes.get("no_gradient") is None


def test_lb_loss_reaches_the_router(convs):
    moe = load_conversion_for_training(convs["expertweaver"], CPU)
    setup = apply_mode(moe, quick("expertweaver", "builtin:mixed", lora_rank=0), IDS)
    tap = RoutingTap(setup.modules, with_lb=True)
    setup.model(input_ids=IDS, use_cache=False)
    aux = tap.aux_loss()
    assert aux is not None and len(tap.terms) == len(tap.modules)
    assert abs(float(aux) - 1.0) < 0.1, "near-uniform initial probabilities (β-scaled router): L_LB ≈ Σ f_i = 1"
    aux.backward()
    w = next(iter(setup.modules.values())).router_weight
    assert w.grad is not None and float(w.grad.abs().sum()) > 0
    tap.close()
    assert all(m.recorder is None for m in setup.modules.values())


# ----------------------------------------------------------------------------- runs


def cancel_after(step: int) -> Progress:
    """Cancel requested when ``step`` is reported, honoured at the next report (step + 1)."""
    seen = {"stop": False}

    def callback(stage, current, total):
        if stage == "train" and current >= step:
            seen["stop"] = True

    return Progress(callback=callback, should_cancel=lambda: seen["stop"])


@pytest.fixture(scope="module")
def cmoe_run(convs, text, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ft-run") / "full"
    params = quick("cmoe", text, steps=6)
    summary = run_finetune(convs["cmoe"], params, out, data_dir=data_dir, device="cpu")
    return params, out, summary


def test_training_lowers_the_loss_and_reports(cmoe_run):
    params, out, summary = cmoe_run
    log = read_train_log(out)
    losses = [s["ntp_loss"] for s in log["steps"]]
    assert [s["step"] for s in log["steps"]] == list(range(1, 7)) and log["status"] == "done"
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    assert log["steps"][-1]["tokens"] == 6 * 2 * 32 == summary["tokens"]
    assert all(s["aux_loss"] is None for s in log["steps"]), "cmoe balances with b, not Eq. 12"
    assert summary["perplexity_start"] == summary["perplexity_before"]
    for key in ("perplexity_before", "perplexity_after", "dense_perplexity", "peak_rss_mib", "train_s"):
        assert math.isfinite(summary[key]) and summary[key] > 0
    assert json.loads((out / "finetune.json").read_text()) == summary
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [6]
    biases = [t for k, t in load_checkpoint(out / "checkpoints" / "step-000006").tensors.items() if k.endswith("router_bias")]
    assert len(biases) == 3 and any(float(b.abs().sum()) > 0 for b in biases), "b moved by ±γ"


def test_export_reloads_with_the_trained_logits(cmoe_run, convs):
    params, out, summary = cmoe_run
    record = json.loads((out / "model" / "conversion.json").read_text())
    assert record["finetune"]["params"] == params.to_dict() and record["finetune"]["steps"] == 6
    assert record["finetune"]["perplexity_after"] == summary["perplexity_after"]
    assert record["summary"]["total_params"] == summary["total_params"]
    # the in-memory trained model: the conversion, the mode, the final checkpoint, merged
    moe = load_conversion_for_training(convs["cmoe"], CPU)
    setup = apply_mode(moe, params, IDS)
    ckpt = load_checkpoint(out / "checkpoints" / "step-000006")
    with torch.no_grad():
        for name, t in setup.state_tensors().items():
            t.copy_(ckpt.tensors[name])
    trained = logits(setup.model)
    merged = merge_adapters(setup)
    assert torch.allclose(logits(merged), trained, atol=1e-5)
    reloaded = load_exported(out / "model")
    assert all(m.spec["combine"] == "scaled" for m in reloaded.moe_modules().values())
    assert torch.equal(logits(reloaded), logits(merged))


def test_cancel_then_resume_equals_an_uninterrupted_run(cmoe_run, convs, data_dir, tmp_path_factory):
    params, full, _ = cmoe_run
    out = tmp_path_factory.mktemp("ft-resume") / "run"
    with pytest.raises(Cancelled):
        run_finetune(convs["cmoe"], params, out, data_dir=data_dir, device="cpu", progress=cancel_after(3))
    log = read_train_log(out)
    assert log["status"] == "cancelled" and len(log["steps"]) == 4
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [4], "the last completed step is saved"
    assert not (out / "model").exists()
    with pytest.raises(FinetuneError, match="other parameters"):
        run_finetune(convs["cmoe"], quick("cmoe", params.source, steps=7), out, data_dir=data_dir, device="cpu")
    state = out / "checkpoints" / "step-000004" / "state.json"  # written before ``distill`` existed: its default
    old = json.loads(state.read_text())
    old["params"].pop("distill")
    state.write_text(json.dumps(old))
    summary = run_finetune(convs["cmoe"], params, out, data_dir=data_dir, device="cpu")
    a, b = read_train_log(full), read_train_log(out)
    assert [s["loss"] for s in b["steps"]] == [s["loss"] for s in a["steps"]], "bit-identical losses"
    assert b["resumed_at"] == [4]
    wa, wb = load_file(str(full / "model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert summary["perplexity_after"] == a["perplexity_after"]


def test_distillation_keeps_the_conversion_near_the_dense_model(cmoe_run, convs, data_dir, tiny_model, tmp_path_factory):
    """distill = 1: the loss is L_KD alone (logged beside L_NTP), and the run stays near the dense model where the same
    run on L_NTP alone (``cmoe_run``: same text, steps and rates) drifts toward its repetitive training text; measured
    by the KL to the dense model on ids neither run saw. distill = 0.5 mixes the two terms."""
    params, plain, _ = cmoe_run
    root = tmp_path_factory.mktemp("ft-distill")
    run_finetune(convs["cmoe"], quick("cmoe", params.source, steps=6, distill=1.0), root / "kd", data_dir=data_dir,
                 device="cpu")
    steps = read_train_log(root / "kd")["steps"]
    assert all(s["loss"] == pytest.approx(s["kd_loss"], rel=1e-6) and math.isfinite(s["ntp_loss"]) for s in steps)
    assert all(s["kd_loss"] is None for s in read_train_log(plain)["steps"])
    dense = logits(load_model(str(tiny_model("llama")), data_dir=data_dir).model)
    kl = {run: float(distillation_loss(logits(load_exported(out / "model")), dense)) for run, out in
          (("kd", root / "kd"), ("ntp", plain))}
    assert kl["kd"] < 0.5 * kl["ntp"], kl

    run_finetune(convs["cmoe"], quick("cmoe", params.source, steps=2, distill=0.5), root / "mix", data_dir=data_dir,
                 device="cpu")
    for s in read_train_log(root / "mix")["steps"]:
        assert s["loss"] == pytest.approx(0.5 * s["ntp_loss"] + 0.5 * s["kd_loss"], rel=1e-5)


def test_distillation_needs_the_dense_model_the_record_names(convs, text, data_dir, tmp_path):
    import shutil

    conv = tmp_path / "conv"
    shutil.copytree(convs["cmoe"], conv)
    record = json.loads((conv / "conversion.json").read_text())
    record["model"].pop("source", None)
    (conv / "conversion.json").write_text(json.dumps(record))
    with pytest.raises(FinetuneError, match="dense model the conversion was made from.*use distill 0"):
        run_finetune(conv, quick("cmoe", text, steps=1, distill=0.5), tmp_path / "out", data_dir=data_dir, device="cpu")
    assert not (tmp_path / "out" / "train_log.json").exists()


def test_expertweaver_and_dense2moe_runs(convs, text, data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ft-modes")
    ew = run_finetune(convs["expertweaver"], quick("expertweaver", text, steps=3), root / "ew", data_dir=data_dir, device="cpu")
    log = read_train_log(root / "ew")
    assert all(s["aux_loss"] is not None and math.isfinite(s["aux_loss"]) for s in log["steps"])
    assert ew["perplexity_start"] != ew["perplexity_before"]  # Eq. 11 changes the model (slightly)
    assert abs(math.log(ew["perplexity_start"] / ew["perplexity_before"])) < 0.05
    reloaded = load_exported(root / "ew" / "model")
    assert {(m.router.kind, m.combine) for m in reloaded.moe_modules().values()} == {("softmax", "weighted")}

    d2 = run_finetune(convs["dense2moe"], quick("dense2moe", text, steps=3, lb_coef=0.0), root / "d2", data_dir=data_dir,
                      device="cpu")
    before = load_exported(convs["dense2moe"]).moe_modules()
    after = load_exported(root / "d2" / "model").moe_modules()
    (i, m0), = before.items()
    assert m0.combine == "sum" and after[i].combine == "scaled"
    assert after[i].router_scale.abs().sum() > 0, "the LM loss alone (λ = 0) trained the gate scale u…"
    assert not torch.equal(after[i].router_weight, m0.router_weight), "…and, through u, the router"
    (gate_after, _, down_after), (gate_before, _, down_before) = expert_rows(after[i]), expert_rows(m0)
    assert torch.equal(gate_after, gate_before) and torch.equal(down_after, down_before)
    assert not after[i].router_bias.any(), "…and nothing else"
    assert d2["trainable_params"] == {"routers": m0.router_weight.numel() + m0.n_routed}
    assert d2["perplexity_start"] == d2["perplexity_before"]

    mi = run_finetune(convs["midas"], quick("midas", text, steps=3, lb_coef=0.01), root / "mi", data_dir=data_dir, device="cpu")
    log = read_train_log(root / "mi")
    assert all(s["aux_loss"] is not None for s in log["steps"]), "Eq. 12 on G's probabilities"
    before = load_exported(convs["midas"]).moe_modules()
    after = load_exported(root / "mi" / "model").moe_modules()
    assert all(not torch.equal(after[i].router.weight, m.router.weight) for i, m in before.items())
    assert all(not torch.equal(after[i].gate_a, m.gate_a) for i, m in before.items()), "LoRA merged into the factors"
    assert mi["perplexity_start"] == mi["perplexity_before"]


def test_checkpoints_keep_the_last_two_and_restore_by_name(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    names = {id(p): n for n, p in net.named_parameters()}
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, betas=(0.9, 0.95))
    for step in range(1, 4):
        net(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        save_checkpoint(tmp_path, step, dict(net.named_parameters()), opt, names, {"cursor": 2 * step})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    files = sorted(p.name for p in (tmp_path / "step-000003").iterdir())
    assert files == ["optimizer.safetensors", "rng.safetensors", "state.json", "trainable.safetensors"]  # no pickle
    after = torch.randn(5, 4)  # the RNG state the checkpoint saved is restored below

    fresh = torch.nn.Linear(4, 3)
    fresh_names = {id(p): n for n, p in fresh.named_parameters()}
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1, betas=(0.9, 0.95))
    ckpt = load_checkpoint(tmp_path / "step-000003")
    restore(ckpt, dict(fresh.named_parameters()), fresh_opt, fresh_names)
    assert ckpt.state["cursor"] == 6 and torch.equal(torch.randn(5, 4), after)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters()))
    for pa, pb in zip(net.parameters(), fresh.parameters()):
        a, b = opt.state[pa], fresh_opt.state[pb]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(CheckpointError, match="do not match"):
        restore(ckpt, {"weight": fresh.weight}, fresh_opt, fresh_names)


def test_gate_mass_scores_read_the_lora_adapted_gates():
    """peft applies adapters on stacked expert parameters only inside the wrapper's forward; the
    gate-mass router scores experts from the gate rows too, and must read the same adapted rows
    (an EW or CMoE gate_mass conversion fine-tuned with LoRA failed with an AttributeError)."""
    from peft import LoraConfig, get_peft_model

    class Block(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x)

    mod = random_moe("gate_mass")
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    wrapped = get_peft_model(Block(mod), LoraConfig(r=2, lora_alpha=2, target_modules=[],
                                                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    picks = []
    mod.recorder = lambda idx: picks.append(idx.sort(-1).values)
    out = wrapped(x)
    merged = wrapped.merge_and_unload().mlp  # the same adapters folded into the weights
    assert torch.allclose(merged(x), out, atol=1e-5)
    assert torch.equal(picks[0], picks[1]), "routing by the adapted gate rows, as the merged model routes"


def test_ew_recovery_drops_the_skipped_expert_means():
    """``--recipe best`` compensates skipped experts under the sum combine; EW Eq. 11's weighted
    combine has no such term (check_compensation refuses that pairing), so the switch drops it."""
    comp = moe_from_dense(*(torch.randn(48, 32), torch.randn(48, 32), torch.randn(32, 48)), "silu", torch.arange(8),
                          torch.arange(8, 48).reshape(8, 5), top_k=3, router="centroid", skip_mean=torch.randn(8, 32))
    assert comp.compensated and comp.spec["skip_mean"] is True
    new = to_softmax_router(comp, 1.0)
    assert not new.compensated and "skip_mean" not in new.state_dict() and "skip_mean" not in new.spec
    assert (new.router.kind, new.combine) == ("softmax", "weighted")
