"""The training run: build once, then one way through every step.

    batch -> engine (forward, backward, step) -> step report -> controller verdict -> metrics, validation and
    checkpoint, each at its own cadence -> the controller's knobs applied in one place before the next step.

Host synchronisations: the step losses stay on the device and reach the host in one transfer where a logging
window, a validation or a checkpoint needs them (`_read_losses`), so the loop adds none per step. What remains per
step is not the loop's: DeepSpeed's ZeRO optimizer reads its overflow check and the gradient norm it clips by
(`engine.step()`, one or two reads); MoE layers read their expert loads to size their rows, once per layer and
micro-batch on the per-expert path (none with the grouped GEMM), twice per layer and micro-batch with experts on
other ranks (the all-to-all's splits); MoD blocks read their routed width in evaluation only (causal routing).
Routing statistics are read once per logging window (`RoutingWindow.summary`).

Outputs in OUTPUT_DIR: metrics.jsonl (one record per step that logged its window or validated; a record without
"loss" is a validation only), summary.json, final/ (save_pretrained), checkpoints/ (DeepSpeed checkpoints; a run
started again with the same command continues from the latest).
"""

from __future__ import annotations

import logging
import math
import os
import signal
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import distributed
from ..ds_config import read as read_ds_config
from ..export.hub import HubPusher, model_card
from ..presets import PRESETS, parameter_counts
from . import checkpoint, final, startup
from .arguments import ConfigError, parse
from .controller import (
    Action,
    Controller,
    StepReport,
    TrainingStopped,
    Verdict,
    WindowReport,
    controller_settings,
    strongest,
)
from .engine import apply_knobs, build_engine, configured_knobs, discard_partial_step
from .metrics import LossWindow, MetricsWriter, PhaseClock, RoutingWindow, peak_memory, plot_losses, write_summary
from .moe_adapter import expert_parallel_group
from .output_dir import prepare_output_dir, write_identity
from .stop import StopRequest, StopRequested
from .validation import Validator

logger = logging.getLogger(__name__)


class TrainerHooks:
    """Points where tests inject real faults (tests/helpers/faults.py); the production run installs none."""

    def before_step(self, trainer: Trainer, step: int) -> None: ...

    def before_micro_batch(self, trainer: Trainer, step: int, index: int, micro_batch: int) -> None: ...


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a RuntimeError) under a memory limit."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))


@dataclass
class StepResult:
    loss: torch.Tensor  # the step's LM loss per target token over all ranks (a device scalar)
    overflow: bool  # DeepSpeed's fp16 loss scaler skipped the step


