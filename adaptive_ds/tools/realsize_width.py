"""A preset's width on CPU: the host memory of its model at a few layer counts, measured, fitted to a line and
extrapolated to the preset's own depth, beside the planner's projection. `python -m adaptive_ds.tools.realsize`'s
width mode:

    python -m adaptive_ds.tools.realsize --preset b1 --layers 2 4 8 --ds_config ds_configs/b1_t4.json [--seq_len 256]

Each layer count is measured in a process of its own (`realsize_run --layers N`): the preset's model with N layers
(`--model '{"num_hidden_layers": N}'`), built as a training run builds it, at the preset's published vocabulary
(--vocab_size, 32,000: the embedded tokenizer the run reads is smaller, and its token ids lie below it); the engine of
--ds_config as configured (precision and loss scaling, ZeRO stage, offload, optimizer, clipping; its block's
activation checkpointing) at micro-batch 1 without accumulation, at --seq_len; one forward and backward pass and one
optimizer step. Measured: the process's peak resident set over its resident set before the model, per phase.

The accounting on a machine without a GPU: the states a GPU would hold and those offloaded to the host share one RAM,
so the measured peak is compared with the planner's whole projection for a CPU process (`planner.plan`,
`cpu_process`: the "device" part and the host part of its peak phase, the backward's or the step's). Fitted: a
least-squares line of the measured peaks against the layer count, extrapolated to the preset's depth, which is not
measured. The host question: the host part the planner projects for the config as configured on --gpu (its gradient
accumulation and pinned memory included, which the measurement at accumulation 1 on a CPU has not), beside the fitted
one-RAM peak, against the RAM of the usual host and of `HOSTS`: a host fits when it holds the larger of the two.

`--restate REPORT` works a width report's projections and host question out anew from its recorded measurements with
this version's planner (`restate`); nothing is measured.
"""

from __future__ import annotations

import time

import numpy as np
import psutil

from .. import ds_config as ds_config_reader
from ..presets import PRESETS
from .realsize_process import GIB, measure, phases_over_start, wait_for_memory
from .report import commit, machine

# The host RAM of the free notebook services with a T4 (Colab; Kaggle, whose two-T4 machine's RAM one process uses
# here), as their machines report it: the hosts the width mode answers for beside the usual cloud instance.
HOSTS = {"t4": {"Colab (T4)": 12.7, "Kaggle (T4)": 29.0}}


def projection(preset: str, engine: str, layers: int, seq_len: int, vocab_size: int) -> dict:
    """The planner's peak for a CPU process training `preset` with `layers` layers on `engine`'s engine at micro-batch
    1 (the GPU only names a device for the plan: a CPU process's peak does not depend on it): the whole, its peak
    phase (the backward's, or the optimizer step's), and that phase's host part (the offloaded states) and the rest
    (what a GPU would hold)."""
    from .planner import plan_ds_config
    from .realsize_run import engine_config, width_block

    block = {**width_block(engine, layers), "preset": preset}
    config = engine_config(block, engine)
    planned, backward = (plan_ds_config(preset, block.get("arch", "dense"), "h200", config, 1, vocab_size=vocab_size,
                                        cpu_process=True, seq_len=seq_len, optimizer_step=step)
                         for step in (True, False))
    return {"projected_gib": planned.peak_gib, "projected_host_gib": planned.peak_host_gib,
            "projected_device_gib": planned.peak_gib - planned.peak_host_gib,
            "projected_phase": "forward_backward" if planned.peak_gib == backward.peak_gib else "step",
            "planned_parameters": planned.total_parameters}


