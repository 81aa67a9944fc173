"""The training run: build the model and data, train through the DeepSpeed engine, write the output contract.

Outputs in OUTPUT_DIR: metrics.jsonl (one object per logged step), summary.json, final/ (save_pretrained),
checkpoints/ (DeepSpeed checkpoints; a run started again with the same command continues from the latest).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import distributed
from ..data import TrainingData, build_training_data
from ..hub import HubPusher, model_card
from ..models import AdaptiveDSConfig, AdaptiveDSForCausalLM
from ..presets import PRESETS, model_config, parameter_counts
from . import checkpoint
from .arguments import ConfigError, RunSettings, check_precision, parse
from .controller import Controller, ControllerState, SimulatedOOM, TrainingStopped, controller_settings
from .final import save_final
from .metrics import MetricsWriter, PhaseClock, RoutingWindow, peak_memory, plot_losses
from .optim import parameter_groups, scheduler_factory

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """What the loop needs, built once."""

    engine: deepspeed.DeepSpeedEngine
    config: AdaptiveDSConfig
    settings: RunSettings
    data: TrainingData
    output_dir: str
    micro: int
    accum: int
    identity: dict  # what a checkpoint must match to be resumed by this run
    clock: PhaseClock  # where this process's wall time went (summary.json's time_breakdown_s)
    controller: Controller | None = None
    base_lrs: list[float] | None = None  # the schedule's peak learning rates before any controller scaling
    data_steps: int = 0  # step batches this rank has read (rollbacks skip data, so it can exceed the step)
    pusher: HubPusher | None = None  # rank 0, with --push_to_hub

    @property
    def tokens_per_step(self) -> int:
        return self.micro * self.accum * distributed.world_size() * self.data.seq_len


def _prepare_output_dir(settings: RunSettings) -> tuple[str, str | None]:
    """A new or empty directory, or one with a checkpoint to resume; agreed on by every rank."""
    path = settings.output_dir or f"runs/{settings.preset}-{settings.arch}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = distributed.broadcast_object(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"output_dir {path!r} is a file; pass a new or empty --output_dir")
    tag = checkpoint.latest_tag(path) if os.path.isdir(path) else None
    if tag is None and os.path.isdir(path) and os.listdir(path):
        raise ConfigError(f"output_dir {path!r} already holds files but no checkpoint; pass a new or empty "
                          "--output_dir")
    if tag is not None and settings.resume == "never":
        raise ConfigError(f"output_dir {path!r} holds checkpoint {tag}; pass --resume auto to continue it or a new "
                          "--output_dir")
    dist.barrier()  # every rank has checked before rank 0 creates it
    if distributed.rank() == 0:
        os.makedirs(path, exist_ok=True)
    if tag is not None:
        tag = checkpoint.resume_candidate(path)  # verified; a corrupt newest one is set aside for the previous
    return path, tag


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / distributed.world_size()


@torch.no_grad()
def evaluate(engine, batches: list[dict], mod_routing: str = "causal") -> float:
    """Mean LM loss over held-out batches (the model in eval mode), averaged over ranks.

    MoD blocks route with `mod_routing`: "causal" (the predictor; what generation does, the honest figure)
    or "topk" (the train-time rule, which sees the whole sequence).
    """
    model = engine.module.model
    engine.eval()
    model.set_mod_routing(mod_routing)
    losses = [engine(**{k: v.to(engine.device) for k, v in b.items()}).lm_loss.item() for b in batches]
    model.set_mod_routing("causal")
    engine.train()
    return _mean_over_ranks(sum(losses) / len(losses))


def _validation(run: Run, batches: list[dict]) -> dict:
    with run.clock.phase("eval"):
        losses = {"validation_loss": evaluate(run.engine, batches)}
        if run.config.uses_mod:
            losses["validation_loss_topk_routing"] = evaluate(run.engine, batches, "topk")
    return losses


def mod_capacity_at(step: int, target: float, warmup_steps: int) -> float:
    """Capacity schedule: linear from 1.0 at step 0 to `target` at `warmup_steps`, constant afterwards."""
    if step >= warmup_steps:
        return target
    return 1.0 + (target - 1.0) * step / warmup_steps


def _token_budget(settings: RunSettings) -> int | None:
    """A numeric --tokens budget (chinchilla needs the model and is resolved after it is configured)."""
    if settings.tokens is None or settings.tokens == "chinchilla":
        return None
    return int(settings.tokens)


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


def _build(argv: list[str] | None, clock: PhaseClock) -> tuple[Run, str | None]:
    # Validate before joining the process group: bad input should cost nothing and touch nothing.
    settings, ds_config = parse(argv, int(os.environ.get("WORLD_SIZE", "1")))
    distributed.init_distributed(settings.collective_timeout_s)
    check_precision(ds_config, torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    if settings.gpu_memory_gib:
        _cap_gpu_memory(settings.gpu_memory_gib)
    seq_len = PRESETS[settings.preset].seq_len
    world = distributed.world_size()
    tokens_per_step = (ds_config["train_micro_batch_size_per_gpu"] * ds_config.get("gradient_accumulation_steps", 1)
                       * world * seq_len)
    budget = _token_budget(settings)
    epoch_blocks = None
    if budget is not None:
        settings.max_steps = max(1, -(-budget // tokens_per_step))
        epoch_blocks = -(-budget // (settings.epochs * world * seq_len)) if settings.epochs > 1 else None
    with clock.phase("data"):
        data = build_training_data(settings.data, seq_len, settings.seed, tokenizer=settings.tokenizer,
                                   text_field=settings.text_field, hub_config=settings.data_config,
                                   validation_share=settings.validation_share, epoch_blocks=epoch_blocks)
    tok = data.tokenizer
    config = model_config(settings.preset, settings.arch, len(tok), eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **settings.model)
    if settings.tokens == "chinchilla":  # 20 tokens per parameter (Hoffmann et al. 2022)
        settings.max_steps = max(1, -(-20 * parameter_counts(config).total // tokens_per_step))
        if settings.epochs > 1:
            data.epoch_blocks = -(-20 * parameter_counts(config).total // (settings.epochs * world * seq_len))
    if settings.warmup_steps >= settings.max_steps:
        logger.warning("warmup_steps %d >= max_steps %d: the learning rate never reaches its peak; pass "
                       "--warmup_steps (e.g. %d, 5%% of the steps)", settings.warmup_steps, settings.max_steps,
                       max(1, settings.max_steps // 20))
    output_dir, resume_tag = _prepare_output_dir(settings)
    if resume_tag and checkpoint.read_run_state(output_dir, resume_tag)["identity"]["world_size"] != world:
        # A different number of processes: ZeRO must re-partition, from DeepSpeed's universal checkpoint.
        ds_config.setdefault("checkpoint", {})["load_universal"] = True

    torch.manual_seed(settings.seed)
    model = AdaptiveDSForCausalLM(config)
    weight_decay = ds_config["optimizer"].get("params", {}).get("weight_decay", 0.0)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model, weight_decay), config=ds_config,
        lr_scheduler=scheduler_factory(settings.warmup_steps, settings.max_steps, settings.min_lr_ratio),
    )
    distributed.bound_collectives(settings.collective_timeout_s)  # DeepSpeed's own groups too
    if settings.compile:
        engine.compile()  # in place: the module keeps its parameter names, so checkpoints and final/ are unchanged
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    identity = {"preset": settings.preset, "arch": settings.arch, "data": settings.data, "seed": settings.seed,
                "tokenizer": settings.tokenizer if settings.data != "embedded" else "embedded",
                "world_size": distributed.world_size(), "rows_per_rank_step": micro * accum,
                "model": config.to_dict()}
    identity = json.loads(json.dumps(identity))  # as it reads back from run.json
    run = Run(engine, config, settings, data, output_dir, micro, accum, identity, clock,
              base_lrs=list(engine.lr_scheduler.base_lrs))
    run.controller = Controller(controller_settings(settings.controller), ControllerState(micro, accum),
                                output_dir if distributed.rank() == 0 else None)
    if settings.micro_batch == "auto" and not resume_tag:
        # The first step is the search: the whole step in one micro-batch, halved on out-of-memory.
        run.controller.state.micro_batch, run.controller.state.accumulation = micro * accum, 1
        run.controller.decide(0, {"requested_rows_per_rank_step": micro * accum},
                              "micro-batch auto: start at the whole step, halve on out-of-memory")
    _apply_controller_state(run)
    return run, resume_tag


def _resume(run: Run, tag: str) -> int:
    """Load checkpoint `tag`; returns the step it was taken at. metrics.jsonl is cut back to that step.

    On a different number of processes the checkpoint is converted to DeepSpeed's universal format first; the
    model, optimizer and schedule continue exactly, and each rank resumes its own data stream at that step.
    """
    saved = checkpoint.read_run_state(run.output_dir, tag)
    where = os.path.join(run.output_dir, "checkpoints", tag)
    same_world = saved["identity"]["world_size"] == run.identity["world_size"]
    expected = run.identity if same_world else {**run.identity, "world_size": saved["identity"]["world_size"]}
    checkpoint.check_compatible(saved["identity"], expected, where)
    if same_world:
        checkpoint.load(run.engine, run.output_dir, tag)
    else:
        logger.warning("resuming a %d-process checkpoint on %d processes through DeepSpeed's universal format",
                       saved["identity"]["world_size"], run.identity["world_size"])
        checkpoint.load(run.engine, run.output_dir, checkpoint.universal_tag(run.output_dir, tag), rng_tag=tag)
    step = saved["step"]
    run.data_steps = saved["data_steps"]
    run.controller.state = ControllerState(**saved["controller"])
    _apply_controller_state(run)  # a resumed run starts from the settings that worked
    if distributed.rank() == 0:
        path = os.path.join(run.output_dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
            with open(path, "w") as f:
                f.writelines(kept)
    logger.info("resumed from %s at step %d", tag, step)
    return step


def _save(run: Run, step: int, train_loss: float) -> None:
    state = {"step": step, "data_steps": run.data_steps, "identity": run.identity,
             "controller": asdict(run.controller.state)}
    checkpoint.save(run.engine, run.output_dir, step, state, run.settings.keep_last, run.data.tokenizer)
    if run.settings.push_to_hub and run.settings.push_every_save and step < run.settings.max_steps:
        staging = os.path.join(run.output_dir, "checkpoints", "hub_snapshot")
        save_final(run.engine.module, run.data.tokenizer, staging, is_writer=distributed.rank() == 0,
                   zero_stage=run.engine.zero_optimization_stage())
        if run.pusher:
            card = model_card({**_card_facts(run), "steps": step, "tokens_seen": step * run.tokens_per_step,
                               "train_loss": train_loss}, _command())
            run.pusher.push_in_background(staging, card, f"checkpoint at step {step}")


def _command() -> str:
    return shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])


def _card_facts(run: Run) -> dict:
    counts = parameter_counts(run.config)
    return {"preset": run.settings.preset, "arch": run.settings.arch, "total_parameters": counts.total,
            "active_parameters": counts.active}


def train(argv: list[str] | None = None, hub_api=None, process_started: float | None = None) -> dict:
    """Run training as the command line `argv` says; returns the summary (on every rank).

    `hub_api` replaces `huggingface_hub.HfApi()` for --push_to_hub (tests use a local stand-in).
    `process_started` (epoch seconds): when the process began, so that start-up counts in the setup time.
    """
    distributed.setup_logging()
    clock = PhaseClock(process_started)
    with clock.phase("setup"):
        run, resume_tag = _build(argv, clock)
    if run.settings.push_to_hub and distributed.rank() == 0:
        run.pusher = HubPusher(run.settings.push_to_hub, hub_api)
    with clock.phase("checkpoint"):
        start_step = checkpoint.restore_newest(run.output_dir, resume_tag, lambda tag: _resume(run, tag)) \
            if resume_tag else 0
    counts = parameter_counts(run.config)
    logger.info("%s %s: %s parameters (%s active), %d process(es), micro-batch %d x accumulation %d, seq %d",
                run.settings.preset, run.settings.arch, f"{counts.total:,}", f"{counts.active:,}",
                distributed.world_size(), run.micro, run.accum, run.data.seq_len)
    stats = run.data.statistics
    if stats:
        logger.info("embedded corpus: entropy floor %.3f nats/token, unigram entropy %.3f",
                    stats.entropy_floor, stats.unigram_entropy)

    with clock.phase("data"):
        validation = run.data.validation_batches(run.micro, run.settings.eval_batches)
    summary = _train_loop(run, start_step, validation)
    summary.update(_validation(run, validation))
    with clock.phase("checkpoint"):
        if start_step < run.settings.max_steps:
            _save(run, run.settings.max_steps, summary["train_loss"])
        save_final(run.engine.module, run.data.tokenizer, os.path.join(run.output_dir, "final"),
                   is_writer=distributed.rank() == 0, zero_stage=run.engine.zero_optimization_stage())
    val_loss = summary["validation_loss"]
    breakdown = clock.breakdown()
    trained_tokens = (run.settings.max_steps - start_step) * run.tokens_per_step
    summary.update(
        preset=run.settings.preset, arch=run.settings.arch, world_size=distributed.world_size(),
        seq_len=run.data.seq_len, final_perplexity=math.exp(val_loss), resumed_from_step=start_step,
        total_parameters=counts.total, active_parameters=counts.active, compiled=run.engine.is_compiled,
        wall_time_s=breakdown["total"], time_breakdown_s=breakdown,
        training_tokens_per_s=trained_tokens / breakdown["train"] if breakdown["train"] else None,
        peak_memory=peak_memory(),
    )
    if stats:
        summary.update(entropy_floor=stats.entropy_floor, unigram_entropy=stats.unigram_entropy,
                       captured=stats.captured(val_loss))
    if distributed.rank() == 0:
        plot_losses(os.path.join(run.output_dir, "metrics.jsonl"), os.path.join(run.output_dir, "loss.png"),
                    stats.entropy_floor if stats else None, (run.settings.max_steps, val_loss))
        if run.pusher:
            run.pusher.wait()
            run.pusher.push(os.path.join(run.output_dir, "final"), model_card(summary, _command()), "final model")
            summary["hub_push"] = {"repo": run.pusher.repo_id, "pushed": run.pusher.pushed,
                                   "failures": run.pusher.failures}
        with open(os.path.join(run.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        logger.info("summary: %s", _describe(summary))
    return summary


def _describe(summary: dict) -> str:
    text = (f"validation loss {summary['validation_loss']:.4f} (perplexity {summary['final_perplexity']:.3f}) "
            f"after {summary['tokens_seen']:,} tokens in {summary['wall_time_s']:.0f} s")
    if "entropy_floor" in summary:
        text += (f"; entropy floor {summary['entropy_floor']:.4f}, unigram {summary['unigram_entropy']:.4f}, "
                 f"captured {100 * summary['captured']:.1f}% of the learnable structure")
    return text


def _apply_controller_state(run: Run) -> None:
    """Make the engine follow the controller's settings (after a decision, a resume or a rollback)."""
    state, engine = run.controller.state, run.engine
    engine.set_train_micro_batch_size(state.micro_batch)
    engine.set_train_batch_size(state.micro_batch * state.accumulation * distributed.world_size())
    run.micro, run.accum = state.micro_batch, state.accumulation
    engine.module.model.gradient_checkpointing = state.activation_checkpointing or run.settings.activation_checkpointing
    if state.aux_coef is not None:
        engine.module.config.router_aux_loss_coef = state.aux_coef
    scheduler = engine.lr_scheduler
    scheduler.base_lrs = [lr * state.lr_scale for lr in run.base_lrs]
    for group, base, factor in zip(engine.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                   strict=False):
        group["lr"] = base * factor(scheduler.last_epoch)