class Trainer:
    """One training run. Construction does everything that can fail on bad input or a bad checkpoint (settings,
    process group, data, model, output directory, engine, controller); `run` trains."""

    def __init__(self, argv: list[str] | None, clock: PhaseClock, hub_api=None, hooks: TrainerHooks | None = None):
        self.clock, self.hooks = clock, hooks or TrainerHooks()
        # Validate before joining the process group: bad input should cost nothing and touch nothing.
        settings, ds_config = parse(argv, int(os.environ.get("WORLD_SIZE", "1")))
        self.settings = settings  # its max_steps is resolved below, once the global batch the run keeps is known
        distributed.init_distributed(settings.collective_timeout_s)
        self.rank, self.world = distributed.rank(), distributed.world_size()
        startup.prepare_device(settings, ds_config)
        self.source = startup.open_source(settings)  # pretrained weights to start from (--init_from), or None
        seq_len = self.source.seq_len(settings.preset) if self.source else PRESETS[settings.preset].seq_len
        layout = read_ds_config(ds_config)
        self.validation_micro_batch = layout.micro_batch  # the held-out set: eval_batches of the ds_config's size
        self.rows_per_step = layout.rows_per_rank_step * self.world  # the global batch, constant whatever the split
        self.configured_rows_per_rank = layout.rows_per_rank_step  # the ds_config's, before a resume keeps another
        self.data = startup.load_data(settings, seq_len)  # setup: the "data" phase is the loop's wait for batches
        self.config = startup.model_config_of(settings, self.source, self.data.tokenizer)
        # the held-out batches too, before the output directory: data without a held-out document is refused first
        self.validation_batches = self.data.validation_batches(self.validation_micro_batch, settings.eval_batches)
        self.base_model = startup.base_model_record(self.source, settings.output_dir, self.rank)
        self.identity = checkpoint.run_identity(settings, self.world, layout.rows_per_rank_step, self.config,
                                                self.base_model)
        self.output_dir, self.resume_tag = prepare_output_dir(settings, self.identity)
        distributed.progress.rerun = ("rerun the same command" if settings.output_dir else
                                      f"rerun the same command with --output_dir {self.output_dir}")
        if self.resume_tag:  # checked before anything is written
            saved = checkpoint.check_resumable(self.output_dir, self.resume_tag, self.identity)
            self._keep_the_checkpoints_global_batch(ds_config, saved)
        # The run's length, once, from the global batch it keeps (a resume on another layout keeps the checkpoint's)
        self.settings = settings = startup.resolve_steps(settings, self.config, self.tokens_per_step)
        startup.warn_about_warmup(settings)
        # a resume loads the run's own checkpoint, never the --init_from weights
        model = startup.build_model(self.config, settings, None if self.resume_tag else self.source, self.rank)
        self.engine = build_engine(model, ds_config, settings.warmup_steps, settings.max_steps,
                                   settings.min_lr_ratio, settings.compile)
        if self.config.expert_parallel_size > 1:
            ep_rank = dist.get_rank(expert_parallel_group(self.engine.module))
            assert ep_rank == self.rank % self.config.moe_ep_size, (ep_rank, self.rank)
        distributed.bound_collectives(settings.collective_timeout_s)  # DeepSpeed's own process groups too
        self.base_lrs = list(self.engine.lr_scheduler.base_lrs)  # the schedule's peaks, before any knob
        self._build_components(hub_api)

    @property
    def tokens_per_step(self) -> int:
        return self.rows_per_step * self.data.seq_len

    @property
    def rows_per_rank(self) -> int:
        return self.rows_per_step // self.world

    def _build_components(self, hub_api) -> None:
        """The pieces that watch and record the run, each owning its cadence and state."""
        settings, is_writer = self.settings, self.rank == 0
        defaults = configured_knobs(self.engine, settings.activation_checkpointing)
        if isinstance(settings.micro_batch, int):  # --micro_batch N: the same global batch, split as asked
            defaults = replace(defaults, micro_batch=self._micro_batch(), accumulation=self.rows_per_rank
                               // self._micro_batch())
        self.controller = Controller(controller_settings(settings.controller), defaults,
                                     os.path.join(self.output_dir, "decisions.jsonl") if is_writer else None,
                                     settings.mod_capacity_warmup_steps)
        if settings.micro_batch == "auto" and not self.resume_tag:
            self.controller.start_micro_batch_search()
        self.applied = None  # the knobs the engine follows now
        self.checkpointer = checkpoint.Checkpointer(self.output_dir, self.identity, self.engine,
                                                    {"run": self, "data": self.data}, self.data.tokenizer,
                                                    settings.save_steps, settings.keep_last, self.resume_tag,
                                                    settings.max_failed_saves)
        self.metrics = MetricsWriter(self.output_dir if is_writer else None, settings.report_to,
                                     os.path.basename(self.output_dir), self.identity, settings.log_steps)
        self.window = RoutingWindow(self.config)
        self.pusher = HubPusher(settings.push_to_hub, hub_api) if settings.push_to_hub and is_writer else None
        self.data_steps = 0  # step batches read (a rollback skips data, so it can exceed the step)
        self.last_loss = math.nan  # the latest step's loss, which its checkpoint records
        self.pending: list[tuple[int, StepResult]] = []  # steps whose losses are still on the device
        self.stopped_early = False  # early stopping ended the run: a rerun of the command trains no more
        self._phase = "forward"  # where the step is, for the controller when it runs out of memory
        self.start_step = self.step = 0  # where the run starts, and the step it has trained
        if is_writer:
            write_identity(self.output_dir, self.identity)

    def _keep_the_checkpoints_global_batch(self, ds_config: dict, saved: dict) -> None:
        """On another number of processes the global batch stays the checkpoint's: accumulation is re-derived from
        it (a warning says so), so the run continues on the same samples at the same steps. (Another number of
        processes or ep_size also loads the checkpoint through DeepSpeed's universal format: `checkpoint.restore`.)
        The same holds when the checkpoint was written on this number of processes after such a resume: its ds_config
        was this one, and the global batch it kept stays. `saved`: the checkpoint's run state."""
        rows = saved["identity"]["rows_per_step"]
        if rows == self.rows_per_step:  # (any other difference check_resumable has refused)
            return
        micro = self.settings.micro_batch if isinstance(self.settings.micro_batch, int) else \
            ds_config["train_micro_batch_size_per_gpu"]
        if rows % (micro * self.world):
            raise ConfigError(f"the checkpoint's global batch of {rows} rows does not split into micro-batches "
                              f"of {micro} on {self.world} processes; pass a --micro_batch that divides "
                              f"{rows // self.world}")
        accumulation = rows // (micro * self.world)
        logger.warning("resuming a %d-process run on %d: gradient accumulation %d keeps its global batch of %d "
                       "rows", saved["identity"]["world_size"], self.world, accumulation, rows)
        ds_config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation)
        ds_config.pop("train_batch_size", None)
        self.rows_per_step = rows
        self.identity = {**self.identity, "rows_per_step": rows}

    def _micro_batch(self) -> int:
        """`--micro_batch N`, checked against the rows each process trains per step (which a resume on another
        number of processes changes)."""
        micro = self.settings.micro_batch
        if self.rows_per_rank % micro:
            raise ConfigError(f"micro_batch {micro} does not divide the {self.rows_per_rank} rows each of the "
                              f"{self.world} processes trains per step; pick a divisor of {self.rows_per_rank}")
        return micro

    # knobs
    def apply(self, step: int) -> None:
        """The one place the controller's knobs reach the engine and model: before each step, if they changed."""
        knobs = self.controller.knobs_at(step)
        if knobs != self.applied:
            apply_knobs(self.engine, knobs, self.base_lrs)
            self.applied = knobs

    # state
    def state_dict(self) -> dict:
        """The run's part of a checkpoint (run.json): where it is, what it is, and the controller's state."""
        return {"step": self.step, "data_steps": self.data_steps, "loss": self.last_loss, "identity": self.identity,
                "controller": self.controller.state_dict(), "micro_batch": self.settings.micro_batch,
                "stopped_early": self.stopped_early, "configured_rows_per_rank": self.configured_rows_per_rank}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from a checkpoint's run state (the engine, optimizer, schedule and RNG are loaded already)."""
        self.start_step = self.step = saved["step"]
        self.data_steps, self.last_loss = saved["data_steps"], saved["loss"]
        self.controller.load_state_dict(saved["controller"])
        # The split of the step: the checkpoint's knobs (they may hold an out-of-memory halving), unless this command
        # asks for another micro-batch than the one that wrote it; on another number of ranks, the rows per rank
        # changed and the micro-batch that worked is kept where it divides them.
        micro = self.settings.micro_batch
        if isinstance(micro, int) and micro != saved.get("micro_batch"):
            logger.warning("micro_batch %d: the checkpoint trained with micro-batches of %d; the global batch stays",
                           self._micro_batch(), self.controller.knobs.micro_batch)
            self.controller.resplit(self.rows_per_rank, self._micro_batch())
        elif saved["identity"]["world_size"] != self.world:
            self.controller.resplit(self.rows_per_rank)
        if saved.get("stopped_early"):
            self.stopped_early = True
            logger.warning("the run stopped early at step %d (its validation loss stopped improving): it is finished; "
                           "pass a new --output_dir to train again", self.start_step)

    def _roll_back(self, step: int) -> int:
        """Back to the latest healthy checkpoint's weights and optimizer (through the universal format when it was
        written on another layout: the checkpoint a run resumed from on a new one); the controller keeps its new
        knobs. Returns the checkpoint's step."""
        saved = self.checkpointer.restore(rollback=True)
        if saved is None:
            raise TrainingStopped(f"step {step} needs a rollback but there is no checkpoint yet; set save_steps")
        self.controller.rolled_back(saved["controller"])
        self.applied = None  # the load restored the scheduler's learning rates: apply the knobs again
        back = saved["step"]
        self.metrics.rewind(back, f"rolled back at step {step} to the checkpoint at step {back}")
        self.window.reset()
        return back

    def _handle(self, verdict: Verdict, step: int) -> int | None:
        """Act on a verdict about `step` (its loss, a window, a validation or an out-of-memory error): returns the
        step the run goes on from (`step` itself, or where a rollback took it), or None when the run ends here as
        planned (early stopping). A failed stop raises TrainingStopped; RETRY_STEP is the loop's (it reruns the
        same rows)."""
        if verdict.action is Action.ROLL_BACK:
            with self.clock.phase("checkpoint"):
                return self._roll_back(step)  # the data already read is skipped, not replayed
        if verdict.action is Action.STOP:
            if verdict.failed:
                raise TrainingStopped(verdict.reason)
            return None
        return step

    # one step
    def _train_step(self, step: int, rows: dict) -> tuple[StepResult | None, Verdict]:
        """One optimizer step over this rank's `rows`: its result, its loss left on the device (the loop reads the
        losses of many steps at once: `_read_losses`), or, on an out-of-memory error, None and the controller's
        verdict (RETRY_STEP: the loop applies the new split and runs the same rows again; ROLL_BACK: the optimizer
        step may have been partial; STOP).

        The LM loss is normalised by the whole step's target-token count (every micro-batch of every rank), as
        transformers does with `num_items_in_batch`: each micro-batch passes its summed token loss divided by
        targets / (world x accumulation), which the engine's 1/accumulation scaling and the gradient average over
        ranks turn into (summed loss of the step) / (targets of the step). So a step's result does not depend on
        how it is split into micro-batches and ranks.
        """
        engine = self.engine
        micro_steps_before = engine.micro_steps
        if engine.device.type == "cuda":  # page-locked, so each micro-batch's copy is asynchronous
            rows = {k: v.pin_memory() for k, v in rows.items()}
        # counted on the host, where the rows are, and filled in on the device: a plain copy to the device would wait
        # for the steps still running there
        targets = torch.full((), int((rows["labels"][:, 1:] != -100).sum()), dtype=torch.float32, device=engine.device)
        if self.world > 1:
            dist.all_reduce(targets)  # on the device: no host synchronisation
        try:
            return self._micro_batches(step, rows, targets), Verdict(Action.CONTINUE)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            discard_partial_step(engine, micro_steps_before)
            return None, self.controller.on_oom(step, error, self._phase)

    def _reads_losses_at(self, step: int, validator: Validator) -> bool:
        """Whether the step losses go to the host after `step`: where something needs them (its logging window, a
        validation's early stopping, a checkpoint, which is written from healthy weights only, a save owed since a
        boundary met unhealthy weights) and at the run's last step."""
        max_steps = self.settings.max_steps
        return (step == max_steps or self.metrics.should_log(step, max_steps) or validator.should_run(step)
                or self.checkpointer.boundary(step, max_steps))

    def _read_losses(self, window: LossWindow) -> Verdict:
        """The pending steps' losses from the device in one transfer, then the controller's verdict on them in
        order (their spikes and non-finite losses); the losses it accepted join the logging window."""
        steps = self.pending
        self.pending = []
        losses = torch.stack([result.loss for _, result in steps]).tolist()  # the one host read of these steps
        accepted, verdict = self.controller.observe_steps(
            [StepReport(step, loss, result.overflow) for (step, result), loss in zip(steps, losses, strict=True)])
        window.add_losses(losses[:accepted])
        if accepted:
            self.last_loss = losses[accepted - 1]  # what the checkpoint of the latest kept step records
        return verdict

    def _micro_batches(self, step: int, rows: dict, targets: torch.Tensor) -> StepResult:
        engine, knobs = self.engine, self.applied
        divisor = targets / (self.world * knobs.accumulation)
        loss = torch.zeros((), device=engine.device)
        routing = []  # each micro-batch's routing statistics (small), counted once the whole step succeeded
        starts = range(0, rows["input_ids"].shape[0], knobs.micro_batch)
        for index, start in enumerate(starts):
            # The loop owns the accumulation boundary: DeepSpeed's own count (micro-steps modulo accumulation)
            # is misaligned once the controller changes the accumulation mid-run or a failed attempt is discarded.
            engine.set_gradient_accumulation_boundary(index == len(starts) - 1)
            self._phase = "forward"
            self.hooks.before_micro_batch(self, step, index, knobs.micro_batch)
            batch = {k: v[start:start + knobs.micro_batch].to(engine.device, non_blocking=True)
                     for k, v in rows.items()}
            out = engine(**batch, num_items_in_batch=divisor)
            self._phase = "backward"
            engine.backward(out.loss)
            self._phase = "optimizer step" if engine.is_gradient_accumulation_boundary() else "backward"
            engine.step()
            loss += out.lm_loss.detach()
            routing.append(engine.module.routing_statistics(out))
            del out  # its logits are (micro-batch x seq x vocab): never held across micro-batches
        for sample in routing:  # only once the whole step succeeded: a retried step counts once
            self.window.add(sample)
        applied = engine.was_step_applied()
        if applied:  # e.g. bias balancing: the step's expert loads move the routing bias
            engine.module.after_optimizer_step(routing)
        loss /= knobs.accumulation
        if self.world > 1:
            dist.all_reduce(loss)
            loss /= self.world
        return StepResult(loss, not applied)

    # the run
    def run(self) -> dict:
        clock, settings = self.clock, self.settings
        with clock.phase("checkpoint"):
            if self.checkpointer.restore() is None:  # a start, or a start over after an attempt that saved nothing
                self.metrics.rewind(0, "the run started over before its first checkpoint")
            else:
                self.resume_tag = self.checkpointer.resume_tag
                self.metrics.rewind(self.start_step, f"resumed from the checkpoint at step {self.start_step}")
                logger.info("resumed from %s at step %d", self.resume_tag, self.start_step)
        counts = parameter_counts(self.config)
        knobs = self.controller.knobs
        logger.info("%s %s: %s parameters (%s active), %d process(es), micro-batch %d x accumulation %d, seq %d",
                    settings.preset or "no preset", settings.arch, f"{counts.total:,}", f"{counts.active:,}",
                    self.world, knobs.micro_batch, knobs.accumulation, self.data.seq_len)
        stats = self.data.statistics
        if stats:
            logger.info("embedded corpus: entropy floor %.3f nats/token, unigram entropy %.3f",
                        stats.entropy_floor, stats.unigram_entropy)
        validator = Validator(self.validation_batches, settings.eval_steps, settings.max_steps,
                              self.engine.module.validation_routings())
        last_step, train_loss = self._train_loop(validator)
        summary = {"train_loss": train_loss, "steps": last_step, "tokens_seen": last_step * self.tokens_per_step}
        with clock.phase("eval"):
            summary.update(validator.result_at(self.engine, last_step, self.controller.knobs.micro_batch))
        with clock.phase("checkpoint"):
            if not self.controller.healthy:
                logger.warning("no checkpoint at the last step %d: its loss is not healthy", last_step)
            elif self.checkpointer.last_saved != last_step and last_step > self.start_step:
                self._checkpoint(last_step, last=True)
            final.save_final(self.engine.module, self.data.tokenizer, os.path.join(self.output_dir, "final"),
                       is_writer=self.rank == 0, zero_stage=self.engine.zero_optimization_stage())
        summary.update(self._summary_facts(summary, last_step, counts))
        self.metrics.close()
        self.controller.close()
        if self.rank == 0:
            write_summary(self.output_dir, summary)
            logger.info("summary: %s", _describe(summary))
            self._optional_outputs(summary, last_step)
        return summary

    def _summary_facts(self, summary: dict, last_step: int, counts) -> dict:
        breakdown = self.clock.breakdown()
        trained_tokens = (last_step - self.start_step) * self.tokens_per_step
        val_loss = summary["validation_loss"]
        facts = dict(
            preset=self.settings.preset, arch=self.settings.arch, world_size=self.world, seq_len=self.data.seq_len,
            final_perplexity=math.exp(val_loss), resumed_from_step=self.start_step,
            total_parameters=counts.total, active_parameters=counts.active, compiled=self.engine.is_compiled,
            wall_time_s=breakdown["total"], time_breakdown_s=breakdown,
            training_tokens_per_s=trained_tokens / breakdown["train"] if breakdown["train"] else None,
            peak_memory=peak_memory(), **self.data.summary(),
        )
        if self.source:  # steps and tokens above count this run's only
            facts.update(base_model=self.base_model["source"], base_model_sha256=self.base_model["sha256"])
        stats = self.data.statistics
        if stats:
            facts.update(entropy_floor=stats.entropy_floor, unigram_entropy=stats.unigram_entropy,
                         captured=stats.captured(val_loss))
        return facts

    def _optional_outputs(self, summary: dict, last_step: int) -> None:
        """After summary.json and final/ are on disk: the plot and the Hub push, which may fail on their own."""
        stats = self.data.statistics
        plot_losses(os.path.join(self.output_dir, "metrics.jsonl"), os.path.join(self.output_dir, "loss.png"),
                    stats.entropy_floor if stats else None, (last_step, summary["validation_loss"]))
        if self.pusher:
            self.pusher.wait()
            self.pusher.push(os.path.join(self.output_dir, "final"), model_card(summary, startup.command()),
                             "final model")
            summary["hub_push"] = {"repo": self.pusher.repo_id, "pushed": self.pusher.pushed,
                                   "failures": self.pusher.failures}
            write_summary(self.output_dir, summary)

    def _train_loop(self, validator: Validator) -> tuple[int, float]:
        with self.clock.phase("setup"):  # the loader and its workers start; waiting for their batches is "data"
            batches = self.data.step_batches(self.data_steps, self.rows_per_step, self.rank, self.world)
        try:
            return self._train_steps(batches, validator)
        finally:  # shuts the loader's workers down, whatever ended the loop: they ignore SIGTERM (data/__init__.py),
            batches.close()  # which is how multiprocessing would stop them at exit

    def _train_steps(self, batches, validator: Validator) -> tuple[int, float]:
        clock, settings, controller = self.clock, self.settings, self.controller
        window = LossWindow(clock)
        step, train_loss = self.start_step, self.last_loss  # a finished run resumed trains no step
        first = step < settings.max_steps and not self.stopped_early
        # the bar closed whatever ends the loop, so that a last line (a stop's) starts a line of its own
        with tqdm(total=settings.max_steps, initial=self.start_step, disable=self.rank != 0, dynamic_ncols=True,
                  desc="train") as bar, logging_redirect_tqdm(loggers=[logging.getLogger("adaptive_ds")]), \
                StopRequest(settings.stop_grace_s, settings.collective_timeout_s) as stop:
            while step < settings.max_steps and not self.stopped_early:
                step = self.step = step + 1
                distributed.progress.step = step  # for the one line printed if a process is lost
                self.apply(step)
                self.hooks.before_step(self, step)
                with clock.phase("data"):
                    rows = _first_batch(batches) if first else next(batches)
                first = False
                verdict = Verdict(Action.RETRY_STEP)
                while verdict.action is Action.RETRY_STEP:  # out of memory: the same rows, split anew
                    self.apply(step)
                    with clock.phase("train"):
                        result, verdict = self._train_step(step, rows)
                self.data_steps += 1
                stopping = stop.agreed()  # a signal asked this run to stop: every rank stops here
                if result is not None:
                    self.pending.append((step, result))
                    window.add_tokens(self.tokens_per_step)
                    bar.update(1)
                    if stopping or self._reads_losses_at(step, validator):
                        with clock.phase("train"):  # it waits for the device to finish the steps
                            verdict = self._read_losses(window)
                back = self._handle(verdict, step)
                if back == step and not self.pending:  # observed once its loss is on the host
                    record, verdict = self._observe(step, window, validator, stopping)
                    if "loss" in record:
                        train_loss = record["loss"]
                        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                    back = self._handle(verdict, step)
                if back is None:  # early stopping: the run ends here, saved as usual
                    self.stopped_early = True
                    break
                if back != step:
                    self.pending = []  # steps after the checkpoint: undone
                    step = self.step = bar.n = back
                    window.restart()
                    continue
                if self.pending:  # the step's loss is still on the device: nothing observes it yet
                    continue
                if self.checkpointer.should_save(step, settings.max_steps, controller.healthy):
                    with clock.phase("checkpoint"):
                        self._save(step)
                if stopping:
                    self._stop(step, stop)
            if not self.stopped_early and stop.settle():  # a signal during the last step
                self._stop(step, stop)
        return step, train_loss

    def _stop(self, step: int, stop: StopRequest) -> None:
        """End the run at `step` as a signal asked: with a checkpoint where the weights are healthy and the grace
        period has not passed (collective), and a line that says how the same command resumes it."""
        name = signal.Signals(stop.signum).name
        reason = None
        if self.checkpointer.last_saved != step:
            if not self.controller.healthy:
                reason = "its loss is not healthy"
            elif not stop.within_grace():
                reason = f"the grace period of {self.settings.stop_grace_s} s had passed"
            else:
                with self.clock.phase("checkpoint"):
                    self._save(step)
        latest = self.checkpointer.rollback_target()
        if self.checkpointer.last_saved == step:
            line = f"stopped by {name} at step {step}, saved; {distributed.progress.rerun} to resume from step {step}"
        else:
            resume = f"resume from {latest}" if latest else "start again (no checkpoint was saved yet)"
            line = (f"stopped by {name} at step {step} without a checkpoint there ({reason or 'its save failed'}); "
                    f"{distributed.progress.rerun} to {resume}")
        raise StopRequested(line, stop.signum)

    def _observe(self, step: int, window: LossWindow, validator: Validator, stopping: bool = False,
                 ) -> tuple[dict, Verdict]:
        """After a step the run keeps: validation at its cadence, the logging window at its own, both written as the
        step's one metrics.jsonl record (none when neither is due); returns the record and the controller's verdict
        (early stopping). The step the run stops at (early, or on a signal: `stopping`) always logs its window."""
        record, verdict, logged = {}, Verdict(Action.CONTINUE), Verdict(Action.CONTINUE)
        if validator.should_run(step):
            with self.clock.phase("eval"):
                record.update(validator.run(self.engine, step, self.applied.micro_batch))
            verdict = self.controller.observe_validation(step, record["validation_loss"])
        if stopping or self.metrics.should_log(step, self.settings.max_steps) or verdict.action is Action.STOP:
            window_record, logged = self._window_record(step, window)
            record.update(window_record)
        if record:
            self.metrics.write({"step": step, "tokens_seen": step * self.tokens_per_step,
                                "elapsed_s": self.clock.elapsed(), **distributed.restart_counts(), **record})
            val = f" validation {record['validation_loss']:.4f}" if "validation_loss" in record else ""
            if "loss" in record:
                stats = self.data.statistics
                floor = f" (floor {stats.entropy_floor:.3f}, captured {100 * record['captured']:.1f}%)" if stats else ""
                logger.info("step %d/%d loss %.4f%s%s lr %.2e %.0f tokens/s", step, self.settings.max_steps,
                            record["loss"], floor, val, record["lr"], record["tokens_per_s"])
            else:
                logger.info("step %d/%d%s", step, self.settings.max_steps, val)
        return record, strongest(verdict, logged)

    def _window_record(self, step: int, window: LossWindow) -> tuple[dict, Verdict]:
        """The logging window that ends at `step`: its mean loss, speed and routing, and the controller's verdict on
        the routing (collective: every rank logs at the same steps)."""
        record = {"loss": window.mean_loss(), "lr": self.engine.get_lr()[0],
                  "micro_batch": self.applied.micro_batch, "accumulation": self.applied.accumulation,
                  "tokens_per_s": window.tokens_per_s(), "window_s": window.busy_seconds(),
                  "skipped_steps": self.engine.skipped_steps, "failed_saves": self.checkpointer.failed_saves,
                  "failed_saves_total": self.checkpointer.failed_saves_total, **self.window.summary()}
        if self.applied.mod_capacity is not None:  # a model with MoD blocks
            record["mod"]["capacity"] = self.applied.mod_capacity
        stats = self.data.statistics
        if stats:
            record.update(entropy_floor=stats.entropy_floor, captured=stats.captured(record["loss"]))
        verdict = self.controller.observe_window(WindowReport(step, record.get("moe"), record.get("mod")))
        self.window.reset()
        window.restart()
        return record, verdict

    def _save(self, step: int) -> None:
        """A periodic checkpoint; one that cannot be written (a full disk) costs a warning, not the run: the
        previous checkpoint stays the latest, and the next boundary tries again. The max_failed_saves-th failure in
        a row stops the run (`Checkpointer.save` raises SavesFailedError, which this lets through)."""
        try:
            self._checkpoint(step)
        except checkpoint.CheckpointSaveError as error:
            logger.warning("%s; training goes on and the next save point tries again (%d of max_failed_saves %d "
                           "failed in a row)", error, self.checkpointer.failed_saves, self.settings.max_failed_saves)
            return
        self._push_checkpoint(step, self.last_loss)

    def _checkpoint(self, step: int, last: bool = False) -> None:
        """`Checkpointer.save`; the failure that stops the run is counted in the step's metrics record too, as every
        other failure is in the records after it (the run ends here, so no record comes after)."""
        try:
            self.checkpointer.save(step, last=last)
        except checkpoint.SavesFailedError:
            self.metrics.amend(step, {"failed_saves": self.checkpointer.failed_saves,
                                      "failed_saves_total": self.checkpointer.failed_saves_total})
            raise

    def _push_checkpoint(self, step: int, loss: float) -> None:
        if not (self.settings.push_to_hub and self.settings.push_every_save):
            return
        staging = os.path.join(self.output_dir, "checkpoints", "hub_snapshot")
        final.save_final(self.engine.module, self.data.tokenizer, staging, is_writer=self.rank == 0,
                   zero_stage=self.engine.zero_optimization_stage())
        if self.pusher:
            counts = parameter_counts(self.config)
            facts = {"preset": self.settings.preset, "arch": self.settings.arch, "total_parameters": counts.total,
                     "active_parameters": counts.active, "steps": step,
                     "tokens_seen": step * self.tokens_per_step, "train_loss": loss}
            if self.source:
                facts.update(base_model=self.base_model["source"], base_model_sha256=self.base_model["sha256"])
            self.pusher.push_in_background(staging, model_card(facts, startup.command()), f"checkpoint at step {step}")


