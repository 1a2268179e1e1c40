"""Training-free fits on calibration tokens: a closed-form router and a per-layer compute plan.

Neither is in the papers; both are options of the partition methods (``router="ridge"``,
``plan="budget"``) with each paper's behaviour kept as the default, and ``--recipe best`` uses
them. Measured on the default model (random 64×24 partition, held-out mixed text, relative FFN
output error at 75% / 50% of routed neurons, layers 15 / 25 / 29): centroid router (EW Eq. 9)
0.19 / 0.14 / 0.04 and 0.40 / 0.33 / 0.19; ridge 0.14 / 0.14 / 0.01 and 0.32 / 0.31 / 0.05 at
the same cost; exact gate mass 0.13 / 0.09 / 0.02 (at +1/3 of the dense FFN); a rank-32 (4% of
the FFN) prediction of every neuron's gate and up was worse than ridge; the oracle 0.08 / 0.06 / 0.01.

* **Ridge router.** The score of routed expert e is a linear function of the MLP input,
  ``s_e(x) = w_e·x + b_e``, fitted by ridge regression to the expert's output mass
  ``Σ_{j∈e} |act(g_j(x)) · u_j(x)|`` (the L1 norm of its GLU hidden state) on the calibration
  tokens: ``[W b] = (X̃ᵀX̃ + λI)⁻¹ X̃ᵀ M`` with ``X̃ = [X 1]`` and ``λ = LAMBDA · mean‖x̃‖²``
  (``moelab_routers.RidgeRouter``, which owns its fit).
  Its cost per token is ``E·d`` multiply-adds, the centroid router's. Other targets (the expert's
  output norm, √mass, log mass) ranked the experts within 0.005 of this one.
* **Budget plan** (greedy, as TEAL allocates neuron sparsity across layers): for every layer and
  every ``k = 0 … N_re`` the calibration error of running the ``k`` best-scored routed experts
  (by the layer's own router) is measured, ``err_ℓ(k) = mean_t ‖y_t − ŷ_t(k)‖² / ‖h_t‖²``, each
  token's error relative to its own residual stream ``h_t`` entering block ℓ (a perturbation matters
  relative to the stream it is added to, and the next norm rescales the stream). Per token, because
  a few tokens carry residual norms and FFN outputs hundreds of times the rest (massive
  activations): normalising the summed error by the summed energy (of the residual or of the FFN
  output) let those tokens decide, and the plan starved whole layers (k = 1 of 40 in layers 12–19,
  or in layers 2, 11, 28, 29) for a worse perplexity than the uniform plan. Where a norm rescales the
  MLP output before the residual add (Gemma 2/3, OLMo 2: ``h + N(y)``), the error is weighed as it
  reaches the stream, ``Σ_i (g_i / rms(y_t))² (y_ti − ŷ_ti(k))² / ‖h_t‖²`` to first order
  (``GLULayer.output_gain``): weighed as if ``y`` joined the stream unscaled, the plan starved the layers
  whose outputs were small (Gemma 3 270M, ``--recipe best`` at 0.5: 3.42× dense against 1.86×). Starting
  from ``k = 0`` everywhere, one expert at a time goes to the layer with the largest error
  decrease per multiply-add until the budget is spent. A layer that would run every routed expert
  is written whole instead, at the dense layer's cost (``budget_costs``: the dense GEMMs are faster
  than every expert, and under ``down_keep`` exact where every expert is not).
  ``plan_error="fisher"`` weighs the error by its effect on the calibration loss instead:
  ``err_ℓ(k) = mean_t Σ_i F_ℓti (y_ti − ŷ_ti(k))²`` with ``F`` the squared gradient of the
  next-token loss w.r.t. the MLP output (``output_fisher``), the loss increase to second order
  under a diagonal empirical Fisher (as Fisher-weighted quantisation allocates bits): units that
  compare across layers whatever a model family's residual norms do, where the residual
  normalisation is a proxy chosen on the default model. Measured there, it is worse: the squared
  gradients fall by orders of magnitude with depth, so it runs the first layers almost dense and
  starves layers 12–19 (``--recipe best`` at 0.5, code left out of calibration: 3.43× dense on code
  against 2.74×, every domain worse; docs/methods.md). ``plan_error="output"`` (each token's error
  over the dense FFN output's squared norm: every layer's relative error alike) is worse still
  (6.02× on code). Both options, off: the residual stream is the yardstick that held.
* **Leading plan** (``plan="leading"``, ``--recipe portable``): the layout GGUF and native HF exports
  hold, one ``top_k`` for every MoE layer and dense layers only in front (``methods.expertweaver.plan``).
  From the same error curves, every ``(L, k)`` — layers ``0 … L−1`` dense, the rest at ``k`` — is
  scored at once (``leading_choice``): least ``Σ_{ℓ ≥ L} err_ℓ(k)`` at a cost, by the runtime's own
  count, within ``1 − sparsity``. No greedy step: the choices are few (``n_layers · N_re``).
* **Skipped-expert compensation** (``compensation="skipped_mean"``): a token that skips routed
  expert e gets, instead of nothing, ``μ_e``, the mean output of e over the calibration tokens
  that skipped it; ``ŷ = shared(x) + Σ_{e∈S(x)} E_e(x) + Σ_{e∉S(x)} μ_e``. It is the conditional
  mean of what the router drops (the bias compensation FLAP applies to pruned channels, made
  per expert because the dropped set changes per token), fitted after the plan's final top-k
  and the router's selections. A token pays ``k + 1`` vector additions of width ``d``
  (``Σ_e μ_e − Σ_{e∈S} μ_e``), element-wise work that ``ffn_flops_fraction`` does not count,
  like the sum of the selected experts' outputs; the layer stores ``E·d`` more numbers.
  Measured on the default model, ``--recipe best``, four held-out domains: 1.51× → 1.42× dense
  perplexity at cost 0.75 and 3.04× → 2.49× at 0.5, every domain better (bench_frontier).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..memory import give_back_freed_heap
from ..models import ModelAdapter, dense_weights
from ..runtime.moelab_routers import router_kind
from ..progress import NO_PROGRESS, Progress
from .params import FIT_SEQ_LEN, ConversionError

CURVE_TOKENS = 1024  # calibration tokens the budget plan's error curves are measured on
FIT_STAGE = "fit: calibration forward, routers and error curves"  # layer by layer (``layerwise_inputs``)


@dataclass
class CalibrationInputs:
    """Per layer: MLP inputs ``x`` ``[T, d]`` (float32) and the squared norm of each token's residual
    stream entering the block ``[T]``; with ``keep_hidden``, the dense MLP's hidden activations too."""

    mlp_inputs: dict[int, torch.Tensor]
    residual_sq: dict[int, torch.Tensor]
    n_tokens: int
    windows: torch.Tensor | None = None  # the ``[n, FIT_SEQ_LEN]`` token ids the inputs were read on
    hidden: dict[int, torch.Tensor] | None = None  # ``[T, d_ffn]``: act(g·x)·(u·x), the down projection's input

    def layer(self, i: int) -> LayerInputs:
        return LayerInputs(i, self.mlp_inputs[i], self.residual_sq[i], None if self.hidden is None else self.hidden[i])