def _step_rows(rows: dict, micro: int):
    """The step's rows on this rank, cut into micro-batches (the same rows whatever the micro-batch size)."""
    total = rows["input_ids"].shape[0]
    for start in range(0, total, micro):
        yield {k: v[start:start + micro] for k, v in rows.items()}


def _run_step(run: Run, rows: dict, step: int, window: RoutingWindow) -> list[float]:
    """One optimizer step over `rows`; on out-of-memory the controller decides and the step is retried."""
    engine = run.engine
    micro_steps_before = engine.micro_steps
    while True:
        losses, outputs = [], []
        try:
            for batch in _step_rows(rows, run.micro):
                run.controller.inject_oom(step, run.micro)
                batch = {k: v.to(engine.device) for k, v in batch.items()}
                out = engine(**batch)
                engine.backward(out.loss)
                engine.step()
                losses.append(out.lm_loss.item())
                outputs.append(out)
        except (torch.OutOfMemoryError, SimulatedOOM) as error:
            del outputs
            engine.optimizer.zero_grad(set_to_none=True)  # drop the failed step's partial gradients
            engine.micro_steps = micro_steps_before
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            run.controller.on_oom(step, error)
            _apply_controller_state(run)
            continue
        for out in outputs:
            window.add(out)
        run.controller.observe_overflow(step, not engine.was_step_applied())
        return losses


