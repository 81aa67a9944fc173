"""The adaptive controller: watches a run and acts, every decision written to OUTPUT_DIR/decisions.jsonl.

Each behaviour is bounded and can be switched off in the `controller` object of the ds_config's
`adaptive_ds` block (see `ControllerSettings`). Faults for tests are injected through `faults` there.

- Memory: an out-of-memory error in a step frees what the step held, halves the micro-batch and doubles
  gradient accumulation (the global batch is unchanged) and retries the same step on the same data; at
  micro-batch 1 it turns on activation checkpointing; after that it stops with what to change.
- Stability: a loss spike (beyond `spike_sigma` standard deviations of the last `spike_window` step losses)
  or `nonfinite_steps` non-finite losses in a row roll the run back to the last checkpoint, scale the
  learning rate by `rollback_lr_factor` and skip the data that caused it; after `max_rollbacks`, it stops.
  fp16 overflow steps skipped by DeepSpeed's loss scaler are counted (`skipped_steps` in metrics.jsonl); more
  than `max_overflow_steps` in a row stops the run. With `eval_steps`, a validation loss that stops improving
  scales the learning rate after `plateau_patience` evaluations and ends the run after
  `early_stopping_patience` (both off by default).
- Micro-batch search (`--micro_batch auto`): the first step starts with the whole step's rows in one
  micro-batch and the out-of-memory rule halves it until it fits.
- Routing: while MoE load balance stays below `balance_threshold` for `balance_windows` logged windows, the
  aux-loss coefficient is multiplied by `aux_coef_factor` up to `aux_coef_max`, and lowered back toward its
  configured value once balance recovers; experts that stay dead are reported. MoD: with `mod_flops_target`,
  the capacity moves toward the FLOPs fraction asked for, within `mod_capacity_bounds`; otherwise it follows
  the configured schedule.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field, fields

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The controller stopped the run; the message says why and what to change."""


class SimulatedOOM(RuntimeError):
    """An injected out-of-memory error (CPU tests); handled exactly like torch.OutOfMemoryError."""


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
    faults: dict = field(default_factory=dict)  # oom_micro_batch_above, oom_from_step, spike_at_step, nan_at_steps