def check_memory(preset: str, engine: str, layer_counts: list[int], seq_len: int, vocab_size: int,
                 wait_s: float) -> None:
    """Before anything is measured: the largest layer count's projected peak (and a margin for the process's runtime)
    must fit this machine, and be available now unless the run may wait for it (SystemExit in one line)."""
    needed = max(projection(preset, engine, n, seq_len, vocab_size)["projected_gib"] for n in layer_counts) + 0.5
    memory = psutil.virtual_memory()
    if needed > memory.total / GIB:
        raise SystemExit(f"error: --layers {max(layer_counts)} needs about {needed:.1f} GiB (the planner's peak and "
                         f"a margin), more than this machine's {memory.total / GIB:.1f} GiB: pass fewer layers")
    if not wait_s:
        wait_for_memory(needed, 0.0)


def measure_layers(preset: str, engine: str, layers: int, seq_len: int, vocab_size: int, wait_s: float) -> dict:
    """One layer count measured in a process of its own beside its projection, once the memory the planner projects
    (and a margin for the process's runtime) is available."""
    planned = projection(preset, engine, layers, seq_len, vocab_size)
    wait_for_memory(planned["projected_gib"] + 0.5, wait_s)
    measured = measure("--layers", str(layers), "--preset", preset, "--ds_config", engine, "--seq_len", str(seq_len),
                       "--vocab_size", str(vocab_size))
    return {"layers": layers, "parameters": measured["parameters"], "vocab_size": measured["vocab_size"],
            "optimizer_step": True, "loss": measured["loss"], "why_no_step": None, **phases_over_start(measured),
            **planned}


def fit_line(layers: list[int], peaks: list[float]) -> dict:
    """The least-squares line peak = intercept + slope x layers, and each point's residual (measured - fitted)."""
    design = np.stack([np.ones(len(layers)), np.asarray(layers, dtype=float)], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design, np.asarray(peaks, dtype=float), rcond=None)
    return {"intercept_gib": float(intercept), "slope_gib_per_layer": float(slope),
            "residuals_gib": {str(n): float(p - (intercept + slope * n)) for n, p in zip(layers, peaks, strict=True)}}


def host_question(preset: str, engine: str, gpu: str, fitted_gib: float, vocab_size: int) -> dict:
    """The preset at its own depth and `vocab_size` on `engine` as configured (its gradient accumulation and pinned
    memory included), on `gpu`: the host part the planner projects and what of it accumulation and pinning make,
    beside the fitted one-RAM peak and the RAM of the usual host with that GPU and of the hosts `HOSTS` names."""
    from .planner import Layout, plan_ds_config

    raw = ds_config_reader.load(engine)
    planned = plan_ds_config(preset, raw.get("adaptive_ds", {}).get("arch", "dense"), gpu, raw, vocab_size=vocab_size)
    hosts = {}
    if planned.host_memory_gib is not None:
        hosts[f"{planned.host_label}, {planned.host_detail}"] = planned.host_memory_gib
    hosts.update(HOSTS.get(gpu, {}))
    return {"gpu": gpu, "gpus": planned.gpus, "accumulation": planned.accumulation,
            "pin_memory": Layout.from_ds_config(raw, False, planned.gpus).pin_memory,
            "projected_host_gib": planned.cpu_states_gib,
            "projected_accumulation_gib": planned.accumulation_buffers_gib,
            "projected_pinned_rounding_gib": planned.pinned_rounding_gib,
            "projected_gpu_peak_gib": planned.peak_gib, "gpu_memory_gib": planned.gpu_memory_gib,
            "fitted_one_ram_gib": fitted_gib, "hosts_gib": hosts}


def restate(report: dict) -> dict:
    """A width report with the parts the planner makes worked out by this version from its recorded measurements and
    fit: each layer count's projection, the projection at the preset's depth, and the host question; nothing
    measured changes."""
    preset, engine, seq_len, vocab = report["preset"], report["ds_config"], report["seq_len"], report["vocab_size"]
    models = {n: {**m, **projection(preset, engine, int(n), seq_len, vocab)} for n, m in report["models"].items()}
    at_depth = projection(preset, engine, report["preset_layers"], seq_len, vocab)
    fit = {**report["fit"], **{f"{key}_at_preset": value for key, value in at_depth.items()}}
    return {**report, "models": models, "fit": fit,
            "host": host_question(preset, engine, report["host"]["gpu"], fit["fitted_gib_at_preset"], vocab)}


