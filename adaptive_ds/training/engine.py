"""The DeepSpeed engine of a run: built once, and the one place where the controller's knobs reach it."""

from __future__ import annotations

import deepspeed
import torch

from ..models import AdaptiveDSForCausalLM
from . import deepspeed_muon, moe_adapter
from .controller import Knobs
from .optim import parameter_groups, scheduler_factory


def build_engine(model: AdaptiveDSForCausalLM, ds_config: dict, warmup_steps: int, max_steps: int,
                 min_lr_ratio: float, compile: bool = False) -> deepspeed.DeepSpeedEngine:
    """`deepspeed.initialize` with weight-decay and MoE param groups and the warm-up + cosine schedule.

    The model is first made DeepSpeed's to train (`moe_adapter.prepare`: its MoE MLPs in DeepSpeed's MoE layer, which
    the engine then gives its expert-parallel group), and the param groups are made on it as DeepSpeed trains it."""
    moe_adapter.prepare(model)
    deepspeed_muon.import_muon()  # before DeepSpeed does, so that its compile waits for a Muon run's first step
    weight_decay = ds_config["optimizer"].get("params", {}).get("weight_decay", 0.0)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model, weight_decay), config=ds_config,
        lr_scheduler=scheduler_factory(warmup_steps, max_steps, min_lr_ratio),
    )
    if compile:
        engine.compile()  # in place: the module keeps its parameter names, so checkpoints and final/ are unchanged
    return engine


def configured_knobs(engine: deepspeed.DeepSpeedEngine, activation_checkpointing: bool) -> Knobs:
    """The knobs as the ds_config and settings configure them (the controller's defaults)."""
    return Knobs(micro_batch=engine.train_micro_batch_size_per_gpu(),
                 accumulation=engine.gradient_accumulation_steps(),
                 activation_checkpointing=activation_checkpointing,
                 **engine.module.default_knobs())  # the architecture's: aux_coef, mod_capacity


def apply_knobs(engine: deepspeed.DeepSpeedEngine, knobs: Knobs, base_lrs: list[float]) -> None:
    """Make the engine and model follow `knobs`. `base_lrs`: the schedule's peak learning rates as configured
    (captured once at build time), which `lr_scale` multiplies. Idempotent: applying the same knobs twice is a
    no-op."""
    engine.set_train_micro_batch_size(knobs.micro_batch)
    engine.set_train_batch_size(knobs.micro_batch * knobs.accumulation * engine.dp_world_size)
    engine.module.apply_knobs(knobs)  # activation checkpointing and the architecture's knobs
    scheduler = engine.lr_scheduler
    scheduler.base_lrs = [lr * knobs.lr_scale for lr in base_lrs]
    for group, base, factor in zip(engine.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                   strict=False):
        group["lr"] = base * factor(scheduler.last_epoch)


def loss_scale(engine: deepspeed.DeepSpeedEngine) -> float | None:
    """The fp16 loss scale DeepSpeed holds now (dynamic scaling halves it on overflows, as the config's `hysteresis`
    says, and doubles it after `loss_scale_window` steps without one); None without fp16, which scales nothing."""
    return float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None


def discard_partial_step(engine: deepspeed.DeepSpeedEngine, micro_steps_before: int) -> None:
    """Forget the gradients of a step that failed part-way (out of memory in its third micro-batch, say), so
    that its retry starts from nothing: parameter gradients, ZeRO-1/2's per-step accumulation buffers and the
    engine's micro-step count."""
    optimizer = engine.optimizer
    optimizer.zero_grad(set_to_none=True)
    for name in ("all_grad_tensors", "averaged_gradients"):  # ZeRO-1/2 accumulation across micro-batches
        buffers = getattr(optimizer, name, None)
        if isinstance(buffers, dict):
            for key in buffers:
                buffers[key] = None
    if hasattr(optimizer, "reset_partition_gradient_structures"):
        optimizer.reset_partition_gradient_structures()
    engine.micro_steps = micro_steps_before
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
