"""The training run: build once, then one way through every step.

    batch -> engine (forward, backward, step) -> step report -> controller verdict -> metrics, validation and
    checkpoint, each at its own cadence -> the controller's knobs applied in one place before the next step.

Outputs in OUTPUT_DIR: metrics.jsonl (one record per logged step), summary.json, final/ (save_pretrained),
checkpoints/ (DeepSpeed checkpoints; a run started again with the same command continues from the latest).
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import sys
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import distributed
from ..data import build_training_data
from ..ds_config import read as read_ds_config
from ..hub import HubPusher, model_card
from ..models import AdaptiveDSForCausalLM
from ..presets import PRESETS, model_config, parameter_counts
from . import checkpoint
from .arguments import ConfigError, RunSettings, check_precision, parse
from .controller import Action, Controller, StepReport, TrainingStopped, Verdict, WindowReport, controller_settings
from .engine import apply_knobs, build_engine, configured_knobs, discard_partial_step
from .final import save_final
from .metrics import MetricsWriter, PhaseClock, RoutingWindow, peak_memory, plot_losses
from .output_dir import prepare_output_dir, write_identity
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


def _resolve_steps(settings: RunSettings, config, tokens_per_step: int) -> RunSettings:
    """max_steps from a token budget (a number, or chinchilla: 20 tokens per parameter, Hoffmann et al. 2022)."""
    if settings.tokens is None:
        return settings
    budget = 20 * parameter_counts(config).total if settings.tokens == "chinchilla" else int(settings.tokens)
    return replace(settings, max_steps=max(1, -(-budget // tokens_per_step)))


def _warn_about_warmup(settings: RunSettings) -> None:
    if settings.warmup_steps >= settings.max_steps:
        logger.warning("warmup_steps %d >= max_steps %d: the learning rate never reaches its peak; pass "
                       "--warmup_steps (e.g. %d, 5%% of the steps)", settings.warmup_steps, settings.max_steps,
                       max(1, settings.max_steps // 20))


def _cap_gpu_memory(gib: float) -> None:
    """Make the CUDA allocator fail beyond `gib` (its out-of-memory is then the controller's to handle)."""
    if not torch.cuda.is_available():
        logger.warning("--gpu_memory_gib %.1f ignored: no CUDA device", gib)
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gib * 2**30 > total:
        raise ConfigError(f"gpu_memory_gib {gib} exceeds this GPU's {total / 2**30:.1f} GiB; pass a smaller cap")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)
    logger.info("CUDA memory capped at %.1f GiB of %.1f GiB", gib, total / 2**30)


def _prepare_device(settings: RunSettings, ds_config: dict) -> None:
    check_precision(ds_config, torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    if settings.gpu_memory_gib:
        _cap_gpu_memory(settings.gpu_memory_gib)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls on Ampere and newer


def _load_data(settings: RunSettings, seq_len: int):
    epoch_blocks = None  # global blocks per epoch: the same subset whatever the number of processes
    if settings.tokens not in (None, "chinchilla") and settings.epochs > 1:
        epoch_blocks = -(-int(settings.tokens) // (settings.epochs * seq_len))
    try:
        return build_training_data(settings.data, seq_len, settings.seed, tokenizer=settings.tokenizer,
                                   text_field=settings.text_field, hub_config=settings.data_config,
                                   validation_share=settings.validation_share, epoch_blocks=epoch_blocks,
                                   workers=settings.data_workers)
    except ValueError as error:  # bad data is bad input: one line, before anything is written
        raise ConfigError(str(error)) from None


def _command() -> str:
    return shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])