def _rollback(run: Run, step: int) -> int:
    """Back to the latest checkpoint's weights and optimizer, keeping the controller's new settings."""
    tag = checkpoint.latest_tag(run.output_dir)
    if tag is None:
        raise TrainingStopped(f"loss spike at step {step} but no checkpoint to roll back to; set save_steps")
    state = run.controller.state
    checkpoint.load(run.engine, run.output_dir, tag)
    run.controller.state = state
    _apply_controller_state(run)
    return checkpoint.read_run_state(run.output_dir, tag)["step"]


def _train_loop(run: Run, start_step: int, validation: list[dict]) -> dict:
    engine, config, settings = run.engine, run.config, run.settings
    rank, world = distributed.rank(), distributed.world_size()
    # Per-step rows of this rank: micro x accumulation, constant when the controller re-splits them.
    clock = run.clock
    with clock.phase("data"):
        batches = run.data.train_batches(run.micro * run.accum, rank, world)
        for _ in range(run.data_steps):  # the data position: what the checkpointed run consumed
            next(batches)
    window = RoutingWindow(config)
    writer = MetricsWriter(run.output_dir if rank == 0 else None, settings.report_to,
                           os.path.basename(run.output_dir), run.identity)
    bar = tqdm(total=settings.max_steps, initial=start_step, disable=rank != 0, dynamic_ncols=True, desc="train")
    # tokens/s counts the window's data and train phases only (not its evaluation, checkpoints or logging)
    def busy() -> float:
        return clock.seconds["data"] + clock.seconds["train"]

    window_losses, window_start, train_loss = [], busy(), float("nan")
    step = start_step
    with logging_redirect_tqdm(loggers=[logging.getLogger("adaptive_ds")]):
        while step < settings.max_steps:
            step += 1
            distributed.progress.step = step  # for the one line printed if the run has to stop
            if config.uses_mod:
                capacity = run.controller.state.mod_capacity or mod_capacity_at(
                    step - 1, config.mod_capacity, settings.mod_capacity_warmup_steps)
                engine.module.model.set_mod_capacity(capacity)
            with clock.phase("data"):
                rows = next(batches)
            with clock.phase("train"):
                losses = _run_step(run, rows, step, window)
                mean_loss = _mean_over_ranks(sum(losses) / len(losses))
            run.data_steps += 1
            if run.controller.observe_loss(step, mean_loss) == "rollback":
                with clock.phase("checkpoint"):
                    step = _rollback(run, step)  # the data already read is skipped, not replayed
                bar.n = step
                window.reset()
                window_losses, window_start = [], busy()
                continue
            window_losses += losses
            bar.update(1)
            if step % settings.log_steps == 0 or step == settings.max_steps:
                record = {"step": step, "loss": _mean_over_ranks(sum(window_losses) / len(window_losses)),
                          "lr": engine.get_lr()[0], "micro_batch": run.micro, "accumulation": run.accum,
                          "tokens_per_s": len(window_losses) * run.micro * world * run.data.seq_len
                          / (busy() - window_start),
                          "tokens_seen": step * run.tokens_per_step, "skipped_steps": engine.skipped_steps,
                          "elapsed_s": clock.elapsed(),
                          **window.summary()}
                if config.uses_mod:
                    record["mod"]["capacity"] = capacity
                plateau = None
                if settings.eval_steps and step % settings.eval_steps == 0:
                    record.update(_validation(run, validation))
                    plateau = run.controller.observe_validation(step, record["validation_loss"])
                train_loss = record["loss"]
                _log(run, record, writer, bar)
                new_coef = run.controller.observe_routing(step, record.get("moe"), config.router_aux_loss_coef)
                if new_coef is not None:
                    engine.module.config.router_aux_loss_coef = new_coef
                if config.uses_mod:
                    run.controller.observe_mod(step, record["mod"], capacity)
                if plateau == "lr":
                    _apply_controller_state(run)
                elif plateau == "stop":
                    settings.max_steps = step  # the run ends here, saved and summarised as usual
                window.reset()
                window_losses, window_start = [], busy()
            if settings.save_steps and step % settings.save_steps == 0 and step < settings.max_steps:
                with clock.phase("checkpoint"):
                    _save(run, step, train_loss)
    bar.close()
    writer.close()
    run.controller.close()
    return {"train_loss": train_loss, "tokens_seen": settings.max_steps * run.tokens_per_step,
            "steps": settings.max_steps}


def _log(run: Run, record: dict, writer: MetricsWriter, bar) -> None:
    stats = run.data.statistics
    if stats:
        record.update(entropy_floor=stats.entropy_floor, captured=stats.captured(record["loss"]))
    writer.write(record)
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
    floor = f" (floor {stats.entropy_floor:.3f}, captured {100 * record['captured']:.1f}%)" if stats else ""
    val = f" validation {record['validation_loss']:.4f}" if "validation_loss" in record else ""
    logger.info("step %d/%d loss %.4f%s%s lr %.2e %.0f tokens/s", record["step"], run.settings.max_steps,
                record["loss"], floor, val, record["lr"], record["tokens_per_s"])