def engine_facts(engine: str) -> dict:
    """What the report states of the ds_config `engine`: its engine's precision, loss scaling, ZeRO stage and offload,
    and its block's architecture, training tokenizer and activation checkpointing."""
    raw = ds_config_reader.load(engine)
    layout, block = ds_config_reader.read(raw), raw.get("adaptive_ds", {})
    scale = raw.get("fp16", {}).get("loss_scale", 0) if layout.precision == "fp16" else None
    return {"arch": block.get("arch", "dense"), "tokenizer": block.get("tokenizer"), "precision": layout.precision,
            "loss_scale": "dynamic" if scale == 0 else scale, "zero_stage": layout.zero_stage,
            "offload_optimizer": layout.offload_optimizer,
            "activation_checkpointing": bool(block.get("activation_checkpointing"))}


def width_command(preset: str, engine: str, layer_counts: list[int], seq_len: int, vocab_size: int, gpu: str) -> str:
    """The command that measures these settings (defaults left out)."""
    return (f"python -m adaptive_ds.tools.realsize --preset {preset} --layers {' '.join(map(str, layer_counts))} "
            f"--ds_config {engine} --seq_len {seq_len}" + (f" --vocab_size {vocab_size}" if vocab_size != 32000 else "")
            + (f" --gpu {gpu}" if gpu != "t4" else ""))


def run_width_benchmark(preset: str, engine: str, layer_counts: list[int], seq_len: int, vocab_size: int = 32000,
                        gpu: str = "t4", wait_s: float = 0.0) -> dict:
    """Measure `preset` at each of `layer_counts` on `engine`'s engine, fit the line, and project the preset's own
    depth (not measured) beside it."""
    import deepspeed
    import torch
    import transformers

    check_memory(preset, engine, layer_counts, seq_len, vocab_size, wait_s)
    models = {str(n): measure_layers(preset, engine, n, seq_len, vocab_size, wait_s) for n in layer_counts}
    depth = PRESETS[preset].num_hidden_layers
    fit = fit_line(layer_counts, [models[str(n)]["measured_gib"] for n in layer_counts])
    fitted = fit["intercept_gib"] + fit["slope_gib_per_layer"] * depth
    return restate({
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(),
        "command": width_command(preset, engine, layer_counts, seq_len, vocab_size, gpu),
        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
        "machine_memory_gib": psutil.virtual_memory().total / GIB, "ds_config": engine, "preset": preset,
        "vocab_size": vocab_size, **engine_facts(engine), "micro_batch": 1, "seq_len": seq_len,
        "preset_layers": depth, "models": models,
        "fit": {**fit, "layers": layer_counts, "fitted_gib_at_preset": fitted, "measured_at_preset": False},
        "host": {"gpu": gpu}})


def _gib(value: float) -> str:
    return f"{value:.2f} GiB"


def _engine_words(report: dict) -> str:
    precision = report["precision"] + (" with dynamic loss scaling" if report["loss_scale"] == "dynamic" else
                                       f" with loss scale {report['loss_scale']}" if report["loss_scale"] else "")
    offload = (f", the optimizer offloaded to {report['offload_optimizer'].upper()}: DeepSpeed's CPU Adam"
               if report["offload_optimizer"] != "none" else ", torch's AdamW")
    checkpointing = ", activation checkpointing" if report["activation_checkpointing"] else ""
    return f"{precision}, ZeRO-{report['zero_stage']}{offload}{checkpointing}"


PHASES = {"load": "load", "engine": "engine", "forward_backward": "backward", "step": "step"}


