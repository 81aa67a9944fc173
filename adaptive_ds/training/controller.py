"""The adaptive controller: watches a run and answers with a `Verdict`; what it changes is its `Knobs`.

The controller is pure decision logic: it reads reports (a step's loss, a logging window's routing and
validation figures, an out-of-memory error), owns a small set of knobs that the engine and model must follow,
and writes every decision to OUTPUT_DIR/decisions.jsonl. It never touches the engine: the training loop applies
the knobs (`engine.apply_knobs`) and reacts to the verdict (continue, retry the step, roll back, stop).

Each behaviour is bounded and can be switched off in the `controller` object of the ds_config's `adaptive_ds`
block (see `ControllerSettings`):

- Memory: an out-of-memory error halves the micro-batch and doubles gradient accumulation (the global batch is
  unchanged) and the step is retried on the same data; at micro-batch 1 activation checkpointing is turned on;
  after that the run stops with what to change.
- Stability: a loss spike (beyond `spike_sigma` standard deviations of the last `spike_window` step losses) or
  `nonfinite_steps` non-finite losses in a row roll the run back to the last healthy checkpoint, scale the
  learning rate by `rollback_lr_factor` and skip the data that caused it; after `max_rollbacks` it stops. While
  the loss is non-finite or spiking the run is not `healthy`, and no checkpoint is saved. fp16 overflow steps
  skipped by DeepSpeed's loss scaler are counted, never judged as spikes nor kept as loss samples (the weights did
  not move); more than `max_overflow_steps` in a row stop the run. With `eval_steps`, a validation loss that stops
  improving scales the learning rate after `plateau_patience` evaluations and ends the run after
  `early_stopping_patience` (both off by default).
- Routing: while MoE load balance stays below `balance_threshold` for `balance_windows` logged windows, the
  aux-loss coefficient is multiplied by `aux_coef_factor` up to `aux_coef_max`, and lowered back toward the
  configured value once balance recovers; experts that stay dead are reported. MoD: with `mod_flops_target`,
  the capacity moves toward the FLOPs fraction asked for, within `mod_capacity_bounds`; otherwise it follows
  the configured schedule (linear from 1.0 over `mod_capacity_warmup_steps`).
"""

from __future__ import annotations

