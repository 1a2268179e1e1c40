"""The parameters of a recovery fine-tune (``training.finetune``), declared once with ``param``.

Kept apart from the trainer, which needs torch: the API generates the ``POST /finetunes`` body from
these declarations (``backend.schemas``) and must not import torch to do so; ``moelab finetune``
generates its options from them too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

from ..core.params import DeclaredParams, from_known_fields, param
from ..limits import lora_rank_problem, seq_len_problem
from ..methods import REGISTRY, Recovery

#: Recovery modes: the registered methods that declare a ``Recovery`` (``methods.base``).
MODES: tuple[str, ...] = tuple(name for name, m in REGISTRY.items() if m.recovery is not None)
FinetuneMode = Literal[MODES]  # type: ignore[valid-type]
#: Held-out text when the training source is not a built-in set (only built-ins have a held-out split).
DEFAULT_EVAL_SOURCE = "builtin:mixed"


class FinetuneError(ValueError):
    """The fine-tuning cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class FinetuneParams(DeclaredParams):
    """Hyper-parameters of a recovery fine-tune (``training.finetune``'s docstring describes each
    mode). The CLI options of ``moelab finetune`` and the fields of ``POST /finetunes`` are
    generated from these declarations.

    Defaults follow CM §4 where it gives a value (LoRA rank 8, alpha 32, router-scale lr 1e-3,
    γ = 1e-3, Adam β = 0.9, 0.95). The LoRA lr is 5e-4, not CM's 5.95e-5: CM trains one epoch
    over 2,048 samples, this run 60 steps of 4 × 256 tokens (61k tokens), about 9 s a step and
    10 minutes in all for the default model on 2 CPU cores; cmoe then took the held-out
    perplexity from 29.8 to 18.1 (dense 12.9, 8 windows). tests/benchmarks/bench_recovery.py
    measures every mode.
    """

    error: ClassVar[type[Exception]] = FinetuneError

    mode: FinetuneMode = param("cmoe", "what is trained and how: the recovery of the method of that name")
    steps: int = param(60, "optimizer steps", ge=1, le=100_000)
    batch_size: int = param(4, "sequences per step", ge=1, le=1024)
    seq_len: int = param(256, "tokens per sequence", ge=8, le=32768)
    lr: float = param(5e-4, "learning rate of the LoRA adapters (and experts); CM uses 5.95e-5 on 7B models",
                      paper="CM §4", gt=0, le=1)
    router_lr: float = param(1e-3, "learning rate of the routers: scale u (cmoe), router weights (expertweaver, midas), "
                             "router weights and u (dense2moe)", paper="CM §4", gt=0, le=1)
    lora_rank: int = param(8, "LoRA rank r; 0: no adapters (expertweaver then trains its routers only; cmoe and midas "
                           "need ≥ 1)", paper="CM §4", ge=0, le=4096)
    lora_alpha: float = param(32.0, "LoRA alpha (the adapters are scaled by alpha / r)", paper="CM §4", gt=0, le=1e6)
    lb_coef: float = param(0.01, "λ of the load-balancing loss L_NTP + λ·L_LB; 0 switches it off; not used by cmoe "
                           "(bias balancing instead)", paper="EW Eq. 12", ge=0, le=100)
    bias_step: float = param(1e-3, "γ: per-step update of the routing bias b (cmoe only); 0 switches it off",
                             paper="CM §3.3, AF Eq. 9", ge=0, le=1)
    checkpoint_every: int = param(20, "steps between checkpoints (a cancelled run resumes from the latest)",
                                  ge=1, le=100_000)
    warmup: float = param(0.1, "share of the steps with a linear learning-rate warm-up (every group)", ge=0, lt=1)
    router_first: float = param(0.0, "share of the steps that train the routers only, before the adapters start "
                                "(their lr is 0 until then)", ge=0, lt=1)
    source: str = param("builtin:mixed", "training text: builtin:NAME (its calibration split) or a stored calibration set")
    eval_source: str | None = param(None, "held-out text for perplexity before / after / dense: builtin:NAME (its held-out "
                                    "split); unset: source when it is a built-in, else builtin:mixed")
    eval_windows: int = param(16, "held-out windows for perplexity before / after / dense", ge=1, le=4096)
    seed: int = param(0, "seed of the training-window order and of the adapters' initialisation", ge=0)
    distill: float = param(0.0, "weight w of distillation from the dense model the conversion was made from: loss = "
                           "(1 − w)·L_NTP + w·KL(dense ‖ converted) per token; 0: next-token loss alone, as the papers "
                           "train", ge=0, le=1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FinetuneParams":
        return from_known_fields(cls, d, "fine-tuning", FinetuneError)

    @property
    def uses_lora(self) -> bool:
        return self.recovery.lora != "off" and self.lora_rank > 0

    @property
    def lb_used(self) -> float:
        """λ actually applied: CMoE balances with the bias b instead (AF §4.3)."""
        return float(self.lb_coef) if self.recovery.load_balance else 0.0

    @property
    def recovery(self) -> Recovery:
        """How this mode trains (the method's ``Recovery`` declaration)."""
        rec = REGISTRY[self.mode].recovery if self.mode in REGISTRY else None
        if rec is None:
            raise FinetuneError(f"mode={self.mode!r}: use one of {', '.join(MODES)}")
        return rec

    def heldout_source(self) -> str:
        """``eval_source``, else ``source`` when it is a built-in set, else builtin:mixed."""
        if self.eval_source:
            return self.eval_source
        return self.source if self.source.startswith("builtin:") else DEFAULT_EVAL_SOURCE

    def _check(self) -> None:
        """The rules that relate several fields (each field's own bounds come from its declaration)."""
        if self.recovery.lora == "required" and self.lora_rank == 0:
            raise FinetuneError(f"mode {self.mode!r} trains LoRA adapters: use lora_rank ≥ 1")
        if not self.source.strip():
            raise FinetuneError("source is empty: use builtin:NAME or a stored calibration set directory")
        held = self.heldout_source()
        if not held.startswith("builtin:"):
            raise FinetuneError(
                f"eval_source={held!r}: perplexity needs held-out text, which only built-in sets have; use "
                "builtin:NAME (e.g. builtin:mixed)"
            )

    #: The name the runs, the routes and the CLI call: every field against its declaration, then ``_check``.
    validate = DeclaredParams.check

    def validate_for(self, config: dict[str, Any] | None) -> None:
        """The rules that need the conversion's model (its ``config.json``, read as JSON: no torch): a LoRA rank
        above d_model only adds memory (rank 4096 on d_model 576 reached 12.7 GB), and sequences longer than
        ``max_position_embeddings`` leave the positions the model was trained on."""
        if not isinstance(config, dict):
            return
        what = "the conversion's model"
        problem = lora_rank_problem(self.lora_rank, config, what=what) or seq_len_problem(self.seq_len, config, what=what)
        if problem:
            raise FinetuneError(problem)