def controller_settings(block: dict) -> ControllerSettings:
    valid = [f.name for f in fields(ControllerSettings)]
    unknown = sorted(set(block) - set(valid))
    if unknown:
        raise ValueError(f"unknown controller key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
    return ControllerSettings(**block)


@dataclass
class ControllerState:
    """What the controller changed; saved in every checkpoint so a resumed run starts from it."""

    micro_batch: int
    accumulation: int
    activation_checkpointing: bool = False
    lr_scale: float = 1.0
    aux_coef: float | None = None
    rollbacks: int = 0
    mod_capacity: float | None = None
    best_validation: float | None = None
    evals_without_improvement: int = 0


class Controller:
    def __init__(self, settings: ControllerSettings, state: ControllerState, output_dir: str | None):
        self.settings = settings
        self.state = state
        self._file = open(os.path.join(output_dir, "decisions.jsonl"), "a") if output_dir else None
        self.losses: list[float] = []
        self.nonfinite = 0
        self.overflow_run = 0
        self.low_balance = 0
        self.dead_streak: dict[str, int] = {}

    def decide(self, step: int, trigger: dict, action: str) -> None:
        record = {"step": step, "trigger": trigger, "action": action, "settings": asdict(self.state)}
        logger.warning("controller at step %d: %s (%s)", step, action, trigger)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    # memory
    def inject_oom(self, step: int, micro_batch: int) -> None:
        faults = self.settings.faults
        if "oom_micro_batch_above" in faults and step >= faults.get("oom_from_step", 1) \
                and micro_batch > faults["oom_micro_batch_above"]:
            raise SimulatedOOM(f"injected out-of-memory at micro-batch {micro_batch}")

    def on_oom(self, step: int, error: Exception) -> str:
        """Halve the micro-batch (raising accumulation to keep the global batch), or turn on activation
        checkpointing, or stop."""
        if not self.settings.oom:
            raise error
        trigger = {"error": f"{type(error).__name__}: {str(error)[:200]}", "micro_batch": self.state.micro_batch}
        if self.state.micro_batch > 1:
            rows = self.state.micro_batch * self.state.accumulation
            # the largest divisor of the step's rows at most half the current micro-batch
            self.state.micro_batch = max(d for d in range(1, self.state.micro_batch // 2 + 1) if rows % d == 0)
            self.state.accumulation = rows // self.state.micro_batch
            self.decide(step, trigger, "halve micro-batch, double accumulation, retry the step")
            return "halve"
        if not self.state.activation_checkpointing:
            self.state.activation_checkpointing = True
            self.decide(step, trigger, "enable activation checkpointing, retry the step")
            return "checkpointing"
        self.decide(step, trigger, "stop")
        raise TrainingStopped("out of memory at micro-batch 1 with activation checkpointing; shorten the sequence, "
                              "raise the ZeRO stage, offload the optimizer (offload_optimizer) or pick a smaller "
                              "preset")

    # stability
    def observe_loss(self, step: int, loss: float) -> str | None:
        """'rollback' when the loss spiked or stayed non-finite, else None (and the loss joins the window)."""
        faults = self.settings.faults
        if faults.get("spike_at_step") == step:
            loss = loss * 10 + 10
        if step in faults.get("nan_at_steps", []):
            loss = float("nan")
        if not self.settings.spike:
            return None
        if not math.isfinite(loss):
            self.nonfinite += 1
            if self.nonfinite >= self.settings.nonfinite_steps:
                return self._rollback(step, {"non_finite_steps": self.nonfinite, "loss": str(loss)})
            return None
        self.nonfinite = 0
        window = self.losses[-self.settings.spike_window:]
        if len(window) >= self.settings.spike_window:
            mean = sum(window) / len(window)
            std = math.sqrt(sum((x - mean) ** 2 for x in window) / len(window))
            if loss > mean + self.settings.spike_sigma * max(std, 1e-3):
                return self._rollback(step, {"loss": loss, "window_mean": mean, "window_std": std,
                                             "sigma": self.settings.spike_sigma})
        self.losses.append(loss)
        return None

    def _rollback(self, step: int, trigger: dict) -> str:
        if self.state.rollbacks >= self.settings.max_rollbacks:
            self.decide(step, trigger, "stop")
            raise TrainingStopped(f"loss unstable after {self.state.rollbacks} rollbacks (last at step {step}); "
                                  "lower the learning rate or raise warmup_steps")
        self.state.rollbacks += 1
        self.state.lr_scale *= self.settings.rollback_lr_factor
        self.decide(step, trigger, "roll back to the last checkpoint, scale the learning rate, skip this data")
        self.losses.clear()
        self.nonfinite = 0
        return "rollback"

    def observe_overflow(self, step: int, skipped: bool) -> None:
        self.overflow_run = self.overflow_run + 1 if skipped else 0
        if self.overflow_run > self.settings.max_overflow_steps:
            self.decide(step, {"overflow_steps_in_a_row": self.overflow_run}, "stop")
            raise TrainingStopped(f"{self.overflow_run} fp16 overflow steps in a row; use bf16, lower the learning "
                                  "rate or set a lower initial_scale_power")

    # routing
    def observe_routing(self, step: int, moe: dict, configured_coef: float) -> float | None:
        """A new aux-loss coefficient, or None to keep it."""
        if not self.settings.moe_balance or not moe:
            return None
        for expert in moe.get("dead_experts", []):
            self.dead_streak[expert] = self.dead_streak.get(expert, 0) + 1
            if self.dead_streak[expert] == self.settings.balance_windows:
                self.decide(step, {"dead_expert": expert, "windows": self.dead_streak[expert]}, "report dead expert")
        for expert in list(self.dead_streak):
            if expert not in moe.get("dead_experts", []):
                del self.dead_streak[expert]
        coef = self.state.aux_coef if self.state.aux_coef is not None else configured_coef
        balance = moe["load_balance"]
        if balance < self.settings.balance_threshold:
            self.low_balance += 1
            if self.low_balance >= self.settings.balance_windows and coef < self.settings.aux_coef_max:
                self.state.aux_coef = min(coef * self.settings.aux_coef_factor, self.settings.aux_coef_max)
                self.low_balance = 0
                self.decide(step, {"load_balance": balance, "threshold": self.settings.balance_threshold},
                            "raise the aux-loss coefficient")
                return self.state.aux_coef
        else:
            self.low_balance = 0
            if coef > configured_coef:
                self.state.aux_coef = max(coef / self.settings.aux_coef_factor, configured_coef)
                self.decide(step, {"load_balance": balance, "threshold": self.settings.balance_threshold},
                            "lower the aux-loss coefficient")
                return self.state.aux_coef
        return None

    def observe_validation(self, step: int, loss: float) -> str | None:
        """Plateau: scale the LR after `plateau_patience` evaluations without improvement; 'stop' after
        `early_stopping_patience` of them."""
        if self.state.best_validation is None or loss < self.state.best_validation - self.settings.min_improvement:
            self.state.best_validation = loss
            self.state.evals_without_improvement = 0
            return None
        self.state.evals_without_improvement += 1
        waited = self.state.evals_without_improvement
        trigger = {"validation_loss": loss, "best": self.state.best_validation,
                   "evaluations_without_improvement": waited}
        if self.settings.early_stopping_patience and waited >= self.settings.early_stopping_patience:
            self.decide(step, trigger, "stop early")
            return "stop"
        if self.settings.plateau_patience and waited % self.settings.plateau_patience == 0:
            self.state.lr_scale *= self.settings.plateau_factor
            self.decide(step, trigger, "scale the learning rate (plateau)")
            return "lr"
        return None

    def observe_mod(self, step: int, mod: dict, capacity: float) -> float | None:
        """MoD: move the capacity toward the FLOPs target (FLOPs / unrouted FLOPs), within bounds."""
        target = self.settings.mod_flops_target
        if target is None or not mod:
            return None
        low, high = self.settings.mod_capacity_bounds
        measured = 1.0 - mod["flops_reduction"]
        new = min(max(capacity + 0.5 * (target - measured), low), high)
        if abs(new - capacity) < 1e-3:
            return None
        self.state.mod_capacity = new
        self.decide(step, {"flops_fraction": measured, "target": target}, "adjust MoD capacity")
        return new

    def close(self) -> None:
        if self._file:
            self._file.close()