def _first_batch(batches) -> dict:
    """The run's first batch, agreed on by every rank: data that fails on one rank only (a streamed shard with no
    record for it) stops every rank with its one line, rather than leaving the others to lose contact with it."""
    try:
        rows, problem = next(batches), None
    except ConfigError as error:
        rows, problem = None, str(error)
    problems = [p for p in distributed.all_gather_object(problem) if p]
    if problems:
        raise ConfigError(problems[0])
    return rows


def _describe(summary: dict) -> str:
    text = (f"validation loss {summary['validation_loss']:.4f} (perplexity {summary['final_perplexity']:.3f}) "
            f"after {summary['tokens_seen']:,} tokens in {summary['wall_time_s']:.0f} s")
    if "entropy_floor" in summary:
        text += (f"; entropy floor {summary['entropy_floor']:.4f}, unigram {summary['unigram_entropy']:.4f}, "
                 f"captured {100 * summary['captured']:.1f}% of the learnable structure")
    return text


def train(argv: list[str] | None = None, hub_api=None, process_started: float | None = None,
          hooks: TrainerHooks | None = None) -> dict:
    """Run training as the command line `argv` says; returns the summary (on every rank).

    `hub_api` replaces `huggingface_hub.HfApi()` for --push_to_hub (tests use a local stand-in).
    `process_started` (epoch seconds): when the process began, so that start-up counts in the setup time.
    `hooks`: fault injection for tests (see `TrainerHooks`).
    """
    distributed.setup_logging()
    clock = PhaseClock(process_started)
    with clock.phase("setup"):
        trainer = Trainer(argv, clock, hub_api, hooks)
    return trainer.run()