def _measured_rows(report: dict) -> list[str]:
    rows = []
    for n, m in report["models"].items():
        measured = PHASES[max(m["phases_gib"], key=m["phases_gib"].get)]
        rows.append(f"| {n} | {m['parameters']:,} / {m['planned_parameters']:,} | {_gib(m['measured_gib'])} | "
                    f"{_gib(m['projected_device_gib'])} + {_gib(m['projected_host_gib'])} = "
                    f"{_gib(m['projected_gib'])} | {measured} / {PHASES[m['projected_phase']]} | "
                    f"{100 * (m['projected_gib'] / m['measured_gib'] - 1):+.1f}% |")
    return rows


def host_verdict(host: dict, gib: float) -> str:
    """A host of `gib` per GPU against the projected host part (what the config as configured keeps there beside a
    GPU) and the fitted one-RAM peak (what the measured process needed, at accumulation 1 and unpinned, without a
    GPU): it fits when it holds the larger of the two."""
    projected, fitted = host["projected_host_gib"], host["fitted_one_ram_gib"]
    if gib >= max(projected, fitted):
        return "fits: at least the projected host part and the fitted one-RAM peak"
    if gib < projected:
        return "**does not fit**: the projected host part alone is more"
    return "not settled: it holds the projected host part, not the fitted one-RAM peak (which holds the GPU's part too)"


def _host_rows(report: dict) -> list[str]:
    host = report["host"]
    return [f"| {name} | {gib:g} GiB | {host_verdict(host, gib)} |" for name, gib in host["hosts_gib"].items()]


def _layers(n: int | str) -> str:
    return f"{n} layer{'s' * (int(n) != 1)}"


def _provenance(report: dict) -> list[str]:
    counts = ", ".join(report["models"])
    vocabulary = (f"the vocabulary of {report['vocab_size']:,} its training tokenizer has (`{report['tokenizer']}`; "
                  if report.get("tokenizer") == f"bpe:{report['vocab_size']}" else
                  f"a vocabulary of {report['vocab_size']:,} (")
    return [
        f"Measured {report['date']} on {report['machine']} ({report['machine_memory_gib']:.1f} GiB), torch "
        f"{report['torch']}, deepspeed {report['deepspeed']}, transformers {report['transformers']}, commit "
        f"{report['commit']}: `{report['command']}`. The model: preset {report['preset']} ({report['arch']}) at its "
        f"width with {counts} layers (`--model '{{\"num_hidden_layers\": N}}'`), built as a training run builds it, "
        f"with {vocabulary}the embedded tokenizer the run reads is smaller, and its token ids lie below it). The "
        f"engine of `{report['ds_config']}` as configured ({_engine_words(report)}) at micro-batch "
        f"{report['micro_batch']} without accumulation, seq {report['seq_len']}, one process on CPU: one forward and "
        "backward pass and one optimizer step.",
        "",
        "The accounting without a GPU: what a GPU would hold and what the offload puts in host RAM share the "
        "machine's one RAM, so the measured peak (the process's peak resident set minus its resident set before the "
        "model) is compared with the planner's device part and host part of its peak phase together (projected: the "
        "planner's model for a CPU process, `adaptive_ds/tools/planner.py`, at this version: `--restate` works the "
        "projections out anew from the recorded measurements). The planner's device part of the step is the "
        "weights and the offload's GPU-side gradient buffer; of the backward, also the gradients and activations; "
        "its host part of the step holds Adam's moments, which the backward has not yet.",
    ]


