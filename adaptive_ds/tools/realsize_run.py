"""One measurement of `python -m adaptive_ds.tools.realsize`, in a process of its own so that its peak resident set is
this model's alone:

    python -m adaptive_ds.tools.realsize_run --init_from FOLDER [--seq_len 256] [--no_step] [--load_only]

The run is built as a training run builds it, with the training wing's own functions: its settings parsed and checked
from a command line (`--ds_config` the engine of ds_configs/debug_cpu.json at micro-batch 1, `--init_from FOLDER`),
the folder opened, the embedded corpus loaded, the model built and loaded from the folder (`startup.build_model`),
the DeepSpeed engine built (`engine.build_engine`). Then one forward and backward pass on a held-out row of the
corpus, and one optimizer step unless --no_step. The sequence is --seq_len (a run of a folder of no preset trains at
its max_position_embeddings, up to 2048; the benchmark keeps it short).

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
from ..training.engine import build_engine
from .benchmark import forget_peak_rss, peak_rss

ENGINE = "debug_cpu.json"  # the shipped ds_config whose engine the measurements use (ds_configs/)


def engine_config(block: dict) -> dict:
    """ds_configs/debug_cpu.json's engine (precision, ZeRO stage, optimizer, clipping) at micro-batch 1 without
    accumulation, with `block` as its adaptive_ds block (no preset: the folder's shape is its own)."""
    config = load(ENGINE)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    config.pop("train_batch_size", None)
    config["adaptive_ds"] = block
    return config


def _settings(folder: str):
    """The run's settings and DeepSpeed config, parsed and checked as a training command line's."""
    block = {"arch": "dense", "data": "embedded", "max_steps": 1, "warmup_steps": 0}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(engine_config(block), f)
    try:
        return parse(["--ds_config", f.name, "--init_from", folder], world_size=1)
    finally:
        os.unlink(f.name)


def measure(folder: str, seq_len: int, step: bool = True, load_only: bool = False) -> dict:
    """The resident set before the model and each phase's peak, in bytes (see the module's docstring)."""
    distributed.init_distributed()
    settings, ds_config = _settings(folder)
    source = startup.open_source(settings)
    data = startup.load_data(settings, seq_len)
    saved = startup.saved_tokenizer(source, data.tokenizer)  # whose special tokens the model takes
    config = startup.model_config_of(settings, source, data.tokenizer, saved)
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
    phase("engine")
    out = engine(**{k: v.to(engine.device) for k, v in batch.items()})
    engine.backward(out.loss)
    result["loss"] = float(out.loss.detach())
    del out
    phase("forward_backward")
    if step:
        engine.step()
        phase("step")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Peak host memory of --init_from a folder on CPU.")
    p.add_argument("--init_from", required=True, help="a pretrained model's folder")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--no_step", action="store_true", help="forward and backward only, no optimizer step")
    p.add_argument("--load_only", action="store_true", help="build and load the model only")
    args = p.parse_args(argv)
    distributed.setup_logging(logging.WARNING)
    print(json.dumps(measure(args.init_from, args.seq_len, not args.no_step, args.load_only)))


if __name__ == "__main__":
    main()