import enum
import json
import logging
import math
from dataclasses import asdict, dataclass, fields, replace

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The controller stopped the run; the message says why and what to change."""


@dataclass
class ControllerSettings:
    oom: bool = True
    spike: bool = True
    spike_sigma: float = 6.0
    spike_window: int = 20
    nonfinite_steps: int = 2
    rollback_lr_factor: float = 0.5
    max_rollbacks: int = 3
    max_overflow_steps: int = 50
    moe_balance: bool = True
    balance_threshold: float = 0.7
    balance_windows: int = 3
    aux_coef_factor: float = 2.0
    aux_coef_max: float = 0.1
    plateau_patience: int = 0  # evaluations without improvement before the LR is scaled (0: off)
    plateau_factor: float = 0.5
    early_stopping_patience: int = 0  # evaluations without improvement before training stops early (0: off)
    min_improvement: float = 1e-3
    mod_flops_target: float | None = None  # MoD: steer capacity so FLOPs / unrouted FLOPs approach this
    mod_capacity_bounds: tuple[float, float] = (0.125, 1.0)


def controller_settings(block: dict) -> ControllerSettings:
    valid = [f.name for f in fields(ControllerSettings)]
    unknown = sorted(set(block) - set(valid))
    if unknown:
        raise ValueError(f"unknown controller key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
    return ControllerSettings(**block)


@dataclass(frozen=True)
class Knobs:
    """What the engine and model follow; the controller's to change, the loop's to apply (`apply_knobs`)."""

    micro_batch: int
    accumulation: int
    activation_checkpointing: bool = False
    lr_scale: float = 1.0
    aux_coef: float | None = None  # MoE router_aux_loss_coef (None: no MoE layers)
    mod_capacity: float | None = None  # MoD training capacity (None: no MoD blocks)


class Action(enum.Enum):
    CONTINUE = "continue"
    RETRY_STEP = "retry the step"
    ROLL_BACK = "roll back"
    STOP = "stop"


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""
    failed: bool = False  # STOP: the run failed (non-zero exit) rather than ended as planned (early stopping)


CONTINUE = Verdict(Action.CONTINUE)


@dataclass(frozen=True)
class StepReport:
    step: int
    loss: float  # the step's LM loss over all ranks
    overflow: bool = False  # DeepSpeed's fp16 loss scaler skipped the step


@dataclass(frozen=True)
class WindowReport:
    step: int
    moe: dict | None = None  # RoutingWindow's "moe" statistics
    mod: dict | None = None  # RoutingWindow's "mod" statistics


def mod_capacity_at(step: int, target: float, warmup_steps: int) -> float:
    """Capacity schedule: linear from 1.0 at step 0 to `target` at `warmup_steps`, constant afterwards."""
    if step >= warmup_steps:
        return target
    return 1.0 + (target - 1.0) * step / warmup_steps


class Controller:
    """`defaults` are the knobs as configured, frozen at build time: "back toward the configured value" compares
    with them. `decisions_path` (rank 0) receives one JSON object per decision."""

    def __init__(self, settings: ControllerSettings, defaults: Knobs, decisions_path: str | None = None,
                 mod_capacity_warmup_steps: int = 0):
        self.settings, self.defaults = settings, defaults
        self.mod_capacity_warmup_steps = mod_capacity_warmup_steps
        self.knobs = defaults
        self.steered_capacity: float | None = None  # set by the FLOPs target; else the schedule decides
        self.rollbacks = 0
        self.best_validation: float | None = None
        self.evals_without_improvement = 0
        self.losses: list[float] = []  # recent healthy step losses (the spike window)
        self.nonfinite = 0
        self.spiking = False
        self.overflow_run = 0
        self.low_balance = 0
        self.dead_streak: dict[str, int] = {}
        self.decisions: list[dict] = []
        self._file = open(decisions_path, "a") if decisions_path else None  # closed in close()

    # the knobs of a step
    def knobs_at(self, step: int) -> Knobs:
        """The knobs for optimizer step `step` (1-based): the current ones, with the MoD capacity scheduled."""
        if self.defaults.mod_capacity is None:
            return self.knobs
        capacity = self.steered_capacity
        if capacity is None:
            capacity = mod_capacity_at(step - 1, self.defaults.mod_capacity, self.mod_capacity_warmup_steps)
        return replace(self.knobs, mod_capacity=capacity)

    @property
    def healthy(self) -> bool:
        """The last step's loss was finite and no spike: the weights are fit to be saved."""
        return self.nonfinite == 0 and not self.spiking

    def _decide(self, step: int, trigger: dict, action: str) -> None:
        record = {"step": step, "trigger": trigger, "action": action, "knobs": asdict(self.knobs)}
        self.decisions.append(record)
        logger.warning("controller at step %d: %s (%s)", step, action, trigger)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    # memory
    def start_micro_batch_search(self) -> None:
        """`--micro_batch auto`: the first step starts with the whole step's rows in one micro-batch."""
        rows = self.knobs.micro_batch * self.knobs.accumulation
        self.knobs = replace(self.knobs, micro_batch=rows, accumulation=1)
        self._decide(0, {"requested_rows_per_rank_step": rows},
                     "micro-batch auto: start at the whole step, halve on out-of-memory")

    def resplit(self, rows_per_rank: int, micro_batch: int | None = None) -> None:
        """Split a step's `rows_per_rank` into micro-batches of at most `micro_batch` rows (default: the micro-batch
        that worked), the largest divisor of the rows not above it: after a resume on another number of processes,
        or with another `--micro_batch`."""
        limit = min(micro_batch or self.knobs.micro_batch, rows_per_rank)
        micro = max(d for d in range(1, limit + 1) if rows_per_rank % d == 0)
        self.knobs = replace(self.knobs, micro_batch=micro, accumulation=rows_per_rank // micro)

    def on_oom(self, step: int, error: BaseException, phase: str = "forward") -> Verdict:
        """Halve the micro-batch (raising accumulation to keep the global batch), or turn on activation
        checkpointing, or stop. `phase` is where it failed: "forward", "backward" or "optimizer step"; an
        optimizer step may have updated part of the weights, so the step cannot be retried in place and the run
        rolls back to its last checkpoint instead (with the new knobs)."""
        trigger = {"error": f"{type(error).__name__}: {str(error)[:200]}", "phase": phase,
                   "micro_batch": self.knobs.micro_batch}
        if not self.settings.oom:
            return Verdict(Action.STOP, f"{trigger['error']} (the controller's oom rule is off)", failed=True)
        retry, then = Verdict(Action.RETRY_STEP), "retry the step"
        if phase == "optimizer step":
            retry, then = Verdict(Action.ROLL_BACK), "roll back to the last checkpoint (the update may be partial)"
        if self.knobs.micro_batch > 1:
            rows = self.knobs.micro_batch * self.knobs.accumulation
            # the largest divisor of the step's rows at most half the current micro-batch
            micro = max(d for d in range(1, self.knobs.micro_batch // 2 + 1) if rows % d == 0)
            self.knobs = replace(self.knobs, micro_batch=micro, accumulation=rows // micro)
            self._decide(step, trigger, f"halve micro-batch, double accumulation, {then}")
            return retry
        if not self.knobs.activation_checkpointing:
            self.knobs = replace(self.knobs, activation_checkpointing=True)
            self._decide(step, trigger, f"enable activation checkpointing, {then}")
            return retry
        self._decide(step, trigger, "stop")
        return Verdict(Action.STOP, "out of memory at micro-batch 1 with activation checkpointing; shorten the "
                       "sequence, raise the ZeRO stage, offload the optimizer (offload_optimizer) or pick a smaller "
                       "preset", failed=True)

    # stability
    def observe_step(self, report: StepReport) -> Verdict:
        """After every optimizer step: fp16 overflows, non-finite losses and spikes. A step DeepSpeed skipped
        (`overflow`) counts toward `max_overflow_steps`; with a finite loss it is not judged a spike and does not enter
        the spike window."""
        self.overflow_run = self.overflow_run + 1 if report.overflow else 0
        if self.overflow_run > self.settings.max_overflow_steps:
            self._decide(report.step, {"overflow_steps_in_a_row": self.overflow_run}, "stop")
            return Verdict(Action.STOP, f"{self.overflow_run} fp16 overflow steps in a row; use bf16, lower the "
                           "learning rate or set a lower initial_scale_power", failed=True)
        loss = report.loss
        self.nonfinite = 0 if math.isfinite(loss) else self.nonfinite + 1  # counted even with the rule off: health
        if not self.settings.spike:
            return CONTINUE
        if self.nonfinite:  # skipped or not: NaN weights make every step overflow, and only a rollback mends them
            if self.nonfinite >= self.settings.nonfinite_steps:
                return self._roll_back(report.step, {"non_finite_steps": self.nonfinite, "loss": str(loss)})
            return CONTINUE
        if report.overflow:  # skipped: the weights did not move, so its loss is neither a sample nor a spike to undo
            return CONTINUE
        window = self.losses[-self.settings.spike_window:]
        if len(window) >= self.settings.spike_window:
            mean = sum(window) / len(window)
            std = math.sqrt(sum((x - mean) ** 2 for x in window) / len(window))
            if loss > mean + self.settings.spike_sigma * max(std, 1e-3):
                self.spiking = True
                return self._roll_back(report.step, {"loss": loss, "window_mean": mean, "window_std": std,
                                                     "sigma": self.settings.spike_sigma})
        self.losses = [*window, loss][-self.settings.spike_window:]
        return CONTINUE

    def observe_steps(self, reports: list[StepReport]) -> tuple[int, Verdict]:
        """`observe_step` on a batch of steps in order (the loop reads its step losses from the device once per
        logging window, validation or save): how many of them it accepted, and its verdict on the first it did not
        (CONTINUE when it accepted all). The steps after one that rolls back or stops were never kept."""
        for accepted, report in enumerate(reports):
            verdict = self.observe_step(report)
            if verdict.action is not Action.CONTINUE:
                return accepted, verdict
        return len(reports), CONTINUE

    def _roll_back(self, step: int, trigger: dict) -> Verdict:
        if self.rollbacks >= self.settings.max_rollbacks:
            self._decide(step, trigger, "stop")
            return Verdict(Action.STOP, f"loss unstable after {self.rollbacks} rollbacks (last at step {step}); "
                           "lower the learning rate or raise warmup_steps", failed=True)
        self.rollbacks += 1
        self.knobs = replace(self.knobs, lr_scale=self.knobs.lr_scale * self.settings.rollback_lr_factor)
        self._decide(step, trigger, "roll back to the last healthy checkpoint, scale the learning rate, skip this "
                     "data")
        return Verdict(Action.ROLL_BACK)

    def rolled_back(self, saved: dict) -> None:
        """The loop restored the weights of a checkpoint whose controller state was `saved`: what the abandoned steps
        taught (their losses, validations and routing windows) no longer applies, so it is the checkpoint's again;
        what the controller decided since (its knobs, the capacity it steers, its count of rollbacks) stays."""
        decided = self.knobs, self.steered_capacity, self.rollbacks
        self.load_state_dict(saved)
        self.knobs, self.steered_capacity, self.rollbacks = decided
        self.nonfinite, self.spiking = 0, False  # a checkpoint is only written from healthy weights

    # logging windows: routing
    def observe_window(self, report: WindowReport) -> None:
        """After each logging window: the routing steers knobs (the aux-loss coefficient, the MoD capacity toward
        its FLOPs target) and reports dead experts. It returns no verdict: a knob reaches the engine before the next
        step (`Trainer.apply`), so a window never asks the loop to retry, roll back or stop, and a verdict that could
        only be CONTINUE would be one more thing for the loop to merge with the validation's."""
        if report.moe:
            self._observe_moe(report.step, report.moe)
        if report.mod:
            self._observe_mod(report.step, report.mod)

    def _observe_moe(self, step: int, moe: dict) -> None:
        if not self.settings.moe_balance:
            return
        dead = set(moe.get("dead_experts", []))
        self.dead_streak = {e: self.dead_streak.get(e, 0) + 1 for e in dead}
        for expert, windows in sorted(self.dead_streak.items()):
            if windows == self.settings.balance_windows:
                self._decide(step, {"dead_expert": expert, "windows": windows}, "report dead expert")
        if self.knobs.aux_coef is None:  # bias balancing (moe_balancing "bias"): no aux-loss coefficient to move
            return
        coef, configured = self.knobs.aux_coef, self.defaults.aux_coef
        balance = moe["load_balance"]
        trigger = {"load_balance": balance, "threshold": self.settings.balance_threshold}
        if balance < self.settings.balance_threshold:
            self.low_balance += 1
            if self.low_balance >= self.settings.balance_windows and coef < self.settings.aux_coef_max:
                self.knobs = replace(self.knobs, aux_coef=min(coef * self.settings.aux_coef_factor,
                                                              self.settings.aux_coef_max))
                self.low_balance = 0
                self._decide(step, trigger, "raise the aux-loss coefficient")
        else:
            self.low_balance = 0
            if coef > configured:
                self.knobs = replace(self.knobs, aux_coef=max(coef / self.settings.aux_coef_factor, configured))
                self._decide(step, trigger, "lower the aux-loss coefficient")

    def _observe_mod(self, step: int, mod: dict) -> None:
        """Move the capacity toward the FLOPs target (FLOPs / unrouted FLOPs), within bounds."""
        target = self.settings.mod_flops_target
        if target is None:
            return
        low, high = self.settings.mod_capacity_bounds
        capacity = mod["capacity"]
        measured = 1.0 - mod["flops_reduction"]
        new = min(max(capacity + 0.5 * (target - measured), low), high)
        if abs(new - capacity) < 1e-3:
            return
        self.steered_capacity = new
        self._decide(step, {"flops_fraction": measured, "target": target, "capacity": capacity},
                     "adjust MoD capacity")

    # validation
    def observe_validation(self, step: int, loss: float) -> Verdict:
        """After each validation (its own cadence, `eval_steps`). Plateau: scale the LR after `plateau_patience`
        evaluations without improvement; stop after `early_stopping_patience` of them."""
        if self.best_validation is None or loss < self.best_validation - self.settings.min_improvement:
            self.best_validation = loss
            self.evals_without_improvement = 0
            return CONTINUE
        self.evals_without_improvement += 1
        waited = self.evals_without_improvement
        trigger = {"validation_loss": loss, "best": self.best_validation, "evaluations_without_improvement": waited}
        if self.settings.early_stopping_patience and waited >= self.settings.early_stopping_patience:
            self._decide(step, trigger, "stop early")
            return Verdict(Action.STOP, f"validation loss has not improved for {waited} evaluations")
        if self.settings.plateau_patience and waited % self.settings.plateau_patience == 0:
            self.knobs = replace(self.knobs, lr_scale=self.knobs.lr_scale * self.settings.plateau_factor)
            self._decide(step, trigger, "scale the learning rate (plateau)")
        return CONTINUE

    # persistence
    _STATE = ("steered_capacity", "rollbacks", "best_validation", "evals_without_improvement", "losses",
              "nonfinite", "spiking", "overflow_run", "low_balance", "dead_streak")

    def state_dict(self) -> dict:
        """Everything a resumed run needs to decide as this one would (JSON-serialisable)."""
        return {"knobs": asdict(self.knobs), **{name: getattr(self, name) for name in self._STATE}}

    def load_state_dict(self, state: dict) -> None:
        self.knobs = Knobs(**state["knobs"])
        for name in self._STATE:
            setattr(self, name, state[name])

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