@dataclass
class LayerInputs:
    """One layer's share of ``CalibrationInputs``: its MLP inputs ``x`` ``[T, d]``, residual norms ``[T]`` and,
    where they were kept, the dense MLP's hidden activations ``[T, d_ffn]`` as its own forward computed them."""

    index: int
    x: torch.Tensor
    residual_sq: torch.Tensor
    hidden: torch.Tensor | None = None


def profile_token_windows(adapter: ModelAdapter, profile: Any, n_tokens: int, data_dir: Any) -> torch.Tensor:
    """``[n, FIT_SEQ_LEN]`` token windows of the profile's own calibration text (its set, seed and split)."""
    from ..data.calibration import CalibrationError, load_calibration

    cal = profile.manifest["calibration"]
    try:
        cset = load_calibration(str(cal["source"]), samples=cal.get("n_samples"), seed=profile.settings.seed,
                                data_dir=data_dir)
    except (CalibrationError, OSError, ValueError) as exc:
        raise ConversionError(f"the fitted router/plan reads the profile's calibration text {cal['source']!r}, "
                              f"which could not be loaded again ({exc}); use the paper router and plan") from exc
    return text_token_windows(adapter, [s.text for s in cset.samples], n_tokens, repr(str(cal["source"])))


def stored_token_windows(adapter: ModelAdapter, profile: Any, n_tokens: int, shorter: bool = False) -> torch.Tensor:
    """The windows ``profile_token_windows`` cuts, from the text the profile stores (``samples.parquet``:
    the calibration set's samples, in order) rather than the set loaded again: the same tokens, also for
    a set that cannot be loaded any more (a file since deleted, a set built in memory). ``shorter``: as
    ``text_token_windows``."""
    return text_token_windows(adapter, list(profile.samples["text"]), n_tokens,
                              repr(str(profile.manifest["calibration"].get("source", profile.path))), shorter)


