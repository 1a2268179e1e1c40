"""Router kinds of moelab's sparse block, one class each, and the one cost function.

Part of the exported runtime (copied next to the weights with ``modeling_moelab.py``), and
imported by the engine's planners, which run in processes that must not load torch: this module
imports only the standard library at import time; the methods receive tensors and use their
methods (``torch`` itself is imported inside the one fit that solves a linear system).

A router kind owns, in one place:

* ``parameters(E, d)``: the names and shapes of its parameters. They are registered on the sparse
  block (``MoeFFN.router_weight`` …), not on its router submodule (``MoeFFN.router``, a
  ``MoeRouter``, which reads them there): those names are the checkpoint format of every export
  written so far, fine-tuning selects the routers by their ``router`` prefix, and LoRA targets
  name the block's children.
* ``scores(block, x)``: the ``[T, E]`` scores that rank the routed experts (and, for ``gate_mass``,
  the gate activations the selected experts reuse); ``MoeRouter.forward`` calls it.
* ``macs(d, E, m)``: multiply-adds per token of scoring, and of one selected routed expert;
  ``ffn_macs`` turns them into a layer's cost, the one the plan reports (``core.allocation``) and
  the one the runtime counts (``MoeFFN.active_param_count``).
* ``init(...)``: its parameters from a partition (the values a conversion passes, else the
  paper's default), ``fit(...)``: a closed-form fit on calibration tokens where it has one.
* ``centroid(block)``: the EW Eq. 9 weights fine-tuning starts its softmax successor from.
* ``linear(block)``: ``(W, b)`` where the scores are ``x Wᵀ + b`` (the native decode kernel then
  scores, ranks and runs the block in one call), None otherwise.
* ``native``: whether a stock sparse-MoE gate (``softmax(x Wᵀ)``, transformers' Qwen2-MoE /
  Mixtral, llama.cpp's MoE architectures) computes the same scores; ``native_refusal`` says why not.

Adding a router kind: one class here, its entry in ``ROUTERS``, and its rows in
``tests/engine/test_router_registry.py`` (the cost test walks ``ROUTERS`` by itself).
"""

from __future__ import annotations

from typing import Any, ClassVar

COMBINES = ("sum", "weighted", "normalized", "scaled")


class Router:
    """A router kind (module docstring). Subclasses set ``name`` and override what differs."""

    name: ClassVar[str] = ""
    #: a stock ``softmax(x W^T)`` gate computes these scores (native HF and GGUF exports)
    native: ClassVar[bool] = False
    native_refusal: ClassVar[str] = ""
    #: the experts' gate/up blocks are stored column-major (``MoeExperts.column_major``): every
    #: router but gate_mass, whose scores need the gate rows of all experts in one GEMM
    column_major: ClassVar[bool] = True
    #: every partition method offers it (its parameters come from the experts or from a fit, not from
    #: one method's choice of neurons, as EW's centroids and CMoE's representatives do)
    any_partition: ClassVar[bool] = False
    #: its parameters are fitted on calibration tokens (``fit``), so a conversion reads them again
    fitted: ClassVar[bool] = False

    def parameters(self, E: int, d: int) -> dict[str, tuple[int, ...]]:
        return {"router_weight": (E, d)}

    def macs(self, d: int, E: int, m: int) -> tuple[int, int]:
        """``(scoring, one selected routed expert)`` multiply-adds per token."""
        return E * d, 3 * d * m

    def scores(self, block: Any, x: Any) -> tuple[Any, Any]:
        """``([T, E] scores, gate activations [T, E·m] or None)`` of ``x`` ``[T, d]``."""
        return x @ block.router_weight.t(), None

    def linear(self, block: Any) -> tuple[Any, Any] | None:
        """``(W [E, d], b [E] or None)`` where the scores are ``x Wᵀ + b`` (the native decode kernel computes
        them so, ``moelab_native.moe_ffn_decode``); None (the default, so that a new kind runs the torch path
        until it says otherwise) for a kind whose scores are not linear."""
        return None

    def init(self, E: int, d: int, gate_rows: Any, up_rows: Any, given: dict[str, Any]) -> dict[str, Any]:
        """Parameter values from a partition: ``gate_rows``/``up_rows`` ``[E, m, d]`` the routed
        experts' rows, ``given`` the values a conversion computed (a missing one: the default)."""
        return {"router_weight": _checked(given.get("router_weight"), gate_rows.mean(dim=1), (E, d), "router_weight")}

    def fit(self, x: Any, gate_rows: Any, up_rows: Any, act_fn: Any, hidden: Any = None) -> dict[str, Any] | None:
        """Parameters fitted on calibration inputs ``x`` ``[T, d]`` (called for a kind that is ``fitted``);
        ``hidden``: the experts' hidden activations ``act(g·x)·(u·x)`` ``[T, E·m]`` where the caller has them."""
        return None

    def centroid(self, block: Any) -> Any:
        """EW Eq. 9 weights ``[E, d]`` for a softmax router that replaces this one: the centroids of
        the experts' gate rows."""
        return block.experts.gate_up_proj[:, : block.expert_size].detach().mean(dim=1)


