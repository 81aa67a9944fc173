"""One measurement of `python -m adaptive_ds.tools.realsize`, in a process of its own so that its peak resident set is
this model's alone:

    python -m adaptive_ds.tools.realsize_run --init_from FOLDER [--seq_len 256] [--no_step] [--load_only]
    python -m adaptive_ds.tools.realsize_run --layers N --ds_config b1_t4.json [--vocab_size 32000] [--seq_len 256]

The run is built as a training run builds it, with the training wing's own functions: its settings parsed and checked
from a command line (`--ds_config` a shipped config's engine at micro-batch 1 without accumulation: debug_cpu.json's
with `--init_from FOLDER`; with `--layers N`, the --ds_config's engine and its block's preset, architecture and
activation checkpointing, `--model '{"num_hidden_layers": N}'`), the folder opened, the embedded corpus loaded, the
model built (and loaded from the folder) (`startup.build_model`), the DeepSpeed engine built (`engine.build_engine`)
and the run's activation checkpointing applied to it. Then one forward and backward pass on a held-out row of the
corpus, and one optimizer step unless --no_step. The sequence is --seq_len (a run of a folder of no preset trains at
its max_position_embeddings, up to 2048; the benchmark keeps it short). `--vocab_size`: the model's vocabulary in
place of the embedded tokenizer's (a preset's published one; the corpus's token ids are below it).

Prints one JSON object: the resident set before the model and the peak of each phase (load, engine, forward and
backward, step), in bytes (Linux: each phase's high-water mark, reset between phases), and the model's parameters.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import tempfile

import psutil

from .. import distributed
from ..ds_config import load
from ..training import startup
from ..training.arguments import parse
from ..training.engine import build_engine, configured_knobs
from .benchmark import forget_peak_rss, peak_rss

ENGINE = "debug_cpu.json"  # the shipped ds_config whose engine the --init_from measurements use (ds_configs/)
RUN = {"data": "embedded", "max_steps": 1, "warmup_steps": 0}  # one step on the embedded corpus


def engine_config(block: dict, engine: str = ENGINE) -> dict:
    """The engine (precision, loss scaling, ZeRO stage and offload, optimizer, clipping) of the ds_config `engine`
    (a shipped config's name, or a path) at micro-batch 1 without accumulation, with `block` as its adaptive_ds
    block."""
    config = load(engine)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    config.pop("train_batch_size", None)
    config["adaptive_ds"] = block
    return config


def width_block(engine: str, layers: int, preset: str | None = None) -> dict:
    """The adaptive_ds block of a preset-width measurement: the ds_config `engine`'s preset (or `preset`),
    architecture and activation checkpointing, with `layers` layers, for one step on the embedded corpus."""
    shipped = load(engine).get("adaptive_ds", {})
    kept = {key: shipped[key] for key in ("preset", "arch", "activation_checkpointing") if key in shipped}
    return {**kept, **({"preset": preset} if preset else {}), **RUN, "model": {"num_hidden_layers": layers}}


def _settings(block: dict, engine: str, init_from: str | None):
    """The run's settings and DeepSpeed config, parsed and checked as a training command line's."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(engine_config(block, engine), f)
    try:
        return parse(["--ds_config", f.name, *(["--init_from", init_from] if init_from else [])], world_size=1)
    finally:
        os.unlink(f.name)


def measure(folder: str | None, seq_len: int, step: bool = True, load_only: bool = False, layers: int | None = None,
            engine: str = ENGINE, vocab_size: int | None = None, preset: str | None = None) -> dict:
    """The resident set before the model and each phase's peak, in bytes (see the module's docstring): the model
    of `folder`, or of `layers` layers of `preset` (default: that of `engine`'s block)."""
    distributed.init_distributed()
    block = width_block(engine, layers, preset) if layers is not None else {"arch": "dense", **RUN}
    settings, ds_config = _settings(block, engine, folder)
    source = startup.open_source(settings)
    data = startup.load_data(settings, seq_len)
    saved = startup.saved_tokenizer(source, data.tokenizer)  # whose special tokens the model takes
    config = startup.model_config_of(settings, source, data.tokenizer, saved, vocab_size)
    batch = data.validation_batches(1, 1)[0]
    gc.collect()
    before = psutil.Process().memory_info().rss
    phases = {}

    def phase(name: str) -> None:
        phases[name] = peak_rss()
        forget_peak_rss()  # the next phase's peak is its own

    forget_peak_rss()
    model = startup.build_model(config, settings, source, rank=0)
    phase("load")
    result = {"rss_before_model": before, "phases": phases, "seq_len": seq_len, "micro_batch": 1,
              "parameters": sum(p.numel() for p in model.parameters()), "optimizer_step": step and not load_only,
              "vocab_size": config.vocab_size}
    if load_only:
        return result
    engine = build_engine(model, ds_config, settings.warmup_steps, settings.max_steps, settings.min_lr_ratio)
    engine.module.apply_knobs(configured_knobs(engine, settings.activation_checkpointing))  # as the loop does
    phase("engine")
    out = engine(**{k: v.to(engine.device) for k, v in batch.items()}, skip_logits=True)  # as the loop calls it
    engine.backward(out.loss)
    result["loss"] = float(out.loss.detach())
    del out
    phase("forward_backward")
    if step:
        engine.step()
        phase("step")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Peak host memory of --init_from a folder, or of a "
                                                                "preset at --layers layers, on CPU.")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--init_from", help="a pretrained model's folder")
    model.add_argument("--layers", type=int, help="the --ds_config's preset with this many layers")
    p.add_argument("--ds_config", help=f"the engine (default: {ENGINE}; with --layers, required: its preset too)")
    p.add_argument("--preset", help="with --layers: the preset (default: the --ds_config's)")
    p.add_argument("--vocab_size", type=int, help="the model's vocabulary (default: the embedded tokenizer's)")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--no_step", action="store_true", help="forward and backward only, no optimizer step")
    p.add_argument("--load_only", action="store_true", help="build and load the model only")
    args = p.parse_args(argv)
    if args.layers is not None and (args.ds_config is None or args.layers < 1):
        p.error("--layers needs a positive count and --ds_config (the engine and the preset)")
    distributed.setup_logging(logging.WARNING)
    print(json.dumps(measure(args.init_from, args.seq_len, not args.no_step, args.load_only, args.layers,
                             args.ds_config or ENGINE, args.vocab_size, args.preset)))


if __name__ == "__main__":
    main()
