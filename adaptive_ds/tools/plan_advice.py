"""Advice for a plan that does not run: what does, each piece a whole ds_config planned again before it is offered.

    from adaptive_ds.tools.plan_advice import advise
    for advice in advise("b1", "moe", "t4", ds_config):
        print(advice.text)          # the changes, the advised config's peak, the CPU RAM it needs beside the host's
        advice.ds_config            # the config that makes them: preset, arch, model and GPU count included

The routes, each offering the least change of its kind that runs (or nothing):

- a host with more CPU RAM, where the offloaded optimizer is all that does not fit;
- the same GPUs: the savings the config has not taken (micro-batch 1 with more accumulation, activation
  checkpointing, the optimizer offloaded to CPU), fewest and cheapest first;
- more GPUs: for MoE, expert parallelism over the fewest GPUs that fit (moe_ep_size N on N data-parallel ranks, at
  the config's ZeRO stage and never 3, which DeepSpeed MoE does not run); for dense and MoD, ZeRO-3 over the fewest;
- fewer experts, or fewer experts split finer so that a token still chooses among as many (DeepSeekMoE, Dai et al.
  2024, arXiv 2401.06066): the most experts that fit;
- a smaller preset: the largest that fits.

"Runs" is the planner's judgement (`Plan.runs`): the predicted peak fits the GPU, the offloaded optimizer fits the
host RAM per GPU (of the usual instance with that GPU, `adaptive_ds/hardware.py`, or the host given: `plan`'s
`host_memory_gib`, which every advised config is planned with again), and DeepSpeed accepts the layout.
The other routes combine only with savings that do not already make the plan run on the same GPUs by themselves.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass

from .. import ds_config as ds_config_reader
from ..models.configuration import AdaptiveDSConfig
from ..presets import PRESETS
from .planner import Plan, gib_text, host_memory_text, model_facts, plan_ds_config

MAX_GPUS = 4096  # the most GPUs advice considers for a config that does not fix its global batch


@dataclass
class Advice:
    """One way to run what did not: its changes in words, and the ds_config that makes them."""

    changes: list[str]
    ds_config: dict
    gpus: int
    plan: Plan  # the ds_config planned again: it runs
    host_memory_gib: float | None = None  # CPU RAM per GPU it needs beyond the host's (None: the plan's host)

    @property
    def text(self) -> str:
        result = f"{self.plan.peak_gib:.1f} of {self.plan.gpu_memory_gib:.0f} GiB per GPU"
        if self.plan.cpu_states_gib:
            result += "; " + host_memory_text(self.plan)
        return "; ".join(self.changes) + f" -> {result}"


def advised_config(ds_config: dict, preset: str | None, arch: str, gpus: int, micro_batch: int | None = None,
                   checkpointing: bool | None = None, offload: bool = False, zero_stage: int | None = None,
                   model: dict | None = None) -> dict | None:
    """`ds_config` with the advised changes, self-contained: its adaptive_ds block names `preset`, `arch`, the
    model overrides and checkpointing (no preset where `preset` is None: a pretrained folder's model of no preset's
    shape), and train_batch_size = micro-batch x accumulation x `gpus`. A config that
    fixes its global batch keeps it (None where `gpus` x the micro-batch does not divide it); one that does not
    keeps its rows per GPU per step."""
    layout = ds_config_reader.read(ds_config)
    micro = micro_batch or layout.micro_batch
    total = layout.train_batch_size
    rows = layout.rows_per_rank_step if total is None else total // gpus
    if (total is not None and total % gpus) or rows % micro:
        return None
    config = copy.deepcopy(ds_config)
    block = config.setdefault("adaptive_ds", {})
    block.update(arch=arch)
    if preset is None:
        block.pop("preset", None)
    else:
        block["preset"] = preset
    if checkpointing is not None:
        block["activation_checkpointing"] = checkpointing
    if model:
        block["model"] = {**block.get("model", {}), **model}
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=rows // micro,
                  train_batch_size=rows * gpus)
    zero = config["zero_optimization"] = dict(config.get("zero_optimization") or {})
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["stage"] = max(zero.get("stage", 0), 1)  # ZeRO-Offload offloads ZeRO's optimizer partitions
    if zero_stage is not None:
        zero["stage"] = zero_stage
        if zero_stage < 3:
            zero.pop("offload_param", None)  # DeepSpeed offloads parameters at stage 3 only
    return config


@dataclass(frozen=True)
class _Start:
    """The plan that does not run, and what the advice may change about it."""

    preset: str | None
    arch: str
    gpu: str
    ds_config: dict
    gpus: int
    options: dict  # plan() options: vocabulary, tokens, MFU, price
    layout: ds_config_reader.DeepSpeedLayout
    checkpointing: bool
    model: AdaptiveDSConfig
    fixes: tuple[tuple[str, dict], ...]  # what every advice must change: (words, advised_config arguments)
    # the savings the other routes combine with: those that do not make it run on the same GPUs by themselves (an
    # advice that also changes the model or the GPUs would be a detour)
    levels: tuple[tuple[list[str], dict], ...] = ()

    def savings(self) -> list[tuple[list[str], dict]]:
        """The memory savings the config has not taken, every combination, fewest and cheapest first (docs/hardware.md,
        "When it does not fit"), each after the fixes."""
        knobs = []
        if self.layout.micro_batch > 1:
            knobs.append(("micro-batch 1 (more accumulation, the same global batch)", {"micro_batch": 1}))
        if not self.checkpointing:
            knobs.append(("activation checkpointing", {"checkpointing": True}))
        if self.layout.offload_optimizer == "none":
            knobs.append(("the optimizer offloaded to CPU (ZeRO-Offload)", {"offload": True}))
        combos = [combo for n in range(len(knobs) + 1) for combo in itertools.combinations(knobs, n)]
        return [([words for words, _ in (*self.fixes, *combo)],
                 {key: value for _, change in (*self.fixes, *combo) for key, value in change.items()})
                for combo in combos]

    def gpu_counts(self) -> list[int]:
        """GPU counts above the plan's that the config's batch allows: those that divide its global batch (each with
        a micro-batch that divides its share), or any up to MAX_GPUS where it fixes none."""
        total = self.layout.train_batch_size
        return [n for n in range(self.gpus + 1, (total or MAX_GPUS) + 1) if total is None or total % n == 0]

    def attempt(self, words: list[str], gpus: int | None = None, preset: str | None = None, **changes) -> Advice | None:
        """The advice these changes make, if its config runs when planned again."""
        preset, gpus = preset or self.preset, gpus or self.gpus
        config = advised_config(self.ds_config, preset, self.arch, gpus, **changes)
        if config is None:
            return None
        try:
            advised = plan_ds_config(preset, self.arch, self.gpu, config, **self.options)
        except ValueError:  # a model the configuration refuses (e.g. fewer experts than experts per token)
            return None
        return Advice(words, config, gpus, advised) if advised.runs else None


def _first(levels, candidates: list, attempt) -> Advice | None:
    """The advice of the first of `candidates` (least change first: fewest GPUs, most experts, largest model) that
    runs with one of the savings `levels`, the first that does; `attempt(candidate, words, settings)` plans one.
    Past the first candidate that runs every later one does too (less memory per GPU), so the list is bisected."""

    def runs(candidate):
        return next((advice for words, settings in levels if (advice := attempt(candidate, words, settings))), None)

    found, low, high = None, 0, len(candidates) - 1
    while low <= high:
        middle = (low + high) // 2
        advice = runs(candidates[middle])
        if advice:
            found, high = advice, middle - 1
        else:
            low = middle + 1
    return found


def _more_gpus(start: _Start) -> Advice | None:
    """A model that trains under ZeRO-3 (dense, MoD): ZeRO-3 over the fewest GPUs that fit; one with experts that
    does not (MoE) or that ZeRO-3 does not fit: expert parallelism over the fewest GPUs that fit (ZeRO stage 1 or 2,
    as DeepSpeed MoE needs)."""
    counts = start.gpu_counts()
    if start.model.zero3_problem is None:
        advice = _first(start.levels, counts, lambda n, words, settings: start.attempt(
            [f"ZeRO-3 across {n} GPUs", *words], gpus=n, **{**settings, "zero_stage": 3}))
        if advice is not None or not start.model.num_moe_layers:
            return advice
    elif not start.model.num_moe_layers:  # neither ZeRO-3 nor experts to split: more GPUs do not help
        return None
    experts, stage = start.model.num_routed_experts, min(start.layout.zero_stage, 2)
    groups = [n for n in range(start.model.moe_ep_size + 1, experts + 1)
              if experts % n == 0 and math.lcm(start.gpus, n) in [start.gpus, *counts]]

    def attempt(n, words, settings):
        gpus = math.lcm(start.gpus, n)
        return start.attempt([f"expert parallelism across {n} GPUs (moe_ep_size {n}, {gpus} data-parallel ranks, "
                              f"ZeRO stage {stage})", *words], gpus=gpus,
                             **{**settings, "model": {**settings.get("model", {}), "moe_ep_size": n}})
    return _first(start.levels, groups, attempt)


def _fewer_experts(start: _Start) -> Advice | None:
    """The most experts below the configured number that fit (more than the experts per token: still routed)."""
    model = start.model
    if not model.num_moe_layers:
        return None
    counts = [n for n in range(model.num_local_experts - 1, model.num_experts_per_tok, -1)
              if n * model.moe_expert_granularity % model.moe_ep_size == 0]
    return _first(start.levels, counts, lambda n, words, settings: start.attempt(
        [f"{n} experts instead of {model.num_local_experts} (num_local_experts {n})", *words],
        **{**settings, "model": {**settings.get("model", {}), "num_local_experts": n}}))


def _finer_experts(start: _Start) -> Advice | None:
    """Fewer experts, each split finer (DeepSeekMoE), so that a token still chooses among as many routed experts:
    the most experts below the configured number that fit."""
    model = start.model
    if not model.num_moe_layers:
        return None
    counts = [n for n in range(model.num_local_experts - 1, model.num_experts_per_tok, -1)
              if model.num_local_experts % n == 0
              and model.intermediate_size % (model.moe_expert_granularity * model.num_local_experts // n) == 0]

    def attempt(n, words, settings):
        parts = model.moe_expert_granularity * model.num_local_experts // n
        return start.attempt(
            [f"{n} experts split {parts} ways (num_local_experts {n}, moe_expert_granularity {parts}): the same "
             f"{model.num_routed_experts} routed experts, each {parts / model.moe_expert_granularity:g} times "
             f"narrower, top-{model.num_experts_per_tok * parts}", *words],
            **{**settings, "model": {**settings.get("model", {}), "num_local_experts": n,
                                     "moe_expert_granularity": parts}})
    return _first(start.levels, counts, attempt)


def _larger_host(start: _Start, base: Plan) -> Advice | None:
    """The same config on a host with more CPU RAM, where the offloaded optimizer is all that does not fit: the
    whole GiB it needs per GPU (instances with the same GPU and more memory are common: the usual one is the
    smallest)."""
    usual = base.host_memory_gib
    if not base.fits or usual is None or base.cpu_states_gib <= usual:
        return None
    needed = float(math.ceil(base.cpu_states_gib))
    again = plan_ds_config(start.preset, start.arch, start.gpu, start.ds_config, start.gpus,
                           **{**start.options, "host_memory_gib": needed, "host_detail": None})
    if not again.runs:
        return None
    return Advice([f"a host with at least {needed:.0f} GiB of CPU RAM per GPU ({base.host_label} has "
                   f"{gib_text(usual)})"], start.ds_config, start.gpus, again, needed)


def _parameters(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _smaller_preset(start: _Start) -> Advice | None:
    """The largest smaller preset that fits, in the same architecture and model overrides; none for a model of no
    preset (a pretrained folder's shape is its own)."""
    if start.preset is None:
        return None
    vocab, overrides = start.options.get("vocab_size", 32000), start.ds_config.get("adaptive_ds", {}).get("model")
    sizes = {name: model_facts(name, start.arch, vocab, overrides).counts.total for name in PRESETS}
    smaller = sorted((name for name in PRESETS if sizes[name] < sizes[start.preset]), key=sizes.get, reverse=True)
    return _first(start.levels, smaller, lambda name, words, settings: start.attempt(
        [f"preset {name} instead of {start.preset} ({_parameters(sizes[name])} parameters)", *words], preset=name,
        **settings))


def advise(preset: str | None, arch: str, gpu: str, ds_config: dict, gpus: int | None = None,
           **options) -> list[Advice]:
    """What runs instead of the plan of `ds_config` (`plan_ds_config`'s arguments), none if it runs: on the same
    GPUs with the savings it has not taken; on more GPUs; with fewer or finer experts; as a smaller preset. Each is
    the least change of its kind that runs: planned again, its config fits the GPU and the usual host, and never
    asks DeepSpeed MoE for ZeRO-3."""
    base = plan_ds_config(preset, arch, gpu, ds_config, gpus, **options)
    if base.runs:
        return []
    block = ds_config.get("adaptive_ds", {})
    model = model_facts(preset, arch, options.get("vocab_size", 32000), block.get("model"),
                        options.get("seq_len")).config
    layout = ds_config_reader.read(ds_config)
    fixes = (((f"ZeRO stage 2 ({model.zero3_problem})", {"zero_stage": 2}),)
             if model.zero3_problem is not None and layout.zero_stage == 3 else ())
    start = _Start(preset, arch, gpu, ds_config, base.gpus, options, layout,
                   bool(block.get("activation_checkpointing")), model, fixes)

    same = _first(start.savings(), [start.gpus], lambda n, words, settings: start.attempt(words, **settings)
                  if words else None)
    start = dataclasses.replace(start, levels=tuple(
        (words, settings) for words, settings in start.savings() if not (words and start.attempt(words, **settings))))
    found = [_larger_host(start, base), same, _more_gpus(start), _fewer_experts(start), _finer_experts(start),
             _smaller_preset(start)]
    return [advice for advice in found if advice]