class CentroidRouter(Router):
    """EW Eq. 9: ``s = x W_routerᵀ`` with the experts' gate-row centroids; ranks, never weights."""

    name = "centroid"
    native = True

    def centroid(self, block: Any) -> Any:
        return block.router_weight.detach()

    def linear(self, block: Any) -> tuple[Any, Any] | None:
        return block.router_weight, None


class SoftmaxRouter(CentroidRouter):
    """EW Eq. 11: the same linear scores, trained; with a ``weighted`` combine the stock gate."""

    name = "softmax"


class RidgeRouter(Router):
    """moelab's closed-form router: ``s_e = w_e·x + b_e`` fitted by ridge regression to each expert's
    output mass on calibration tokens (``core.fitting`` docstring)."""

    name = "ridge"
    any_partition = True
    fitted = True
    native_refusal = "the ridge router adds an offset per expert, which a stock gate (softmax(x W), no bias) lacks"
    #: λ relative to the mean squared norm of the (bias-augmented) inputs
    LAMBDA = 1e-2

    def parameters(self, E: int, d: int) -> dict[str, tuple[int, ...]]:
        return {"router_weight": (E, d), "router_offset": (E,)}

    def macs(self, d: int, E: int, m: int) -> tuple[int, int]:
        return E * (d + 1), 3 * d * m

    def scores(self, block: Any, x: Any) -> tuple[Any, Any]:
        return block.router_offset.addmm(x, block.router_weight.t()), None  # F.linear's own addmm

    def linear(self, block: Any) -> tuple[Any, Any] | None:
        return block.router_weight, block.router_offset

    def init(self, E: int, d: int, gate_rows: Any, up_rows: Any, given: dict[str, Any]) -> dict[str, Any]:
        offset = given.get("router_offset")
        if E and (offset is None or tuple(offset.shape) != (E,)):
            raise ValueError(f"the ridge router needs router_offset [n_routed={E}]")
        return {**super().init(E, d, gate_rows, up_rows, given), "router_offset": offset}

    def fit(self, x: Any, gate_rows: Any, up_rows: Any, act_fn: Any, hidden: Any = None,
            lam: float | None = None) -> dict[str, Any]:
        """``[W b] = (X̃ᵀX̃ + λI)⁻¹ X̃ᵀ M``, ``X̃ = [X 1]``, ``M`` each expert's output mass
        ``Σ_{j∈e} |act(g_j·x) u_j·x|``, ``λ = lam · mean‖x̃‖²`` (``lam`` defaults to ``LAMBDA``); in float64, because ``XᵀX`` of
        thousands of tokens loses float32 digits."""
        import torch

        E, m, d = gate_rows.shape
        xf = x.float()
        if hidden is None:
            hidden = act_fn(xf @ gate_rows.reshape(E * m, d).float().t()) * (xf @ up_rows.reshape(E * m, d).float().t())
        mass = hidden.abs().reshape(-1, E, m).sum(-1).double()
        xd = x.double()
        col = xd.sum(0, keepdim=True)  # X̃ᵀX̃ and X̃ᵀM by blocks: no [T, d+1] copy of X̃
        gram = torch.cat([torch.cat([xd.t() @ xd, col.t()], 1),
                          torch.cat([col, torch.full((1, 1), float(len(x)), dtype=torch.float64)], 1)])
        rhs = torch.cat([xd.t() @ mass, mass.sum(0, keepdim=True)])
        reg = (self.LAMBDA if lam is None else lam) * float(torch.diagonal(gram).sum()) / len(x)
        sol = torch.linalg.solve(gram + reg * torch.eye(d + 1, dtype=torch.float64), rhs)  # [d+1, E]
        return {"router_weight": sol[:-1].t().float(), "router_offset": sol[-1].float()}