class Trainer:
    """One training run. Construction does everything that can fail on bad input or a bad checkpoint (settings,
    process group, data, model, output directory, engine, controller); `run` trains."""

    def __init__(self, argv: list[str] | None, clock: PhaseClock, hub_api=None, hooks: TrainerHooks | None = None):
        self.clock, self.hooks = clock, hooks or TrainerHooks()
        # Validate before joining the process group: bad input should cost nothing and touch nothing.
        settings, ds_config = parse(argv, int(os.environ.get("WORLD_SIZE", "1")))
        distributed.init_distributed(settings.collective_timeout_s)
        self.rank, self.world = distributed.rank(), distributed.world_size()
        _prepare_device(settings, ds_config)
        seq_len = PRESETS[settings.preset].seq_len
        rows_per_rank = read_ds_config(ds_config).rows_per_rank_step
        self.rows_per_step = rows_per_rank * self.world  # the global batch, constant whatever the split
        self.tokens_per_step = self.rows_per_step * seq_len
        self.data = _load_data(settings, seq_len)  # setup: the "data" phase is the loop's wait for batches
        tok = self.data.tokenizer
        self.config = model_config(settings.preset, settings.arch, len(tok), eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, **settings.model)
        self.settings = settings = _resolve_steps(settings, self.config, self.tokens_per_step)
        _warn_about_warmup(settings)
        self.identity = checkpoint.run_identity(settings, self.world, rows_per_rank, self.config)
        self.output_dir, self.resume_tag = prepare_output_dir(settings, self.identity)
        if self.resume_tag:
            self._prepare_cross_layout_resume(ds_config)
            checkpoint.check_resumable(self.output_dir, self.resume_tag, self.identity)  # before anything is written
        torch.manual_seed(settings.seed)
        self.engine = build_engine(AdaptiveDSForCausalLM(self.config), ds_config, settings.warmup_steps,
                                   settings.max_steps, settings.min_lr_ratio, settings.compile)
        distributed.bound_collectives(settings.collective_timeout_s)  # DeepSpeed's own process groups too
        self.base_lrs = list(self.engine.lr_scheduler.base_lrs)  # the schedule's peaks, before any knob
        self._build_components(hub_api)

    def _build_components(self, hub_api) -> None:
        """The pieces that watch and record the run, each owning its cadence and state."""
        settings, is_writer = self.settings, self.rank == 0
        self.controller = Controller(controller_settings(settings.controller),
                                     configured_knobs(self.engine, settings.activation_checkpointing),
                                     os.path.join(self.output_dir, "decisions.jsonl") if is_writer else None,
                                     settings.mod_capacity_warmup_steps)
        if settings.micro_batch == "auto" and not self.resume_tag:
            self.controller.start_micro_batch_search()
        self.applied = None  # the knobs the engine follows now
        self.checkpointer = checkpoint.Checkpointer(self.output_dir, settings.save_steps, settings.keep_last)
        self.metrics = MetricsWriter(self.output_dir if is_writer else None, settings.report_to,
                                     os.path.basename(self.output_dir), self.identity, settings.log_steps)
        self.window = RoutingWindow(self.config)
        self.pusher = HubPusher(settings.push_to_hub, hub_api) if settings.push_to_hub and is_writer else None
        self.data_steps = 0  # step batches read (a rollback skips data, so it can exceed the step)
        self._phase = "forward"  # where the step is, for the controller when it runs out of memory
        self.start_step = 0
        if is_writer:
            write_identity(self.output_dir, self.identity)

    def _prepare_cross_layout_resume(self, ds_config: dict) -> None:
        """On another number of processes or another ep_size, ZeRO re-partitions from DeepSpeed's universal
        checkpoint (MoE experts through `universal.py`), and the global batch stays the checkpoint's: accumulation
        is re-derived from it (a warning says so), so the run continues on the same samples at the same steps."""
        saved = checkpoint.read_run_state(self.output_dir, self.resume_tag)["identity"]
        if not checkpoint.changes_layout(saved, self.identity):
            return
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
        if saved["world_size"] == self.world:
            return
        rows, micro = saved["rows_per_step"], ds_config["train_micro_batch_size_per_gpu"]
        if rows != self.rows_per_step:
            if rows % (micro * self.world):
                raise ConfigError(f"the checkpoint's global batch of {rows} rows does not split into micro-batches "
                                  f"of {micro} on {self.world} processes; pick a micro-batch that divides "
                                  f"{rows // self.world}")
            accumulation = rows // (micro * self.world)
            logger.warning("resuming a %d-process run on %d: gradient accumulation %d keeps its global batch of %d "
                           "rows", saved["world_size"], self.world, accumulation, rows)
            ds_config["gradient_accumulation_steps"] = accumulation
            ds_config.pop("train_batch_size", None)
            self.rows_per_step, self.tokens_per_step = rows, rows * self.data.seq_len
            self.identity = {**self.identity, "rows_per_step": rows}

    # knobs
    def apply(self, step: int) -> None:
        """The one place the controller's knobs reach the engine and model: before each step, if they changed."""
        knobs = self.controller.knobs_at(step)
        if knobs != self.applied:
            apply_knobs(self.engine, knobs, self.base_lrs)
            self.applied = knobs

    # state
    def state_dict(self, step: int, loss: float) -> dict:
        return {"step": step, "data_steps": self.data_steps, "loss": loss, "identity": self.identity,
                "controller": self.controller.state_dict()}

    def _resume(self, tag: str) -> None:
        """Continue from `tag`: engine, optimizer, schedule and RNG from DeepSpeed's files, the controller and data
        position from run.json; metrics recorded after the checkpoint are marked abandoned."""
        self.resume_tag = tag
        saved = checkpoint.resume(self.engine, self.output_dir, tag, self.identity)
        # The checkpoints this run writes (and rolls back to) are in its own layout, not the universal format.
        self.engine._config.load_universal_checkpoint = False
        self.start_step, self.data_steps = saved["step"], saved["data_steps"]
        self.data.load_state_dict(checkpoint.read_data_state(self.output_dir, self.resume_tag, self.rank))
        self.controller.load_state_dict(saved["controller"])
        if saved["identity"]["world_size"] != self.world:  # the saved split was for the old number of ranks
            self.controller.resplit(self.rows_per_step // self.world)
        self.metrics.rewind(self.start_step, f"resumed from the checkpoint at step {self.start_step}")
        logger.info("resumed from %s at step %d", self.resume_tag, self.start_step)

    def _roll_back(self, step: int) -> int:
        """Back to the latest healthy checkpoint's weights and optimizer; the controller keeps its new knobs."""
        tag = checkpoint.latest_tag(self.output_dir)
        if tag is None:
            raise TrainingStopped(f"step {step} needs a rollback but there is no checkpoint yet; set save_steps")
        saved = checkpoint.load(self.engine, self.output_dir, tag)
        self.controller.rolled_back()
        self.checkpointer.pending = False  # a save postponed before the rollback is owed by steps now undone
        self.applied = None  # the load restored the scheduler's learning rates: apply the knobs again
        back = saved["step"]
        self.metrics.rewind(back, f"rolled back at step {step} to the checkpoint at step {back}")
        self.window.reset()
        return back

    # one step
    def _train_step(self, step: int, rows: dict) -> StepResult | None:
        """One optimizer step over this rank's `rows`; on out-of-memory the controller re-splits and it is
        retried on the same rows.

        The LM loss is normalised by the whole step's target-token count (every micro-batch of every rank), as
        transformers does with `num_items_in_batch`: each micro-batch passes its summed token loss divided by
        targets / (world x accumulation), which the engine's 1/accumulation scaling and the gradient average over
        ranks turn into (summed loss of the step) / (targets of the step). So a step's result does not depend on
        how it is split into micro-batches and ranks.

        Returns None when the step failed in its optimizer update and the controller asked for a rollback.
        """
        engine = self.engine
        micro_steps_before = engine.micro_steps
        if engine.device.type == "cuda":  # page-locked, so each micro-batch's copy is asynchronous
            rows = {k: v.pin_memory() for k, v in rows.items()}
        targets = (rows["labels"][:, 1:] != -100).sum().to(engine.device, torch.float32)
        if self.world > 1:
            dist.all_reduce(targets)  # on the device: no host synchronisation
        while True:
            try:
                return self._micro_batches(step, rows, targets)
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_out_of_memory(error):
                    raise
                discard_partial_step(engine, micro_steps_before)
                verdict = self.controller.on_oom(step, error, self._phase)
                _raise_if_failed(verdict)
                if verdict.action is Action.ROLL_BACK:
                    return None  # the caller rolls back
                self.apply(step)

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
            routing.append(_routing_of(out))
            del out  # its logits are (micro-batch x seq x vocab): never held across micro-batches
        for sample in routing:  # only once the whole step succeeded: a retried step counts once
            self.window.add(sample)
        applied = engine.was_step_applied()
        if applied and self.config.uses_moe:  # bias balancing: the step's expert loads move the routing bias
            engine.module.update_routing_bias([sample.expert_counts for sample in routing])
        loss /= knobs.accumulation
        if self.world > 1:
            dist.all_reduce(loss)
            loss /= self.world
        return StepResult(loss, not applied)

    # the run
    def run(self) -> dict:
        clock, settings = self.clock, self.settings
        with clock.phase("checkpoint"):
            if self.resume_tag:  # a checkpoint DeepSpeed cannot load is set aside for the previous one
                checkpoint.restore_newest(self.output_dir, self.resume_tag, self._resume)
            else:  # a start, or a start over after an attempt that saved nothing: no earlier record stands
                self.metrics.rewind(0, "the run started over before its first checkpoint")
        counts = parameter_counts(self.config)
        knobs = self.controller.knobs
        logger.info("%s %s: %s parameters (%s active), %d process(es), micro-batch %d x accumulation %d, seq %d",
                    settings.preset, settings.arch, f"{counts.total:,}", f"{counts.active:,}", self.world,
                    knobs.micro_batch, knobs.accumulation, self.data.seq_len)
        stats = self.data.statistics
        if stats:
            logger.info("embedded corpus: entropy floor %.3f nats/token, unigram entropy %.3f",
                        stats.entropy_floor, stats.unigram_entropy)
        with clock.phase("eval"):
            validator = Validator(self.data.validation_batches(self.controller.defaults.micro_batch,
                                                               settings.eval_batches),
                                  settings.eval_steps, self.config.uses_mod)
        last_step, train_loss = self._train_loop(validator)
        summary = {"train_loss": train_loss, "steps": last_step, "tokens_seen": last_step * self.tokens_per_step}
        with clock.phase("eval"):
            summary.update(validator.run(self.engine))
        with clock.phase("checkpoint"):
            if not self.controller.healthy:
                logger.warning("no checkpoint at the last step %d: its loss is not healthy", last_step)
            elif self.checkpointer.last_saved != last_step and last_step > self.start_step:
                self.checkpointer.save(self.engine, last_step, self.state_dict(last_step, train_loss),
                                       self.data.tokenizer, self.data.state_dict())
            save_final(self.engine.module, self.data.tokenizer, os.path.join(self.output_dir, "final"),
                       is_writer=self.rank == 0, zero_stage=self.engine.zero_optimization_stage())
        summary.update(self._summary_facts(summary, last_step, counts))
        self.metrics.close()
        self.controller.close()
        if self.rank == 0:
            checkpoint.write_json(os.path.join(self.output_dir, "summary.json"), summary)
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
            self.pusher.push(os.path.join(self.output_dir, "final"), model_card(summary, _command()), "final model")
            summary["hub_push"] = {"repo": self.pusher.repo_id, "pushed": self.pusher.pushed,
                                   "failures": self.pusher.failures}
            checkpoint.write_json(os.path.join(self.output_dir, "summary.json"), summary)

    def _train_loop(self, validator: Validator) -> tuple[int, float]:
        clock, settings, controller = self.clock, self.settings, self.controller
        with clock.phase("setup"):  # the loader and its workers start; waiting for their batches is "data"
            batches = self.data.step_batches(self.data_steps, self.rows_per_step, self.rank, self.world)
        bar = tqdm(total=settings.max_steps, initial=self.start_step, disable=self.rank != 0, dynamic_ncols=True,
                   desc="train")
        window = _Window(clock)
        step, train_loss = self.start_step, float("nan")
        with logging_redirect_tqdm(loggers=[logging.getLogger("adaptive_ds")]):
            while step < settings.max_steps:
                step += 1
                distributed.progress.step = step  # for the one line printed if a process is lost
                self.apply(step)
                self.hooks.before_step(self, step)
                with clock.phase("data"):
                    rows = next(batches)
                with clock.phase("train"):
                    result = self._train_step(step, rows)
                    loss = result.loss.item() if result else math.nan  # the step's one host read (spike rule)
                self.data_steps += 1
                verdict = controller.observe_step(StepReport(step, loss, result.overflow)) if result else Verdict(
                    Action.ROLL_BACK)
                if verdict.action is Action.ROLL_BACK:
                    with clock.phase("checkpoint"):
                        step = self._roll_back(step)  # the data already read is skipped, not replayed
                    bar.n = step
                    window.restart()
                    continue
                _raise_if_failed(verdict)
                window.add(loss, self.tokens_per_step)
                bar.update(1)
                if self.metrics.should_log(step, settings.max_steps):
                    train_loss, verdict = self._log_window(step, window, validator, bar)
                    if verdict.action is Action.STOP:  # early stopping: the run ends here, saved as usual
                        break
                if self.checkpointer.due(step, settings.max_steps) and controller.healthy:
                    with clock.phase("checkpoint"):
                        self._save(step, loss)
        bar.close()
        return step, train_loss

    def _log_window(self, step: int, window: _Window, validator: Validator, bar) -> tuple[float, Verdict]:
        record = {"step": step, "loss": window.mean_loss(), "lr": self.engine.get_lr()[0],
                  "micro_batch": self.applied.micro_batch, "accumulation": self.applied.accumulation,
                  "tokens_per_s": window.tokens_per_s(), "window_s": window.busy_seconds(),
                  "tokens_seen": step * self.tokens_per_step,
                  "skipped_steps": self.engine.skipped_steps, "elapsed_s": self.clock.elapsed(),
                  **self.window.summary()}
        if self.config.uses_mod:
            record["mod"]["capacity"] = self.applied.mod_capacity
        if validator.should_run(step):
            with self.clock.phase("eval"):
                record.update(validator.run(self.engine))
        stats = self.data.statistics
        if stats:
            record.update(entropy_floor=stats.entropy_floor, captured=stats.captured(record["loss"]))
        self.metrics.write(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        floor = f" (floor {stats.entropy_floor:.3f}, captured {100 * record['captured']:.1f}%)" if stats else ""
        val = f" validation {record['validation_loss']:.4f}" if "validation_loss" in record else ""
        logger.info("step %d/%d loss %.4f%s%s lr %.2e %.0f tokens/s", step, self.settings.max_steps,
                    record["loss"], floor, val, record["lr"], record["tokens_per_s"])
        verdict = self.controller.observe_window(WindowReport(step, record.get("moe"), record.get("mod"),
                                                              record.get("validation_loss")))
        _raise_if_failed(verdict)
        self.window.reset()
        window.restart()
        return record["loss"], verdict

    def _save(self, step: int, loss: float) -> None:
        """A periodic checkpoint; one that cannot be written (a full disk) costs a warning, not the run: the
        previous checkpoint stays the latest, and the next boundary tries again."""
        try:
            self.checkpointer.save(self.engine, step, self.state_dict(step, loss), self.data.tokenizer,
                                   self.data.state_dict())
        except checkpoint.CheckpointSaveError as error:
            logger.warning("%s; training goes on", error)
            self.checkpointer.pending = False
            return
        self._push_checkpoint(step, loss)

    def _push_checkpoint(self, step: int, loss: float) -> None:
        if not (self.settings.push_to_hub and self.settings.push_every_save):
            return
        staging = os.path.join(self.output_dir, "checkpoints", "hub_snapshot")
        save_final(self.engine.module, self.data.tokenizer, staging, is_writer=self.rank == 0,
                   zero_stage=self.engine.zero_optimization_stage())
        if self.pusher:
            counts = parameter_counts(self.config)
            facts = {"preset": self.settings.preset, "arch": self.settings.arch, "total_parameters": counts.total,
                     "active_parameters": counts.active, "steps": step,
                     "tokens_seen": step * self.tokens_per_step, "train_loss": loss}
            self.pusher.push_in_background(staging, model_card(facts, _command()), f"checkpoint at step {step}")


class _Window:
    """The step losses and busy time of one logging window (tokens/s counts data and train time only)."""

    def __init__(self, clock: PhaseClock):
        self.clock = clock
        self.restart()

    def _busy(self) -> float:
        return self.clock.seconds["data"] + self.clock.seconds["train"]

    def restart(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0
        self.started = self._busy()

    def add(self, loss: float, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens

    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses)

    def busy_seconds(self) -> float:
        return self._busy() - self.started

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.busy_seconds(), 1e-9)


def _routing_of(out) -> SimpleNamespace:
    """The routing statistics of a forward's output, without its logits and hidden states."""
    fields = ("expert_counts", "expert_dropped", "aux_loss", "z_loss", "mod_routing", "mod_predictor_loss")
    return SimpleNamespace(**{name: getattr(out, name) for name in fields})


def _raise_if_failed(verdict: Verdict) -> None:
    if verdict.action is Action.STOP and verdict.failed:
        raise TrainingStopped(verdict.reason)


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
