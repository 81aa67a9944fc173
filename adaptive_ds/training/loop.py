"""The training run: build once, then one way through every step.

    batch -> engine (forward, backward, step) -> the step's verdict, handled once (`_handle`: continue, retry, roll
    back or stop) -> metrics, validation and checkpoint, each at its own cadence -> the controller's knobs applied in
    one place before the next step.

Each concern is one component, built with the others and owning its cadence and state, as in torchtitan's trainer:
the `Controller` (knobs and verdicts), the `MetricsProcessor` (the step losses, the logging and routing windows and
when they are read), the `Validator`, and the `Checkpointer` (resume, saves, rollbacks, the save of a stop).

Host synchronisations: the step losses stay on the device and reach the host in one transfer where a logging
window, a validation or a checkpoint needs them (`MetricsProcessor.read`), so the loop adds none per step. What
remains per step is not the loop's: DeepSpeed's ZeRO optimizer reads its overflow check and the gradient norm it
clips by (`engine.step()`, one or two reads); MoE layers read their expert loads to size their rows, once per layer
and micro-batch on the per-expert path (none with the grouped GEMM), twice per layer and micro-batch with experts
on other ranks (the all-to-all's splits); MoD blocks read their routed width in evaluation only (causal routing).
Routing statistics are read once per logging window (`RoutingWindow.summary`).

Outputs in OUTPUT_DIR: metrics.jsonl (one record per step that logged its window or validated; a record without
"loss" is a validation only), summary.json, final/ (save_pretrained), checkpoints/ (DeepSpeed checkpoints; a run
started again with the same command continues from the latest).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from typing import NoReturn

import torch
import torch.distributed as dist

from .. import distributed
from ..data.embedded import describe_captured
from ..ds_config import keep_global_batch
from ..ds_config import read as read_ds_config
from ..export.hub import HubPusher, model_card
from ..presets import PRESETS, parameter_counts
from . import final, startup
from .arguments import ConfigError, parse
from .checkpoint import Checkpointer
from .controller import CONTINUE, Action, Controller, TrainingStopped, Verdict, controller_settings
from .engine import apply_knobs, build_engine, configured_knobs, discard_partial_step, loss_scale
from .loss_plot import plot_losses
from .metrics import MetricsWriter, PhaseClock, peak_memory, write_summary
from .metrics_processor import MetricsProcessor, StepResult
from .moe_adapter import expert_parallel_group
from .stop import Progress, StopRequest
from .validation import Validator

logger = logging.getLogger(__name__)

# The verdict on a step at which every rank agreed to stop for a signal (StopRequest): saved there, then ended.
_SIGNALLED = Verdict(Action.STOP, "a signal asked the run to stop")


class TrainerHooks:
    """Points where tests inject real faults (tests/helpers/faults.py); the production run installs none."""

    def before_step(self, trainer: Trainer, step: int) -> None: ...

    def before_micro_batch(self, trainer: Trainer, step: int, index: int, micro_batch: int) -> None: ...


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a RuntimeError) under a memory limit."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))


class Trainer:
    """One training run. Construction does everything that can fail on bad input or a bad checkpoint (settings,
    process group, data, model, output directory, engine, components); `run` trains. `progress`: where the run is,
    for the one line its caller prints if a process is lost (stop.Progress)."""

    def __init__(self, argv: list[str] | None, clock: PhaseClock, hub_api=None, hooks: TrainerHooks | None = None,
                 progress: Progress | None = None):
        self.clock, self.hooks, self.progress = clock, hooks or TrainerHooks(), progress or Progress()
        # Validate before joining the process group: bad input should cost nothing and touch nothing.
        settings, ds_config = parse(argv, int(os.environ.get("WORLD_SIZE", "1")))
        self.settings = settings  # its max_steps is resolved below, once the global batch the run keeps is known
        distributed.init_distributed(settings.collective_timeout_s)
        self.rank, self.world = distributed.rank(), distributed.world_size()
        startup.prepare_device(settings, ds_config)
        self.source = startup.open_source(settings)  # pretrained weights to start from (--init_from), or None
        seq_len = self.source.seq_len(settings.preset) if self.source else PRESETS[settings.preset].seq_len
        layout = read_ds_config(ds_config)
        self.configured_rows_per_rank = layout.rows_per_rank_step  # the ds_config's, before a resume keeps another
        self.data = startup.load_data(settings, seq_len)  # setup: the "data" phase is the loop's wait for batches
        self.tokenizer = startup.saved_tokenizer(self.source, self.data.tokenizer)  # what checkpoints, final/ carry
        self.config = startup.model_config_of(settings, self.source, self.data.tokenizer, self.tokenizer)
        # the held-out batches too, before the output directory: data without a held-out document is refused first
        # (eval_batches of the ds_config's micro-batch)
        self.validation_batches = self.data.validation_batches(layout.micro_batch, settings.eval_batches)
        self.base_model = startup.base_model_record(self.source, settings.output_dir, self.rank)
        identity = Checkpointer.run_identity(settings, self.world, layout.rows_per_rank_step, self.config,
                                             self.base_model)
        self.resume = Checkpointer.open(settings.output_dir, identity, settings.resume, self.progress)
        self.output_dir = self.resume.output_dir
        if self.resume.saved:  # on another number of processes the run keeps the checkpoint's global batch
            micro = settings.micro_batch if isinstance(settings.micro_batch, int) else None
            ds_config = keep_global_batch(ds_config, self.resume.rows_per_step, self.world, micro,
                                          self.resume.world_size)
        self.rows_per_step = read_ds_config(ds_config).rows_per_rank_step * self.world  # the global batch
        self.identity = {**identity, "rows_per_step": self.rows_per_step}
        # The run's length, once, from the global batch it keeps (a resume on another layout keeps the checkpoint's)
        self.settings = settings = startup.resolve_steps(settings, self.config, self.tokens_per_step)
        startup.warn_about_warmup(settings)
        # a resume loads the run's own checkpoint, never the --init_from weights
        model = startup.build_model(self.config, settings, None if self.resume.tag else self.source, self.rank)
        startup.take_generation_config(model, self.source)
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
        if settings.micro_batch == "auto" and not self.resume.tag:
            self.controller.start_micro_batch_search()
        self.applied = None  # the knobs the engine follows now
        self.validator = Validator(self.validation_batches, settings.eval_steps, settings.max_steps,
                                   self.engine.module.validation_routings())
        writer = MetricsWriter(self.output_dir if is_writer else None, settings.report_to,
                               os.path.basename(self.output_dir), self.identity, settings.log_steps)
        self.metrics = MetricsProcessor(writer, self.clock, self.controller, self.config, self.data.statistics,
                                        settings.max_steps, self.tokens_per_step,
                                        needs_losses=(self.validator.should_run,
                                                      lambda step: self.checkpointer.boundary(step)))
        self.pusher = HubPusher(settings.push_to_hub, hub_api) if settings.push_to_hub and is_writer else None
        # loaded in this order: the trainer's split of the step follows the controller's knobs
        states = {"controller": self.controller, "data": self.data, "metrics": self.metrics, "trainer": self}
        self.checkpointer = Checkpointer(
            self.engine, states, self.resume, self.identity, self.tokenizer, save_steps=settings.save_steps,
            keep_last=settings.keep_last, max_steps=settings.max_steps, max_failed_saves=settings.max_failed_saves,
            stop_grace_s=settings.stop_grace_s, progress=self.progress, amend_record=self.metrics.amend,
            on_saved=self._push_checkpoint if settings.push_to_hub and settings.push_every_save else None)
        self.data_steps = 0  # step batches read (a rollback skips data, so it can exceed the step)
        self.stopped_early = False  # early stopping ended the run: a rerun of the command trains no more
        self._phase = "forward"  # where the step is, for the controller when it runs out of memory
        self.start_step = self.step = 0  # where the run starts, and the step it has trained

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
        """The trainer's part of a checkpoint: where the run is and what it is (the controller, the data and the
        metrics save their own)."""
        return {"step": self.step, "data_steps": self.data_steps, "identity": self.identity,
                "micro_batch": self.settings.micro_batch, "stopped_early": self.stopped_early,
                "configured_rows_per_rank": self.configured_rows_per_rank}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from a checkpoint's run state (the engine, optimizer, schedule, RNG and the controller's state
        are loaded already)."""
        self.start_step = self.step = saved["step"]
        self.data_steps = saved["data_steps"]
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

    # the verdict on a step
    def _handle(self, verdict: Verdict, step: int, stop: StopRequest) -> int:
        """Act on the verdict about `step` (its out-of-memory error, its loss, its validation, or a stop that every
        rank agreed on), once per step; returns the step the run has reached.

        CONTINUE: the step is kept, and saved at the checkpoint's cadence once its loss is on the host. RETRY_STEP
        (out of memory before the optimizer step): nothing to undo; the loop trains the same rows again, split as the
        controller's new knobs say. ROLL_BACK:
        back to the latest checkpoint (the data already read is skipped, not replayed); returns its step. STOP: a
        failure raises TrainingStopped; early stopping ends the run here, saved as usual at its end; a signal saves
        here and raises StopRequested."""
        action = verdict.action
        if action is Action.ROLL_BACK:
            return self._roll_back(step)
        if action is Action.STOP and verdict.failed:
            raise TrainingStopped(verdict.reason)
        if verdict is _SIGNALLED:  # first and on its own: nothing can skip a stop that every rank agreed on
            self._stop_on_signal(step, stop)
        if action is Action.STOP:
            self.stopped_early = True
        elif action is not Action.RETRY_STEP and not self.metrics.unread:
            with self.clock.phase("checkpoint"):
                self.checkpointer.maybe_save(step, self.controller.healthy)
        return step

    def _stop_on_signal(self, step: int, stop: StopRequest) -> NoReturn:
        """End the run at `step` for a signal: its save at the cadence, then the save of the stop and StopRequested.
        Step losses still on the device are read first, so that the controller has judged every step it saves."""
        with self.clock.phase("checkpoint"):
            if self.metrics.unread:
                self.metrics.read()  # its verdict is moot (the run stops); `healthy` holds what it found
            self.checkpointer.maybe_save(step, self.controller.healthy)
            self.checkpointer.save_on_stop(step, stop, self.controller.healthy)

    def _roll_back(self, step: int) -> int:
        """Back to the latest healthy checkpoint's weights and optimizer; the controller keeps its new knobs, the
        metrics forget the undone steps. Returns the checkpoint's step."""
        with self.clock.phase("checkpoint"):
            back = self.checkpointer.roll_back()
            if back is None:
                raise TrainingStopped(f"step {step} needs a rollback but there is no checkpoint yet; set save_steps")
            self.applied = None  # the load restored the scheduler's learning rates: apply the knobs again
            self.metrics.rewind(step, back)
        self.step = back
        return back

    # the steps
    def _train_loop(self) -> int:
        """Train from where the run starts to its end; returns the last step."""
        with self.clock.phase("setup"):  # the loader and its workers start; waiting for their batches is "data"
            loader = self.data.step_batches(self.data_steps, self.rows_per_step, self.rank, self.world)
        try:
            with self.metrics.displaying(self.start_step, self.rank), \
                    StopRequest(self.settings.stop_grace_s, self.settings.collective_timeout_s,
                                self.progress.signalled, self.progress.signalled_at) as stop:
                step = self._train_steps(_agreed_first(loader), stop)
                if not self.stopped_early and stop.settle():  # a signal during the last step
                    self._handle(_SIGNALLED, step, stop)
            return step
        finally:  # shuts the loader's workers down, whatever ended the loop: they ignore SIGTERM (data/__init__.py),
            loader.close()  # which is how multiprocessing would stop them at exit

    def _train_steps(self, batches, stop: StopRequest) -> int:
        step = self.start_step
        while step < self.settings.max_steps and not self.stopped_early:
            step = self._begin(step + 1)
            with self.clock.phase("data"):
                rows = next(batches)
            verdict = Verdict(Action.RETRY_STEP)
            while verdict.action is Action.RETRY_STEP:  # out of memory: the same rows again, split anew
                verdict = self._attempt(step, rows, stop)
                step = self._handle(verdict, step, stop)
        return step

    def _begin(self, step: int) -> int:
        self.step = self.progress.step = step  # the progress: for the one line printed if a process is lost
        self.apply(step)
        self.hooks.before_step(self, step)
        return step

    def _attempt(self, step: int, rows: dict, stop: StopRequest) -> Verdict:
        """Train `step` on `rows` once, then judge it: its out-of-memory error, or, where its loss reaches the host
        (`MetricsProcessor.reads_at`), its loss and then its validation and logging window (`_observe`); CONTINUE
        while its loss stays on the device. A stop that every rank agreed on at this step is `_SIGNALLED`."""
        self.apply(step)
        with self.clock.phase("train"):
            result, verdict = self._train_step(step, rows)
        if verdict.action is Action.RETRY_STEP:
            return verdict
        self.data_steps += 1
        stopping = stop.agreed()  # a signal asked this run to stop: every rank stops here
        if result is None:  # out of memory: the controller's ROLL_BACK or STOP
            return verdict
        self.metrics.add_step(step, result)
        if not self.metrics.reads_at(step, stopping):
            return CONTINUE
        verdict = self.metrics.read()
        if verdict.action is not Action.CONTINUE:
            return verdict
        verdict = self._observe(step, stopping)
        return _SIGNALLED if stopping and verdict.action is Action.CONTINUE else verdict

    def _observe(self, step: int, stopping: bool = False) -> Verdict:
        """After a step the run keeps: validation at its cadence, the logging window at its own, both written as the
        step's one metrics.jsonl record (none when neither is due); returns the controller's verdict on the
        validation (early stopping). The step the run stops at (early, or on a signal: `stopping`) always logs its
        window."""
        record, verdict = {}, CONTINUE
        if self.validator.should_run(step):
            with self.clock.phase("eval"):
                record.update(self.validator.run(self.engine, step, self.applied.micro_batch))
            verdict = self.controller.observe_validation(step, record["validation_loss"])
        if stopping or self.metrics.logs_at(step) or verdict.action is Action.STOP:
            applied, scale = self.applied, loss_scale(self.engine)
            record.update(self.metrics.close_window(step, applied, {
                "lr": self.engine.get_lr()[0], "micro_batch": applied.micro_batch,
                "accumulation": applied.accumulation, "skipped_steps": self.engine.skipped_steps,
                **({} if scale is None else {"loss_scale": scale}),
                "failed_saves": self.checkpointer.failed_saves,
                "failed_saves_total": self.checkpointer.failed_saves_total}))
        if record:
            self.metrics.write(step, record)
        return verdict

    # one step
    def _train_step(self, step: int, rows: dict) -> tuple[StepResult | None, Verdict]:
        """One optimizer step over this rank's `rows`: its result, its loss left on the device (the loop reads the
        losses of many steps at once: `MetricsProcessor.read`), or, on an out-of-memory error, None and the controller's
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
            out = engine(**batch, num_items_in_batch=divisor, skip_logits=True)  # only the losses are read
            self._phase = "backward"
            engine.backward(out.loss)
            self._phase = "optimizer step" if engine.is_gradient_accumulation_boundary() else "backward"
            engine.step()
            loss += out.lm_loss.detach()
            routing.append(engine.module.routing_statistics(out))
            del out  # never held across micro-batches
        self.metrics.add_routing(routing)  # only once the whole step succeeded: a retried step counts once
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
                self.metrics.writer.rewind(0, "the run started over before its first checkpoint")
            else:
                self.metrics.writer.rewind(self.start_step, f"resumed from the checkpoint at step {self.start_step}")
                logger.info("resumed from %s at step %d", self.checkpointer.resume_tag, self.start_step)
        counts = parameter_counts(self.config)
        knobs = self.controller.knobs
        logger.info("%s %s: %s parameters (%s active), %d process(es), micro-batch %d x accumulation %d, seq %d",
                    settings.preset or "no preset", settings.arch, f"{counts.total:,}", f"{counts.active:,}",
                    self.world, knobs.micro_batch, knobs.accumulation, self.data.seq_len)
        stats = self.data.statistics
        if stats:
            logger.info("embedded corpus: entropy floor %.3f nats/token, unigram entropy %.3f",
                        stats.entropy_floor, stats.unigram_entropy)
        last_step = self._train_loop()
        summary = {"train_loss": self.metrics.train_loss, "steps": last_step,
                   "tokens_seen": last_step * self.tokens_per_step}
        with clock.phase("eval"):
            summary.update(self.validator.result_at(self.engine, last_step, self.controller.knobs.micro_batch))
        with clock.phase("checkpoint"):
            self.checkpointer.save_at_end(last_step, self.controller.healthy)
            final.save_final(self.engine.module, self.tokenizer, os.path.join(self.output_dir, "final"),
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
        try:
            plot_losses(os.path.join(self.output_dir, "metrics.jsonl"), os.path.join(self.output_dir, "loss.svg"),
                        stats.entropy_floor if stats else None, (last_step, summary["validation_loss"]))
        except Exception as error:  # the run's results are on disk: a chart that fails ends nothing
            logger.warning("loss plot not written: %s: %s", type(error).__name__, error)
        if self.pusher:
            self.pusher.wait()
            self.pusher.push(os.path.join(self.output_dir, "final"), model_card(summary, startup.command()),
                             "final model")
            summary["hub_push"] = {"repo": self.pusher.repo_id, "pushed": self.pusher.pushed,
                                   "failures": self.pusher.failures}
            write_summary(self.output_dir, summary)

    def _push_checkpoint(self, step: int) -> None:
        """The checkpointer's `on_saved` with --push_every_save: the checkpoint's weights to the Hub."""
        staging = self.checkpointer.snapshot_dir
        final.save_final(self.engine.module, self.tokenizer, staging, is_writer=self.rank == 0,
                         zero_stage=self.engine.zero_optimization_stage())
        if self.pusher:
            counts = parameter_counts(self.config)
            facts = {"preset": self.settings.preset, "arch": self.settings.arch, "total_parameters": counts.total,
                     "active_parameters": counts.active, "steps": step,
                     "tokens_seen": step * self.tokens_per_step, "train_loss": self.metrics.last_loss}
            if self.source:
                facts.update(base_model=self.base_model["source"], base_model_sha256=self.base_model["sha256"])
            self.pusher.push_in_background(staging, model_card(facts, startup.command()), f"checkpoint at step {step}")


def _agreed_first(batches):
    """The step batches, the first agreed on by every rank: data that fails on one rank only (a streamed shard with
    no record for it) stops every rank with its one line, rather than leaving the others to lose contact with it."""
    try:
        rows, problem = next(batches), None
    except ConfigError as error:
        rows, problem = None, str(error)
    problems = [p for p in distributed.all_gather_object(problem) if p]
    if problems:
        raise ConfigError(problems[0])
    yield rows
    yield from batches


def _describe(summary: dict) -> str:
    """The summary's log line. Its tokens are the whole run's and its seconds this start's, so after a resume it says
    how many of the tokens this start trained in them."""
    tokens, seconds, resumed = summary["tokens_seen"], summary["wall_time_s"], summary.get("resumed_from_step", 0)
    text = f"validation loss {summary['validation_loss']:.4f} (perplexity {summary['final_perplexity']:.3f}) "
    if resumed:
        trained = tokens - resumed * (tokens // summary["steps"])
        text += (f"after {tokens:,} tokens, {trained:,} of them in this start's {seconds:.0f} s "
                 f"(resumed at step {resumed})")
    else:
        text += f"after {tokens:,} tokens in {seconds:.0f} s"
    if "entropy_floor" in summary:
        text += (f"; entropy floor {summary['entropy_floor']:.4f}, unigram {summary['unigram_entropy']:.4f}, "
                 f"{describe_captured(summary['captured'])}")
    return text


def train(argv: list[str] | None = None, hub_api=None, process_started: float | None = None,
          hooks: TrainerHooks | None = None, progress: Progress | None = None) -> dict:
    """Run training as the command line `argv` says; returns the summary (on every rank).

    `hub_api` replaces `huggingface_hub.HfApi()` for --push_to_hub (tests use a local stand-in).
    `process_started` (epoch seconds): when the process began, so that start-up counts in the setup time.
    `hooks`: fault injection for tests (see `TrainerHooks`).
    `progress`: where the run is, for the caller's one line if a process is lost (`__main__`).
    """
    distributed.setup_logging()
    clock = PhaseClock(process_started)
    with clock.phase("setup"):
        trainer = Trainer(argv, clock, hub_api, hooks, progress)
    return trainer.run()
