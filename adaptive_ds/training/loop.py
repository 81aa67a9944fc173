"""The training run: build the model and data, train through the DeepSpeed engine, write the output contract.

Outputs in OUTPUT_DIR: metrics.jsonl (one object per logged step), summary.json, final/ (save_pretrained).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import distributed
from ..data import build_training_data
from ..models import AdaptiveDSForCausalLM
from ..presets import PRESETS, model_config, parameter_counts
from .arguments import ConfigError, RunSettings, parse
from .checkpoint import save_final
from .metrics import MetricsWriter, RoutingWindow, peak_memory
from .optim import parameter_groups, scheduler_factory

logger = logging.getLogger(__name__)


def _prepare_output_dir(settings: RunSettings) -> str:
    """A new or empty directory, agreed on by every rank. Never writes into an earlier run's outputs."""
    path = settings.output_dir or f"runs/{settings.preset}-{settings.arch}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = distributed.broadcast_object(path)
    if os.path.isdir(path) and os.listdir(path):
        raise ConfigError(f"output_dir {path!r} already holds files; pass a new or empty --output_dir")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"output_dir {path!r} is a file; pass a new or empty --output_dir")
    dist.barrier()  # every rank has checked before rank 0 creates it
    if distributed.rank() == 0:
        os.makedirs(path, exist_ok=True)
    return path


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


def mod_capacity_at(step: int, target: float, warmup_steps: int) -> float:
    """Capacity schedule: linear from 1.0 at step 0 to `target` at `warmup_steps`, constant afterwards."""
    if step >= warmup_steps:
        return target
    return 1.0 + (target - 1.0) * step / warmup_steps


def train(argv: list[str] | None = None) -> dict:
    """Run training as the command line `argv` says; returns the summary (on every rank)."""
    distributed.setup_logging()
    # Validate before joining the process group: bad input should cost nothing and touch nothing.
    settings, ds_config = parse(argv, int(os.environ.get("WORLD_SIZE", "1")))
    distributed.init_distributed()
    rank, world = distributed.rank(), distributed.world_size()
    seq_len = PRESETS[settings.preset].seq_len
    data = build_training_data(settings.data, seq_len, settings.seed)
    tok = data.tokenizer
    config = model_config(settings.preset, settings.arch, len(tok), eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **settings.model)
    output_dir = _prepare_output_dir(settings)
    started = time.time()

    torch.manual_seed(settings.seed)
    model = AdaptiveDSForCausalLM(config)
    counts = parameter_counts(config)
    weight_decay = ds_config["optimizer"].get("params", {}).get("weight_decay", 0.0)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model, weight_decay), config=ds_config,
        lr_scheduler=scheduler_factory(settings.warmup_steps, settings.max_steps, settings.min_lr_ratio),
    )
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    logger.info("%s %s: %s parameters (%s active), %d process(es), micro-batch %d x accumulation %d, seq %d",
                settings.preset, settings.arch, f"{counts.total:,}", f"{counts.active:,}", world, micro, accum,
                seq_len)
    stats = data.statistics
    if stats:
        logger.info("embedded corpus: entropy floor %.3f nats/token, unigram entropy %.3f",
                    stats.entropy_floor, stats.unigram_entropy)

    summary = _train_loop(engine, config, settings, data, output_dir, micro, accum)
    validation = data.validation_batches(micro, settings.eval_batches)
    val_loss = evaluate(engine, validation)
    if config.uses_mod:
        summary["validation_loss_topk_routing"] = evaluate(engine, validation, "topk")
    save_final(engine.module, tok, os.path.join(output_dir, "final"), is_writer=rank == 0)
    summary.update(
        preset=settings.preset, arch=settings.arch, world_size=world, seq_len=seq_len,
        validation_loss=val_loss, final_perplexity=math.exp(val_loss),
        total_parameters=counts.total, active_parameters=counts.active,
        wall_time_s=time.time() - started, peak_memory=peak_memory(),
    )
    if stats:
        summary.update(entropy_floor=stats.entropy_floor, unigram_entropy=stats.unigram_entropy,
                       captured=stats.captured(val_loss))
    if rank == 0:
        with open(os.path.join(output_dir, "summary.json"), "w") as f:
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


def _train_loop(engine, config, settings: RunSettings, data, output_dir: str, micro: int, accum: int) -> dict:
    rank, world = distributed.rank(), distributed.world_size()
    batches = data.train_batches(micro, rank, world)
    window = RoutingWindow(config)
    writer = MetricsWriter(os.path.join(output_dir, "metrics.jsonl") if rank == 0 else None)
    stats = data.statistics
    tokens_per_step = micro * accum * world * data.seq_len
    bar = tqdm(total=settings.max_steps, disable=rank != 0, dynamic_ncols=True, desc="train")
    window_losses, window_start, train_loss = [], time.time(), float("nan")
    with logging_redirect_tqdm(loggers=[logging.getLogger("adaptive_ds")]):
        for step in range(1, settings.max_steps + 1):
            if config.uses_mod:
                capacity = mod_capacity_at(step - 1, config.mod_capacity, settings.mod_capacity_warmup_steps)
                engine.module.model.set_mod_capacity(capacity)
            for _ in range(accum):
                batch = {k: v.to(engine.device) for k, v in next(batches).items()}
                out = engine(**batch)
                engine.backward(out.loss)
                engine.step()
                window_losses.append(out.lm_loss.item())
                window.add(out)
            bar.update(1)
            if step % settings.log_steps and step != settings.max_steps:
                continue
            elapsed = time.time() - window_start
            train_loss = _mean_over_ranks(sum(window_losses) / len(window_losses))
            steps_in_window = len(window_losses) // accum
            record = {
                "step": step, "loss": train_loss, "lr": engine.get_lr()[0],
                "tokens_per_s": steps_in_window * tokens_per_step / elapsed,
                "tokens_seen": step * tokens_per_step, **window.summary(),
            }
            if config.uses_mod:
                record["mod"]["capacity"] = capacity
            if stats:
                record.update(entropy_floor=stats.entropy_floor, captured=stats.captured(train_loss))
            writer.write(record)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            floor = f" (floor {stats.entropy_floor:.3f}, captured {100 * record['captured']:.1f}%)" if stats else ""
            logger.info("step %d/%d loss %.4f%s lr %.2e %.0f tokens/s", step, settings.max_steps, train_loss, floor,
                        record["lr"], record["tokens_per_s"])
            window.reset()
            window_losses, window_start = [], time.time()
    bar.close()
    writer.close()
    return {"train_loss": train_loss, "tokens_seen": settings.max_steps * tokens_per_step, "steps": settings.max_steps}