class RepresentativeRouter(Router):
    """CMoE Eq. 18: ``s_e = act(x W_g^R) · (x W_u^R)`` of each expert's representative neuron."""

    name = "representative"
    native_refusal = "the representative router scores act(x W_g) * (x W_u), not a linear softmax gate"

    def parameters(self, E: int, d: int) -> dict[str, tuple[int, ...]]:
        return {"router_gate": (E, d), "router_up": (E, d)}

    def macs(self, d: int, E: int, m: int) -> tuple[int, int]:
        return 2 * E * d, 3 * d * m

    def scores(self, block: Any, x: Any) -> tuple[Any, Any]:
        return block.act_fn(x @ block.router_gate.t()) * (x @ block.router_up.t()), None

    def init(self, E: int, d: int, gate_rows: Any, up_rows: Any, given: dict[str, Any]) -> dict[str, Any]:
        return {"router_gate": _checked(given.get("router_gate"), gate_rows.mean(dim=1), (E, d), "router_gate"),
                "router_up": _checked(given.get("router_up"), up_rows.mean(dim=1), (E, d), "router_up")}


class GateMassRouter(Router):
    """``s_e = Σ_{j∈e} |act(x W_gate_j)|``, exact: the gate of every routed neuron is computed once to
    score the experts, and a selected expert then adds only its up and down rows."""

    name = "gate_mass"
    any_partition = True
    column_major = False
    native_refusal = "the gate-mass router scores every expert by its gate activations, not a linear softmax gate"

    def parameters(self, E: int, d: int) -> dict[str, tuple[int, ...]]:
        return {}

    def macs(self, d: int, E: int, m: int) -> tuple[int, int]:
        return d * m * E, 2 * d * m

    def scores(self, block: Any, x: Any) -> tuple[Any, Any]:
        a = block.gate_activations(x)
        return a.abs().reshape(-1, block.n_routed, block.expert_size).sum(dim=-1), a

    def init(self, E: int, d: int, gate_rows: Any, up_rows: Any, given: dict[str, Any]) -> dict[str, Any]:
        return {}


ROUTERS: dict[str, Router] = {r.name: r for r in (CentroidRouter(), RepresentativeRouter(), GateMassRouter(),
                                                   SoftmaxRouter(), RidgeRouter())}


#: the routers every partition method offers beside its own (``Router.any_partition``)
PARTITION_ROUTERS: tuple[str, ...] = tuple(name for name, kind in ROUTERS.items() if kind.any_partition)


def router_kind(name: str) -> Router:
    try:
        return ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; one of {tuple(ROUTERS)}") from None


def kept(n: int, down_keep: float) -> int:
    """Neurons of a block of ``n`` whose down projection runs per token under ``down_keep``
    (``MoeFFN``): ``round(down_keep · n)``, at least one of a non-empty block."""
    return n if down_keep >= 1 else min(n, max(1, round(down_keep * n)))


def ffn_macs(d: int, d_shared: int, E: int, m: int, k: int, router: str, combine: str = "sum",
             down_keep: float = 1.0) -> int:
    """Multiply-adds per token of a sparse block (shared expert, router, ``k`` of ``E`` routed experts
    of ``m`` neurons); element-wise work (activations, combine weights, sums) is not counted. Under
    ``down_keep`` < 1 only ``kept`` neurons of each active expert pay their down projection's ``d``.

    A block that runs no routed expert (``k == 0``) runs no router; one that runs them all unweighted
    (``k ≥ E``, ``sum``) scores nothing; every other block scores all experts, so with ``k ≥ E`` and
    a weighted combine it pays the router too."""
    shared = 3 * d * d_shared - d * (d_shared - kept(d_shared, down_keep))
    if k == 0 or E == 0:
        return shared
    skipped_down = d * (m - kept(m, down_keep))
    if k >= E and combine == "sum":
        return shared + (3 * d * m - skipped_down) * E
    scoring, per_expert = router_kind(router).macs(d, E, m)
    return shared + scoring + min(k, E) * (per_expert - skipped_down)


def _checked(value: Any, default: Any, shape: tuple[int, ...], name: str) -> Any:
    w = default if value is None else value
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} must be [n_routed={shape[0]}, d_model={shape[1]}], got {tuple(w.shape)}")
    return w