def text_token_windows(adapter: ModelAdapter, texts: list[str], n_tokens: int, what: str,
                       shorter: bool = False) -> torch.Tensor:
    """``[n, FIT_SEQ_LEN]`` windows of ``texts`` tokenised and concatenated (each followed by EOS), at
    most ``n_tokens`` tokens (at least one window); ``what`` names the text in the error when it is too short,
    or, with ``shorter``, one window of all of it is returned instead."""
    tok = adapter.tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    stream = np.concatenate([np.append(np.asarray(x, dtype=np.int64), eos) for x in ids])
    n = min(max(1, n_tokens // FIT_SEQ_LEN), len(stream) // FIT_SEQ_LEN)
    if n == 0 and shorter:
        return torch.from_numpy(stream[None, :])
    if n == 0:
        raise ConversionError(f"calibration text {what} is shorter than {FIT_SEQ_LEN} tokens")
    return torch.from_numpy(stream[: n * FIT_SEQ_LEN].reshape(n, FIT_SEQ_LEN))


def _input_hooks(lay: Any, mlp: torch.nn.Module, xs: list[torch.Tensor], res: list[torch.Tensor],
                 hid: list[torch.Tensor] | None) -> list[Any]:
    """Hooks on decoder layer ``lay`` (its MLP ``mlp``) that append each call's MLP input ``[t, d]``, the squared norm
    of the residual stream entering the block ``[t]`` and, into ``hid`` where given, the dense MLP's hidden
    activations ``[t, d_ffn]`` (its down projection's input), all float32 on the CPU."""
    def mlp_hook(_m, args):
        xs.append(args[0].reshape(-1, args[0].shape[-1]).float().cpu())

    def block_hook(_m, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        res.append(h.float().pow(2).sum(-1).reshape(-1).cpu())

    def down_hook(_m, args):
        hid.append(args[0].reshape(-1, args[0].shape[-1]).float().cpu())

    handles = [mlp.register_forward_pre_hook(mlp_hook), lay.block.register_forward_pre_hook(block_hook, with_kwargs=True)]
    if hid is not None:
        handles.append(lay.down_proj.register_forward_pre_hook(down_hook))
    return handles


@torch.no_grad()
def collect_inputs(adapter: ModelAdapter, windows: torch.Tensor, progress: Progress = NO_PROGRESS,
                   batch: int = 4, replaced: dict[int, torch.nn.Module] | None = None,
                   keep_hidden: bool = False) -> CalibrationInputs:
    """One forward pass over ``windows``, keeping every layer's MLP input and residual norm: of the dense
    model, or with the layers' MLPs in ``replaced`` run instead (each later layer then sees the inputs the
    converted layers before it produce). ``keep_hidden``: every dense layer's hidden activations too (``T·d_ffn``
    floats a layer: for a benchmark that fits many conversions on one pass; ``layerwise_inputs`` holds one layer's)."""
    replaced = replaced or {}
    xs: dict[int, list[torch.Tensor]] = {lay.index: [] for lay in adapter.layers}
    res: dict[int, list[torch.Tensor]] = {lay.index: [] for lay in adapter.layers}
    hid: dict[int, list[torch.Tensor]] = {lay.index: [] for lay in adapter.layers if lay.index not in replaced}
    handles, originals = [], {}
    for lay in adapter.layers:
        if lay.index in replaced:
            originals[lay.index] = lay.block.mlp
            lay.block.mlp = replaced[lay.index]
        handles += _input_hooks(lay, replaced.get(lay.index, lay.mlp), xs[lay.index], res[lay.index],
                                hid.get(lay.index) if keep_hidden else None)
    try:
        chunks = windows.split(batch)
        for b, ids in enumerate(chunks):
            adapter.decoder()(input_ids=ids.to(adapter.device), use_cache=False)
            progress.update("fit: calibration forward", b + 1, len(chunks))
    finally:
        for h in handles:
            h.remove()
        for i, mlp in originals.items():
            adapter.layers[i].block.mlp = mlp
    n = int(windows.numel())
    return CalibrationInputs({i: torch.cat(v) for i, v in xs.items()}, {i: torch.cat(v) for i, v in res.items()}, n,
                             windows, {i: torch.cat(v) for i, v in hid.items()} if keep_hidden else None)


class InMemory:
    """``layerwise_inputs``'s default weights: all in memory, nothing to load around a step (a streamed job loads them:
    ``streaming.checkpoint.LayerLoader``); the heap a layer's step freed is given back as it ends, as there."""

    def decoder(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def layer(self, lay: Any) -> Iterator[None]:
        try:
            yield
        finally:
            give_back_freed_heap()


@torch.no_grad()
def layerwise_inputs(adapter: ModelAdapter, windows: torch.Tensor, batch: int = 4,
                     weights: Any = None) -> Iterator[LayerInputs]:
    """What ``collect_inputs(..., keep_hidden=True)`` keeps of each layer, the same numbers (the same batches
    through the same layers), one layer at a time in order: the model's forward runs once per batch to catch
    each decoder layer's call (``layer_calls``), then each layer runs over every batch before the next
    (a GPTQ-style sequential pass). A layer's fit can then take its hidden activations from its own dense
    forward instead of computing them again, while only one layer's activations are held. Progress is the
    caller's to report: it fits each layer between two of them (``fit_layers``: ``FIT_STAGE``). ``weights``: what
    loads the decoder's own weights around the calls' catch and each layer's around its pass and until the caller
    asks for the next layer (``InMemory``, the default, loads nothing), so a layer's weights are in memory while
    the caller fits it."""
    from ..layer_calls import catch_calls, layer_list_name, run_layer

    weights = weights or InMemory()
    decoder, name, n_layers = adapter.decoder(), layer_list_name(adapter), adapter.n_layers
    chunks = windows.split(batch)
    with weights.decoder():
        calls = [catch_calls(decoder, name, n_layers, input_ids=ids.to(adapter.device)) for ids in chunks]
    states = [c.pop("input") for c in calls]
    n = int(windows.numel())
    for lay in adapter.layers:
        with weights.layer(lay):
            xs, res, hid = _Rows(n), _Rows(n), _Rows(n)
            handles = _input_hooks(lay, lay.mlp, xs, res, hid)  # type: ignore[arg-type]
            try:
                for b in range(len(chunks)):
                    states[b] = run_layer(lay.block, states[b], calls[b][lay.index])
            finally:
                for h in handles:
                    h.remove()
            out = LayerInputs(lay.index, xs.rows(), res.rows(), hid.rows())
            del xs, res, hid
            yield out
            del out  # not held through the next layer's pass


class _Rows:
    """Batches' rows (``append``, as a list takes them) written into one tensor of ``n`` rows made at the first batch:
    a layer's calibration activations joined without their pieces and a joined copy held at once (the pieces, some
    MB each, also stayed in the heap after they were freed)."""

    def __init__(self, n: int) -> None:
        self.n, self.at, self.t = n, 0, None

    def append(self, rows: torch.Tensor) -> None:
        if self.t is None:
            self.t = rows.new_empty((self.n, *rows.shape[1:]))
        self.t[self.at : self.at + len(rows)] = rows
        self.at += len(rows)

    def rows(self) -> torch.Tensor:
        assert self.t is not None and self.at == self.n, "every batch's rows"
        return self.t


def output_fisher(adapter: ModelAdapter, windows: torch.Tensor, batch: int = 4) -> dict[int, torch.Tensor]:
    """Per layer, ``[T, d]``: the squared gradient of the calibration loss (next-token cross-entropy,
    summed over ``windows``) with respect to each token's MLP output, the diagonal of the empirical
    Fisher. To second order a perturbation ``δ`` of that output raises the loss by ``½ Σ F δ²``
    (the budget plan's ``plan_error="fisher"``). Read through a zero added to every MLP output, so the
    gradient keeps every path downstream, later MLPs included; the weights get no gradient."""
    grads: dict[int, list[torch.Tensor]] = {lay.index: [] for lay in adapter.layers}
    zeros: dict[int, torch.Tensor] = {}
    frozen = [(p, p.requires_grad) for p in adapter.model.parameters()]
    handles = []
    for lay in adapter.layers:
        def add_zero(_m, _args, out, i=lay.index):
            zeros[i] = torch.zeros_like(out, requires_grad=True)
            return out + zeros[i]

        handles.append(lay.mlp.register_forward_hook(add_zero))
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        for ids in windows.split(batch):
            ids = ids.to(adapter.device)
            with torch.enable_grad():
                logits = adapter.model(input_ids=ids, use_cache=False).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                         reduction="sum")
                order = sorted(zeros)
                for i, g in zip(order, torch.autograd.grad(loss, [zeros[i] for i in order])):
                    grads[i].append(g.float().pow(2).reshape(-1, g.shape[-1]).cpu())
            zeros.clear()
    finally:
        for h in handles:
            h.remove()
        for p, req in frozen:
            p.requires_grad_(req)
    return {i: torch.cat(v) for i, v in grads.items()}


def _hidden(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, act: str) -> torch.Tensor:
    from transformers.activations import ACT2FN

    return ACT2FN[act](x @ gate_w.T) * (x @ up_w.T)


def _contributions(x: torch.Tensor, g: torch.Tensor, u: torch.Tensor, dn: torch.Tensor, act: str) -> torch.Tensor:
    """``[T, E, d]``: each routed expert's output on each token; ``g``/``u`` ``[E·m, d]`` its gate and
    up rows in expert order, ``dn`` ``[d, E, m]`` its down columns."""
    E, m = dn.shape[1], dn.shape[2]
    return torch.einsum("tem,dem->ted", _hidden(x, g, u, act).reshape(-1, E, m), dn)


def _routed_weights(gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                    routed: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    E, m = routed.shape
    idx = torch.as_tensor(routed.reshape(-1), dtype=torch.long)
    return gate_w[idx], up_w[idx], down_w[:, idx].reshape(-1, E, m)


def rank_sums(hidden: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per routed expert and rank: the sum of its hidden activations over the tokens that rank it there,
    ``[E, E, m]``, and their count ``[E, E]``; ``hidden`` ``[T, E·m]`` in expert order, ranks by
    descending ``scores`` ``[T, E]``. A top-k router skips expert ``e`` on the tokens that rank it ``k`` or
    lower, so these give its skipped mean at every ``k`` (``skipped_means_at``). Summed in float32 (a
    bin holds T/E tokens on average; float64 took 3x as long for the default model) and returned as float64."""
    T, E = scores.shape
    rank = torch.empty_like(scores, dtype=torch.long).scatter_(
        1, scores.argsort(dim=1, descending=True), torch.arange(E).expand(T, -1))
    slot = (torch.arange(E) * E + rank).reshape(-1)  # (expert, rank) of each (token, expert) pair
    sums = torch.zeros(E * E, hidden.shape[1] // E)
    sums.index_add_(0, slot, hidden.reshape(T * E, -1).float())
    return sums.double().reshape(E, E, -1), torch.bincount(slot, minlength=E * E).reshape(E, E).double()


def skipped_means_at(sums: torch.Tensor, counts: torch.Tensor, top_k: int, down_w: torch.Tensor,
                     routed: np.ndarray) -> np.ndarray:
    """``μ`` ``[E, d]`` (module docstring, compensation) from ``rank_sums``: each routed expert's mean output
    over the tokens whose ``top_k`` leave it out (ranks ``top_k`` and below); 0 for an expert no token skips.
    An expert's output is linear in its hidden activations (``D_e h_e``), so the mean hidden row is
    formed first and its down block applied once: ``T·E·m`` sums where the outputs would move ``T·E·d``."""
    E, m = routed.shape
    mean_h = sums[:, top_k:].sum(1) / counts[:, top_k:].sum(1).clamp_min(1)[:, None]
    dn = down_w[:, torch.as_tensor(routed.reshape(-1), dtype=torch.long)].reshape(-1, E, m).double()
    return torch.einsum("em,dem->ed", mean_h, dn).float().numpy()


def routed_hidden(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, routed: np.ndarray, act: str,
                  chunk: int = 2048) -> torch.Tensor:
    """``[T, E·m]``: the routed experts' hidden activations ``act(g·x)·(u·x)`` on ``x``, in expert order.
    In float32 on every machine, so one command fits the same conversion everywhere: bfloat16 products
    (AVX512-BF16, 2.1x float32's rate here) saved 6 s of a default-model build but moved the budget plan's
    top-k in 5 of 28 layers (held-out perplexity ±1% over five texts), and only on CPUs that have them.
    ``chunk`` tokens at a time into one output: a product of all 16,384 calibration tokens at once is a fresh
    78 MB mapping (glibc maps allocations above 32 MB itself) whose pages fault in again for every layer."""
    idx = torch.as_tensor(routed.reshape(-1), dtype=torch.long)
    g, u = gate_w[idx], up_w[idx]
    out = x.new_empty((len(x), len(idx)))
    for s in range(0, len(x), chunk):
        out[s : s + chunk] = _hidden(x[s : s + chunk], g, u, act)
    return out


def skipped_means(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                  routed: np.ndarray, scores: torch.Tensor, top_k: int, act: str) -> np.ndarray:
    """``μ`` ``[E, d]``: ``skipped_means_at`` of the routed experts' hidden activations on ``x``."""
    return skipped_means_at(*rank_sums(routed_hidden(x, gate_w, up_w, routed, act), scores), top_k, down_w, routed)


def error_curve(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                routed: np.ndarray, scores: torch.Tensor, act: str, chunk: int = 64,
                weights: torch.Tensor | None = None) -> np.ndarray:
    """``err[k]`` for k = 0 … E: ``Σ_t w_t ‖y_t − ŷ_t(k)‖²`` where ``ŷ(k)`` keeps the k best-scored
    routed experts of each token (the shared part is always computed, so it cancels); ``w_t = 1``
    unless ``weights`` are given: ``[T]`` per token, or ``[T, d]`` per token and output dimension
    (``Σ_t Σ_i w_ti (y_ti − ŷ_ti(k))²``).

    What ``k`` experts miss is the sum of the contributions ranked ``k`` and below, so with ``G`` each
    token's Gram matrix of its (``√w``-scaled) contributions in rank order, ``err[k] = Σ_t Σ_{i ≥ k}
    (G_ii + 2 Σ_{j > i} G_ij)``: one ``[E, E]`` product per token and a suffix sum, where the partial
    sums themselves would be ``E`` vectors of ``d`` per token, each moved several times. ``chunk`` tokens
    at a time: 64 keeps a chunk's contributions (``64·E·d`` floats, 15 MB on the default model) in cache and in
    reused heap memory (256 tokens' 58 MB were a fresh mapping per product): 25% faster there (16, 32 slower again)."""
    E = routed.shape[0]
    g, u, dn = _routed_weights(gate_w, up_w, down_w, routed)
    own_and_below = torch.ones(E, E).triu(1) * 2 + torch.eye(E)  # row i: G_ii once, G_ij (j ranked below) twice
    per_rank = torch.zeros(E, dtype=torch.float64)
    for s in range(0, len(x), chunk):
        contrib = _contributions(x[s : s + chunk], g, u, dn, act)  # [t, E, d]
        if weights is not None:
            w = weights[s : s + chunk].sqrt()
            contrib = contrib * (w[:, None, :] if w.dim() == 2 else w[:, None, None])
        gram = contrib @ contrib.transpose(1, 2)  # [t, E, E]
        order = scores[s : s + chunk].argsort(dim=1, descending=True)
        ranked = gram.gather(1, order[:, :, None].expand(-1, -1, E)).gather(2, order[:, None, :].expand(-1, E, -1))
        per_rank += (ranked * own_and_below).sum(-1).double().sum(0)
    err = torch.zeros(E + 1, dtype=torch.float64)
    err[:E] = per_rank.flip(0).cumsum(0).flip(0)
    return err.numpy()


def greedy_budget(errors: Sequence[np.ndarray], costs: Sequence[np.ndarray], budget: int,
                  k_min: Sequence[int] | None = None) -> list[int]:
    """Routed experts per token per layer, ``k_ℓ``, spending at most ``budget`` multiply-adds greedily
    by error decrease per multiply-add (module docstring); ``costs[ℓ][k]``: what ``k`` routed experts
    of layer ℓ cost beyond its always-run part (``budget_costs``).

    Error curves need not be convex (a layer's second expert may help more than its first): each
    step looks ahead along every layer's curve and buys the run of ``j`` experts with the best
    average decrease per multiply-add that still fits the budget. Costs need not rise with ``k``
    either (a layer written whole drops its router): a run that lowers the error for no more
    multiply-adds is taken first.
    """
    L = len(errors)
    k = list(k_min) if k_min is not None else [0] * L
    spent = sum(int(costs[i][k[i]]) for i in range(L))
    if spent > budget:
        raise ConversionError("the budget does not cover the minimum number of experts per layer")

    def best_run(i: int) -> tuple[float, int]:
        e, c = errors[i], np.asarray(costs[i], dtype=np.float64)
        j = np.arange(1, len(e) - k[i])
        extra = c[k[i] + j] - c[k[i]]
        fits = spent + extra <= budget  # an infinite cost never fits: not offered
        j, extra = j[fits], extra[fits]
        if not j.size:
            return -np.inf, 0
        gain = e[k[i]] - e[k[i] + j]
        free = np.where(gain > 0, np.inf, -np.inf)
        rate = np.where(extra > 0, gain / np.where(extra > 0, extra, 1), free)
        b = int(np.argmax(rate))
        return float(rate[b]), int(j[b])

    while True:
        runs = [best_run(i) for i in range(L)]
        pick = max(range(L), key=lambda i: (runs[i][0], -i))
        if runs[pick][1] == 0 or not runs[pick][0] > 0:
            return k
        spent += int(costs[pick][k[pick] + runs[pick][1]] - costs[pick][k[pick]])
        k[pick] += runs[pick][1]


def budget_costs(n_routed: int, expert_cost: int, whole_cost: int | None, max_share: float = 1.0,
                 no_slower: np.ndarray | None = None) -> np.ndarray:
    """``costs[k]`` of ``greedy_budget`` for a layer of ``n_routed`` experts of ``expert_cost`` each:
    ``k · expert_cost``, except that with ``whole_cost`` (the dense layer's multiply-adds less the
    always-run part) every expert selected is the layer written whole (``allocation.dense_plan``),
    and more than ``max_share`` of the experts is not offered (infinite cost): past it the plan
    chooses between that share and the whole layer (without ``whole_cost``, that share is the most).

    Why whole: a summed MoE layer running every expert computes the dense FFN, and does it slower than
    the dense GEMMs; under ``down_keep`` it also drops down rows the dense layer keeps, for a sixth
    less multiply-adds at half-down yet more seconds (the native prefill kernel on the default model:
    20–21 ms against 15.5 ms dense at 512 tokens). So the plan pays the whole layer's cost to run all
    of it, and gets it exact. Why a share: a layer selecting nearly every expert is slower than dense
    too, and by more the larger the share (EW's ``max_routed_share``). ``no_slower`` (``[n_routed + 1]``
    booleans, ``speed_prediction.top_k_no_slower``): the top-k this machine runs no slower than the dense
    layer in any phase; the others are not offered either (EW's ``speed_guard``)."""
    costs = np.arange(n_routed + 1, dtype=np.float64) * expert_cost
    if n_routed:
        costs[int(np.floor(max_share * n_routed + 1e-9)) + 1 :] = np.inf
        if no_slower is not None:
            costs[1:][~np.asarray(no_slower, dtype=bool)[1:]] = np.inf
        if whole_cost is not None:
            costs[n_routed] = whole_cost
    return costs


def leading_choice(errors: np.ndarray, moe_macs: np.ndarray, dense_macs: np.ndarray, budget: float) -> tuple[int, int]:
    """``(L, k)`` of the leading plan: the first ``L`` layers dense, every other layer running ``k ≥ 1``
    routed experts, of least total calibration error ``Σ_{ℓ ≥ L} errors[ℓ, k]`` among the options
    whose multiply-adds ``Σ_{ℓ < L} dense_macs[ℓ] + Σ_{ℓ ≥ L} moe_macs[ℓ, k]`` are at most ``budget``
    (ties: the cheaper, then the fewer dense layers). ``errors``/``moe_macs``: ``[n_layers, K + 1]``
    for ``k = 0 … K``; ``dense_macs``: ``[n_layers]``. Every option is scored at once: suffix sums over
    layers give the MoE part of each ``L``, prefix sums the dense part; at least one layer stays MoE."""
    tail_err = np.cumsum(errors[::-1], axis=0)[::-1]  # [L, k]: Σ_{ℓ ≥ L} errors[ℓ, k]
    tail_cost = np.cumsum(moe_macs[::-1], axis=0)[::-1]
    head_cost = np.concatenate([[0], np.cumsum(dense_macs)[:-1]])  # layers 0 … L−1 dense
    cost = head_cost[:, None] + tail_cost
    ok = cost <= budget
    ok[:, 0] = False  # k = 0 runs no routed expert: no MoE layer to export
    if not ok.any():
        raise ConversionError("no leading plan fits the budget: the shared experts and one routed expert per token "
                              "cost more than it; lower the shared share (alpha_min/alpha_max) or the sparsity")
    options = np.argwhere(ok)  # row-major: fewer dense layers first
    best = np.lexsort((cost[ok], tail_err[ok]))[0]
    return int(options[best, 0]), int(options[best, 1])


def router_scores(x: torch.Tensor, router: str, weights: dict[str, np.ndarray], gate_w: torch.Tensor,
                  routed: np.ndarray, act: str) -> torch.Tensor:
    """``[T, E]`` scores of a training-free router on ``x``: its kind's own ``scores`` (the runtime's),
    read off a stand-in for the layer that holds the partition's router weights."""
    from transformers.activations import ACT2FN

    E, m = routed.shape
    act_fn = ACT2FN[act]
    gate_rows = gate_w[torch.as_tensor(routed.reshape(-1), dtype=torch.long)]
    layer = SimpleNamespace(**{k: torch.as_tensor(v) for k, v in weights.items() if k.startswith("router_")},
                            act_fn=act_fn, n_routed=E, expert_size=m, gate_activations=lambda t: act_fn(t @ gate_rows.T))
    return router_kind(router).scores(layer, x)[0]


def fit_router(x: torch.Tensor, router: str, gate_w: torch.Tensor, up_w: torch.Tensor, routed: np.ndarray,
               act: str, hidden: torch.Tensor | None = None) -> dict[str, np.ndarray] | None:
    """The router kind's closed-form fit on calibration inputs ``x`` (None: it has none); ``hidden``: the
    routed experts' ``[T, E·m]`` hidden activations on ``x`` where the caller has them already."""
    from transformers.activations import ACT2FN

    kind = router_kind(router)
    if not kind.fitted:  # no gather of the routed rows for a router that has nothing to fit
        return None
    E, m = routed.shape
    idx = torch.as_tensor(routed.reshape(-1), dtype=torch.long)
    d = gate_w.shape[1]
    fitted = kind.fit(x, gate_w[idx].reshape(E, m, d), up_w[idx].reshape(E, m, d), ACT2FN[act], hidden=hidden)
    return {k: v.numpy() for k, v in fitted.items()}


def fit_layers(adapter: ModelAdapter, profile: Any, params: Any, rows: list[Any], experts: list[Any], data_dir: Any,
               progress: Progress = NO_PROGRESS, calib: CalibrationInputs | None = None,
               ) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """The ridge router (``params.router == "ridge"``), the budget or leading plan (``params.plan``)
    and the skipped-expert compensation (``params.compensation == "skipped_mean"``, fitted last: it
    depends on the final top-k) of a partitioned model; returns the updated ``(rows, experts, record)``.
    Each layer is fitted as the calibration pass reaches it (``layerwise_inputs``): its routed experts' activations
    are the columns of its dense forward's own, and only one layer's activations are held; ``calib``, inputs a
    benchmark collected once for many conversions (with ``keep_hidden``: the same fit, bit for bit).

    Budget: ``ffn_flops_fraction ≤ params.flops_budget()`` where the method defines it (EW:
    ``1 − sparsity``), else the paper plan's own cost (CMoE: the uniform S·A·E plan's); shared parts
    and routers are paid first, the rest buys routed experts (``greedy_budget``).
    """
    if calib is None:  # one layer's activations at a time, its hidden activations from its own dense forward
        windows = profile_token_windows(adapter, profile, params.fit_tokens, data_dir)
        layer_inputs, n_tokens = layerwise_inputs(adapter, windows), int(windows.numel())
    else:  # the same inputs, already collected (a benchmark converting many times)
        windows, n_tokens = calib.windows, calib.n_tokens
        layer_inputs = (calib.layer(lay.index) for lay in adapter.layers)
    fits = LayerFits(adapter, params, n_tokens, windows)
    for n, (row, ex) in enumerate(zip(rows, experts)):
        fits.add(row, ex, next(i for i in layer_inputs if i.index == row.layer))  # rows go in layer order
        progress.update(FIT_STAGE, n + 1, len(rows))
    table = guard_table(params, data_dir, adapter.model, adapter, profile)
    rows, record = fits.plan(rows, experts, profile, table)
    if fits.compensates:
        for n, ex in enumerate(experts):
            fits.compensate(ex)
            progress.update("fit: skipped-expert compensation", n + 1, len(experts))
    return rows, experts, record


def _float_weights(adapter: ModelAdapter, layer: int) -> tuple[torch.Tensor, ...]:
    """Layer ``layer``'s dense gate, up and down weights as float32 on the CPU."""
    return tuple(w.detach().float().cpu() for w in dense_weights(adapter, layer))


class LayerFits:
    """What ``fit_layers`` fits, in its three steps: ``add`` each layer as its calibration inputs arrive (its
    router, and what the plan and the compensation need of it: error curve, per-rank hidden sums), ``plan`` over
    every layer at once, then ``compensate`` each layer at its final top-k. Only ``add`` and ``compensate`` read a
    layer's weights, so a streamed conversion (``streaming.conversion``) runs them in two passes with one layer's
    weights in memory at a time; between them it holds the curves and the sums (``fit_bytes``)."""

    def __init__(self, adapter: ModelAdapter, params: Any, n_tokens: int, windows: torch.Tensor | None) -> None:
        self.adapter, self.params, self.n_tokens, self.windows = adapter, params, n_tokens, windows
        self.kind = getattr(params, "plan", "paper")
        self.budget_plan = self.kind in ("budget", "leading")  # both choose top-k from the same error curves
        self.compensates = getattr(params, "compensation", "none") == "skipped_mean"
        self.curves: list[np.ndarray] = []
        self.fixed: list[int] = []
        self.unit: list[int] = []
        self.skip_sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._curve_tokens: torch.Tensor | None = None
        self._token_weights: Any = None

    def add(self, row: Any, ex: Any, inputs: LayerInputs) -> None:
        """Fit layer ``row.layer`` (``ex``: its experts, router weights set here) on its calibration ``inputs``;
        its dense weights must be in memory."""
        from ..core.allocation import layer_cost

        adapter, act = self.adapter, self.adapter.activation
        gate_w, up_w, down_w = _float_weights(adapter, row.layer)
        x = inputs.x
        if len(ex.routed):
            # the routed experts' activations on every token, once for the router fit and the compensation
            hidden = (_routed_hidden_of(inputs, adapter, gate_w, up_w, ex.routed)
                      if self.compensates or router_kind(ex.router).fitted else None)
            if fitted := fit_router(x, ex.router, gate_w, up_w, ex.routed, act, hidden):
                ex.router_weights = fitted
            if self.budget_plan or self.compensates:
                scores = router_scores(x, ex.router, ex.router_weights, gate_w, ex.routed, act)
            if self.compensates:  # summed in float32: held so until the layer's top-k is known (half the memory)
                sums, counts = rank_sums(hidden, scores)
                self.skip_sums[row.layer] = (sums.float(), counts)
            del hidden
        if not self.budget_plan:
            return
        f, c = layer_cost(row, ex.router, adapter.d_model, getattr(self.params, "down_keep", 1.0))
        self.fixed.append(f)
        self.unit.append(c)
        if not len(ex.routed):
            self.curves.append(np.zeros(1))
            return
        if self._curve_tokens is None:
            self._curve_tokens, self._token_weights = _curve_weights(adapter, self.n_tokens, self.windows,
                                                                     getattr(self.params, "plan_error", "residual"))
        weights = self._token_weights(inputs)
        tokens = self._curve_tokens
        err = error_curve(x[tokens], gate_w, up_w, down_w, ex.routed, scores[tokens], act, weights=weights)
        self.curves.append(err / len(weights))

    def plan(self, rows: list[Any], experts: list[Any], profile: Any,
             table: dict[str, Any] | None) -> tuple[list[Any], dict[str, Any]]:
        """The plan's rows over every added layer (each layer's ``top_k`` set on its experts) and the fit's record;
        ``table``: this machine's kernel table for the speed guard (``guard_table``)."""
        record: dict[str, Any] = {"fit_tokens": self.n_tokens, "fit_source": profile.manifest["calibration"]["source"]}
        d = self.adapter.d_model
        if self.kind == "leading":
            rows = _leading_rows(self.params, rows, experts, self.curves, d, record)
        elif self.budget_plan:
            no_slower = _no_slower_top_k(self.params, rows, table, record)
            rows = _budget_rows(self.params, rows, experts, self.curves, self.fixed, self.unit, d, record, no_slower)
        if self.compensates:
            record["compensation"] = "skipped_mean"
        return rows, record

    def compensate(self, ex: Any) -> None:
        """Layer ``ex.layer``'s skipped-expert means at its planned top-k, where it skips any; its dense down weight
        must be in memory then."""
        if len(ex.routed) and ex.top_k < len(ex.routed):
            sums, counts = self.skip_sums[ex.layer]
            ex.router_weights = {**ex.router_weights, "skip_mean": skipped_means_at(
                sums.double(), counts, ex.top_k, _float_weights(self.adapter, ex.layer)[2], ex.routed)}


def _routed_hidden_of(inputs: LayerInputs, adapter: ModelAdapter, gate_w: torch.Tensor, up_w: torch.Tensor,
                      routed: np.ndarray) -> torch.Tensor:
    """``routed_hidden`` of the layer, its columns taken from the dense forward's own hidden activations where
    they were kept and are the same function (no gate or up bias: ``routed_hidden`` leaves biases out), which saves
    a product over every calibration token and routed neuron a layer (11 s of a 64 s default-model build)."""
    lay = adapter.layers[inputs.index]
    if inputs.hidden is None or lay.gate_bias() is not None or lay.up_bias() is not None:
        return routed_hidden(inputs.x, gate_w, up_w, routed, adapter.activation)
    return inputs.hidden[:, torch.as_tensor(routed.reshape(-1), dtype=torch.long)]


def _curve_weights(adapter: ModelAdapter, n_tokens: int, windows: torch.Tensor | None,
                   plan_error: str) -> tuple[torch.Tensor, Any]:
    """The calibration tokens the plan's error curves are measured on (``CURVE_TOKENS``, an even
    subsample of ``n_tokens``: the curve is a mean, its cost is T·E·d) and, as a function of a layer's
    ``LayerInputs``, their weights (module docstring):
    ``residual``, each token's error over its residual stream's squared norm ``[T]`` (``[T, d]`` where a
    norm rescales the MLP output before it joins the stream: as it reaches the stream); ``output``, over
    the squared norm of the dense FFN's own output on it ``[T]`` (every layer's relative error counts
    alike); ``fisher``, each
    output dimension's by the empirical Fisher of the calibration loss ``[T, d]`` (``output_fisher``,
    read on ``4 · CURVE_TOKENS`` tokens of windows spread over the calibration set, every fourth kept)."""
    if plan_error in ("residual", "output"):
        every = max(1, n_tokens // CURVE_TOKENS)
        tokens = torch.arange(0, n_tokens, every)

        def dense_output(inputs: LayerInputs) -> torch.Tensor:
            gate_w, up_w, down_w = (w.detach().float().cpu() for w in dense_weights(adapter, inputs.index))
            return _hidden(inputs.x[tokens], gate_w, up_w, adapter.activation) @ down_w.T

        def over_residual(inputs: LayerInputs) -> torch.Tensor:
            w = 1 / inputs.residual_sq[tokens].clamp_min(1e-12)
            lay = adapter.layers[inputs.index]
            if lay.post_norm is None:
                return w
            # A norm on the MLP output (Gemma 2/3, OLMo 2) adds g ⊙ y / rms(y) to the stream: to first
            # order, an error e of y adds g ⊙ e / rms(y) (less its part along y), whatever y's own scale.
            return lay.output_gain(dense_output(inputs)).pow(2) * w[:, None]

        if plan_error == "residual":
            return tokens, over_residual
        return tokens, lambda inputs: 1 / dense_output(inputs).pow(2).sum(-1).clamp_min(1e-12)
    if windows is None:
        raise ConversionError("plan_error 'fisher' needs the calibration windows the inputs were read on")
    n_win, seq = windows.shape
    pick = torch.linspace(0, n_win - 1, min(n_win, max(1, 4 * CURVE_TOKENS // seq))).round().long().unique()
    every = max(1, len(pick) * seq // CURVE_TOKENS)
    tokens = (pick[:, None] * seq + torch.arange(seq)).reshape(-1)[::every]
    fisher = output_fisher(adapter, windows[pick])
    return tokens, lambda inputs: fisher[inputs.index][::every]


def refit_on_converted(adapter: ModelAdapter, params: Any, experts: list[Any], modules: dict[int, torch.nn.Module],
                       windows: torch.Tensor, progress: Progress = NO_PROGRESS) -> dict[str, Any]:
    """``refit="converted_inputs"``: the fitted router and the skipped-expert means of every layer fitted
    again, on the MLP inputs the converted model itself produces on the same calibration windows (one
    more calibration forward, every converted layer in place), as GPTQ-style methods quantise each
    layer on the inputs the already-quantised layers before it give. The plan (top-k per layer) is
    kept. One pass, not layer by layer: layer ℓ's new inputs come from the first fit of the layers
    before it, which costs one forward instead of one per layer. Updates ``experts`` in place; returns
    the record's entry."""
    calib = collect_inputs(adapter, windows, progress.within("refit"), replaced=modules)
    compensate = getattr(params, "compensation", "none") == "skipped_mean"
    for n, ex in enumerate(experts):
        if len(ex.routed):
            gate_w, up_w, down_w = (w.detach().float().cpu() for w in dense_weights(adapter, ex.layer))
            x = calib.mlp_inputs[ex.layer]
            skips = compensate and ex.top_k < len(ex.routed)
            hidden = (routed_hidden(x, gate_w, up_w, ex.routed, adapter.activation)
                      if skips or router_kind(ex.router).fitted else None)
            fitted = fit_router(x, ex.router, gate_w, up_w, ex.routed, adapter.activation, hidden)
            weights = {k: v for k, v in ex.router_weights.items() if k != "skip_mean"} | (fitted or {})
            if skips:
                scores = router_scores(x, ex.router, weights, gate_w, ex.routed, adapter.activation)
                weights["skip_mean"] = skipped_means_at(*rank_sums(hidden, scores), ex.top_k, down_w, ex.routed)
            ex.router_weights = weights
        progress.update("refit: routers on the converted model's inputs", n + 1, len(experts))
    return {"refit": "converted_inputs", "refit_tokens": calib.n_tokens}


def guard_table(params: Any, data_dir: Any, where: Any, adapter: ModelAdapter, profile: Any) -> dict[str, Any] | None:
    """The kernel table the speed guard (``params.speed_guard == "machine"``) reads: the one the profiled model has on
    this machine (``evaluation.speed_table``), for a model whose weights are on ``where`` (a module, or a
    ``(device, dtype)`` pair where the model is not in memory); None without a guard or a table."""
    if getattr(params, "speed_guard", "none") != "machine" or data_dir is None:
        return None
    from ..evaluation.speed_table import cached_table, model_info

    return cached_table(where, model_info(adapter, profile.manifest["model"].get("source")), data_dir)


def _no_slower_top_k(params: Any, rows: list[Any], table: dict[str, Any] | None,
                     record: dict[str, Any]) -> list[np.ndarray | None]:
    """Per row, the top-k ``params.speed_guard`` leaves to the budget plan (None: any), from this machine's kernel
    table (``guard_table``); notes in ``record["speed_guard"]`` what the guard was based on, or why it could not run."""
    if getattr(params, "speed_guard", "none") != "machine":
        return [None] * len(rows)
    if table is None:
        record["speed_guard"] = {"applied": False, "note": "no kernel timings of this model on this machine (a profile "
                                 "measures them unless MOELAB_TIME_KERNELS is off; a streamed one times the FFN layers "
                                 "where two of them fit --max-memory): every top-k offered"}
        return [None] * len(rows)
    from .speed_prediction import busy_words, top_k_no_slower

    keep, margin = getattr(params, "down_keep", 1.0), float(getattr(params, "speed_margin", 0.0))
    masks = [top_k_no_slower(table, {"kind": "moe", "d_shared": row.d_shared, "n_routed": row.n_routed,
                                     "expert_size": row.d_expert, "down_keep": keep}, margin) if row.n_routed else None
             for row in rows]
    for m in masks:
        if m is not None:  # the plan starts every layer from its shared part alone (``greedy_budget``): always offered
            m[0] = True
    # the largest share of its experts each layer may run short of all of them (all of them: the layer written whole)
    shares = [int(np.flatnonzero(m[:-1]).max()) / (len(m) - 1) for m in masks if m is not None]
    said = f"{min(shares):.0%}–{max(shares):.0%}" if shares else "none"
    record["speed_guard"] = {
        "applied": True, "machine": table.get("machine"), "threads": table.get("threads"),
        "measured_at": table.get("measured_at"),
        "top_k_offered": [[int(k) for k in np.flatnonzero(m)] if m is not None else [0] for m in masks],
        "margin": margin,
        "note": "each layer offered only the top-k this machine's kernel table predicts no slower than "
                + (f"{1 - margin:.2f}× the dense FFN's time (a {margin:.0%} margin for the prediction's error) "
                   if margin else "the dense FFN ")
                + f"in every phase: up to {said} of its experts ({table.get('machine')}, {table.get('threads')} threads; "
                f"measured {table.get('measured_at')})" + busy_words(table)}
    return masks


def _budget_rows(params: Any, rows: list[Any], experts: list[Any], curves: list[np.ndarray], fixed: list[int],
                 unit: list[int], d: int, record: dict[str, Any],
                 no_slower: Sequence[np.ndarray | None] | None = None) -> list[Any]:
    """The budget plan's rows (and each layer's ``top_k`` set on its experts); fills ``record["budget"]``.
    ``no_slower``: per row, the top-k the speed guard offers (``_no_slower_top_k``; None: any)."""
    from ..core.allocation import is_dense, layer_plan

    dense = sum(3 * d * row.d_ffn for row in rows)
    paper_cost = sum(f + row.top_k * c for f, c, row in zip(fixed, unit, rows)) / dense
    cap = params.flops_budget() if hasattr(params, "flops_budget") else paper_cost
    budget = int(cap * dense) - sum(fixed)
    if budget < 0:
        raise ConversionError(
            f"the shared experts and routers alone cost {sum(fixed) / dense:.1%} of the dense FFN, more than the "
            f"budget {cap:.1%}: lower the shared share (alpha_min/alpha_max, shared) or the sparsity")
    summed = getattr(params, "combine", "sum") == "sum"  # a weighted layer at every expert is no dense one
    share = getattr(params, "max_routed_share", 1.0)
    costs = [budget_costs(row.n_routed, c, 3 * d * row.d_ffn - f if summed else None, share, ok)
             for row, f, c, ok in zip(rows, fixed, unit, no_slower or [None] * len(rows))]
    ks = greedy_budget(curves, costs, budget)
    new_rows = []
    for row, ex, k in zip(rows, experts, ks):
        if summed and row.n_routed and k == row.n_routed:
            new_rows.append(_written_whole(row, ex))
            continue
        leftover = row.d_shared - row.n_shared * row.d_expert
        note = "budget plan: top-k chosen by calibration error"
        new_rows.append(layer_plan(row.layer, row.d_ffn, row.r, row.d_expert, row.n_shared, leftover, row.n_routed, k,
                                   row.clamped, note))
        ex.top_k = k if len(ex.routed) else 0
    record["budget"] = {"ffn_flops_fraction": cap, "paper_plan_ffn_flops_fraction": paper_cost,
                        "plan_error": getattr(params, "plan_error", "residual"),
                        "error_at_k": [float(c[k]) for c, k in zip(curves, ks)], "top_k": [r.top_k for r in new_rows],
                        "dense_layers": [r.layer for r in new_rows if is_dense(r)]}
    return new_rows


def _written_whole(row: Any, ex: Any) -> Any:
    """``row`` left dense (``allocation.dense_plan``): its experts hold every neuron as shared and none
    routed, so the conversion keeps the layer's dense MLP (``slicing.build_modules``)."""
    from ..core.allocation import dense_plan

    ex.shared, ex.routed, ex.top_k, ex.router_weights = (np.arange(row.d_ffn), ex.routed[:0], 0, {})
    return dense_plan(row.layer, row.d_ffn, row.r, row.d_expert)


def _leading_rows(params: Any, rows: list[Any], experts: list[Any], curves: list[np.ndarray], d: int,
                  record: dict[str, Any]) -> list[Any]:
    """The leading plan's rows (``leading_choice``): the first ``L`` layers dense (``allocation.dense_plan``:
    their experts hold every neuron as shared, no routed one), the rest at one ``top_k``; costs are the
    runtime's own (``moelab_routers.ffn_macs``), so ``plan_flops_fraction ≤ params.flops_budget()``.
    Fills ``record["leading"]``."""
    from ..core.allocation import layer_plan
    from ..runtime.moelab_routers import ffn_macs

    combine = getattr(params, "combine", "sum")
    K = max(r.n_routed for r in rows)
    if any(r.n_routed != K or r.d_shared != rows[0].d_shared or r.d_expert != rows[0].d_expert for r in rows):
        raise ConversionError("plan 'leading' needs one shared width, expert size and routed-expert count in every layer")
    ks = np.arange(K + 1)
    errors = np.stack(curves)  # [n_layers, K + 1]
    moe_macs = np.array([[ffn_macs(d, r.d_shared, K, r.d_expert, int(k), ex.router, combine) for k in ks]
                         for r, ex in zip(rows, experts)], dtype=np.float64)
    dense_macs = np.array([3 * d * r.d_ffn for r in rows], dtype=np.float64)
    cap = params.flops_budget()
    L, k = leading_choice(errors, moe_macs, dense_macs, cap * dense_macs.sum())
    new_rows = []
    for n, (row, ex) in enumerate(zip(rows, experts)):
        if n < L:
            new_rows.append(_written_whole(row, ex))
            continue
        leftover = row.d_shared - row.n_shared * row.d_expert
        new_rows.append(layer_plan(row.layer, row.d_ffn, row.r, row.d_expert, row.n_shared, leftover, row.n_routed, k,
                                   row.clamped, "; ".join(filter(None, (row.note, "leading plan: one top-k chosen by "
                                                                                   "calibration error")))))
        ex.top_k = k
    cost = (dense_macs[:L].sum() + moe_macs[L:, k].sum()) / dense_macs.sum()
    record["leading"] = {"ffn_flops_fraction": cap, "planned_ffn_flops_fraction": float(cost), "dense_layers": L,
                         "top_k": k, "error": float(errors[L:, k].sum()),
                         "error_all_moe": float(errors[:, k].sum())}
    return new_rows
