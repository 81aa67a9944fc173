"""The metrics processor: what the loop measures between two logging windows, and when it reaches the host.

It owns the step losses still on the device (`pending`), the logging window (`LossWindow`), the routing window
(`RoutingWindow`) and the progress bar, and it decides when the step losses are read: in one transfer where a
logging window, a validation or a checkpoint needs them (`reads_at`), never once a step. Reading them is where the
controller judges them (spikes, non-finite losses), in order; closing a logging window (`close_window`) is where the
controller sees the routing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import distributed
from ..data.embedded import describe_captured
from .controller import Controller, StepReport, Verdict, WindowReport
from .metrics import LossWindow, MetricsWriter, PhaseClock, RoutingWindow

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    loss: torch.Tensor  # the step's LM loss per target token over all ranks (a device scalar)
    overflow: bool  # DeepSpeed's fp16 loss scaler skipped the step


class MetricsProcessor:
    """`needs_losses`: the other components that need the step losses on the host after a step (a validation's early
    stopping; a checkpoint, which is written from healthy weights only), asked at every step. Its state in a
    checkpoint is the latest kept step's loss."""

    def __init__(self, writer: MetricsWriter, clock: PhaseClock, controller: Controller, config, statistics,
                 max_steps: int, tokens_per_step: int, needs_losses: tuple[Callable[[int], bool], ...] = ()):
        self.writer, self.clock, self.controller, self.config = writer, clock, controller, config
        self.statistics = statistics  # the corpus's entropy floor, where it is known (None elsewhere)
        self.max_steps, self.tokens_per_step, self.needs_losses = max_steps, tokens_per_step, needs_losses
        self.window = LossWindow(clock)
        self.routing = RoutingWindow(config)
        self.pending: list[tuple[int, StepResult]] = []  # steps whose losses are still on the device
        self.last_loss = math.nan  # the latest kept step's loss, which its checkpoint records
        self.train_loss = math.nan  # the latest logging window's mean loss (the summary's)
        self._bar = None

    # state
    def state_dict(self) -> dict:
        return {"loss": self.last_loss}

    def load_state_dict(self, saved: dict) -> None:
        self.last_loss = saved["loss"]

    @contextmanager
    def displaying(self, start_step: int, rank: int):
        """The progress bar while the loop runs, closed whatever ends it, so that a last line (a stop's) starts a
        line of its own; the logging window starts here."""
        with tqdm(total=self.max_steps, initial=start_step, disable=rank != 0, dynamic_ncols=True,
                  desc="train") as bar, logging_redirect_tqdm(loggers=[logging.getLogger("adaptive_ds")]):
            self._bar, self.train_loss = bar, self.last_loss  # a finished run resumed trains no step
            self.window.restart()
            try:
                yield
            finally:
                self._bar = None

    # a step
    def add_routing(self, samples: list) -> None:
        """A step's routing statistics, one sample per micro-batch: only once the whole step succeeded, so that a
        retried step counts once."""
        for sample in samples:
            self.routing.add(sample)

    def add_step(self, step: int, result: StepResult) -> None:
        """A trained step: its tokens count now, its loss once it is read."""
        self.pending.append((step, result))
        self.window.add_tokens(self.tokens_per_step)
        self._bar.update(1)

    def logs_at(self, step: int) -> bool:
        """The logging cadence: every `log_steps` steps and the run's last step (the same on every rank)."""
        return self.writer.should_log(step, self.max_steps)

    def reads_at(self, step: int, stopping: bool) -> bool:
        """Whether the step losses go to the host after `step`: where something needs them (its logging window,
        the components of `needs_losses`, a stop) and at the run's last step."""
        return (stopping or step == self.max_steps or self.logs_at(step)
                or any(needs(step) for needs in self.needs_losses))

    @property
    def unread(self) -> bool:
        """Some step's loss is still on the device: nothing can judge that step yet."""
        return bool(self.pending)

    def read(self) -> Verdict:
        """The pending steps' losses from the device in one transfer, then the controller's verdict on them in
        order (their spikes and non-finite losses); the losses it accepted join the logging window."""
        with self.clock.phase("train"):  # it waits for the device to finish the steps
            steps, self.pending = self.pending, []
            losses = torch.stack([result.loss for _, result in steps]).tolist()  # the one host read of these steps
            accepted, verdict = self.controller.observe_steps(
                [StepReport(step, loss, result.overflow) for (step, result), loss in zip(steps, losses, strict=True)])
            self.window.add_losses(losses[:accepted])
            if accepted:
                self.last_loss = losses[accepted - 1]  # what the checkpoint of the latest kept step records
        return verdict

    def rewind(self, step: int, back: int) -> None:
        """A rollback at `step` to the checkpoint of step `back`: the steps after it are undone (their records move
        to abandoned_metrics.jsonl, their losses and routing are forgotten)."""
        self.writer.rewind(back, f"rolled back at step {step} to the checkpoint at step {back}")
        self.routing.reset()
        self.pending = []
        self._bar.n = back
        self.window.restart()

    # records
    def close_window(self, step: int, knobs, facts: dict) -> dict:
        """Close the logging window that ends at `step`: returns its record (mean loss, speed and routing, with the
        engine's `facts`: learning rate, split, skipped steps, failed saves), shows the controller its routing
        (collective: every rank logs at the same steps) and starts the next window. The routing window steers knobs
        only, so it asks nothing of the loop."""
        window = self.window
        record = {"loss": window.mean_loss(), **facts, "tokens_per_s": window.tokens_per_s(),
                  "window_s": window.busy_seconds(), **self.routing.summary()}
        if knobs.mod_capacity is not None:  # a model with MoD blocks
            record["mod"]["capacity"] = knobs.mod_capacity
        stats = self.statistics
        if stats:
            record.update(entropy_floor=stats.entropy_floor, captured=stats.captured(record["loss"]))
        self.controller.observe_window(WindowReport(step, record.get("moe"), record.get("mod")))
        self.routing.reset()
        window.restart()
        return record

    def write(self, step: int, record: dict) -> None:
        """The step's one metrics.jsonl record (its validation, its logging window, or both) and its log line."""
        self.writer.write({"step": step, "tokens_seen": step * self.tokens_per_step,
                           "elapsed_s": self.clock.elapsed(), **distributed.restart_counts(), **record})
        val = f" validation {record['validation_loss']:.4f}" if "validation_loss" in record else ""
        if "loss" not in record:
            logger.info("step %d/%d%s", step, self.max_steps, val)
            return
        self.train_loss = record["loss"]
        self._bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        stats = self.statistics
        floor = (f" (floor {stats.entropy_floor:.3f}, {describe_captured(record['captured'], short=True)})" if stats
                 else "")
        logger.info("step %d/%d loss %.4f%s%s lr %.2e %.0f tokens/s", step, self.max_steps, record["loss"], floor,
                    val, record["lr"], record["tokens_per_s"])

    def amend(self, step: int, fields: dict) -> None:
        self.writer.amend(step, fields)

    def close(self) -> None:
        self.writer.close()