def _fit_lines(report: dict) -> list[str]:
    fit, depth = report["fit"], report["preset_layers"]
    counts = ", ".join(report["models"])
    residuals = ", ".join(f"{_layers(n)} {r:+.3f} GiB" for n, r in fit["residuals_gib"].items())
    return [
        f"Fitted: the least-squares line of the measured peaks over {counts} layers, {_gib(fit['intercept_gib'])} + "
        f"{_gib(fit['slope_gib_per_layer'])} per layer (residuals: {residuals}). At the preset's {depth} layers, "
        "which were **not measured**:", "",
        f"| {report['preset']} {report['arch']}, {depth} layers, one RAM | peak |", "|---|---|",
        f"| fitted (extrapolated from {counts} layers) | {_gib(fit['fitted_gib_at_preset'])} |",
        f"| projected (device + host, the {PHASES[fit['projected_phase_at_preset']]}'s) | "
        f"{_gib(fit['projected_device_gib_at_preset'])} + {_gib(fit['projected_host_gib_at_preset'])} = "
        f"{_gib(fit['projected_gib_at_preset'])} |",
    ]


def _host_counts(host: dict) -> str:
    """What the projected host part counts that the measurement could not: accumulation buffers, pinned rounding."""
    parts = []
    if host["projected_accumulation_gib"]:
        parts.append(f"{_gib(host['projected_accumulation_gib'])} are DeepSpeed's gradient accumulation buffers at the "
                     f"config's accumulation {host['accumulation']}, one per parameter in the training precision")
    if host["projected_pinned_rounding_gib"]:
        parts.append(f"{_gib(host['projected_pinned_rounding_gib'])} torch's CUDA pinned allocator rounding each "
                     "buffer the offload pins (pin_memory on) up to the next power of two, read from torch's source "
                     "and not measured here: DeepSpeed's CPU accelerator pins nothing, so this measurement cannot show "
                     "it")
    return "; of it, " + ", and ".join(parts) if parts else ""


def _host_lines(report: dict) -> list[str]:
    host, depth = report["host"], report["preset_layers"]
    projected, fitted = host["projected_host_gib"], host["fitted_one_ram_gib"]
    order = (f"It is below the projected host part, {_gib(projected - fitted)} less: it bounds nothing here, and a "
             "host fits when it holds the projected host part" if fitted < projected else
             f"It is above the projected host part, {_gib(fitted - projected)} more, as it holds what a GPU would; a "
             "host between the two is not settled by either, and one that holds the fitted peak fits")
    return [
        f"The host of a {host['gpu']}: `{report['ds_config']}` as configured on {host['gpus']} x {host['gpu']} "
        f"({_gib(host['projected_gpu_peak_gib'])} projected on the GPU, of {host['gpu_memory_gib']:g} GiB) keeps the "
        f"offloaded optimizer's states in host RAM, {_gib(projected)} per GPU projected at {report['vocab_size']:,} "
        f"vocabulary entries{_host_counts(host)}. The fitted one-RAM peak at {depth} layers, {_gib(fitted)}, is "
        f"what this measurement's settings need on a machine without a GPU, at accumulation 1 and unpinned. {order} "
        "(both over the process's resident set before the model: the runtime and the operating system need their "
        "own):", "",
        f"| host | RAM per GPU | {report['preset']} {report['arch']} on `{report['ds_config']}` |", "|---|---|---|",
        *_host_rows(report),
    ]


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a width report: provenance and accounting, measured against projected per layer
    count and phase, the fitted line at the preset's depth beside the projection, and the host question."""
    phases = [f"| {n} | {_gib(m['phases_gib']['load'])} | {_gib(m['phases_gib']['engine'])} | "
              f"{_gib(m['phases_gib']['forward_backward'])} | {_gib(m['phases_gib']['step'])} |"
              for n, m in report["models"].items()]
    return "\n".join([
        *_provenance(report), "",
        "| layers | parameters (built / planned) | measured peak | projected: device + host = one RAM | peak phase: "
        "measured / projected | error |", "|---|---|---|---|---|---|", *_measured_rows(report),
        "", "Each phase's peak over the resident set before the model (measured):", "",
        "| layers | load | engine | forward and backward | optimizer step |", "|---|---|---|---|---|", *phases,
        "", *_fit_lines(report), "", *_host_lines(report),
    ])
