"""The shipped ds_configs as configured, for tests that train them: each read from the shipped file at test time (a
change to a shipped config is tested), shrunk only where a test machine must.

What shrinks: the preset (to debug), the micro-batch, the gradient accumulation, the number of processes (and with it
train_batch_size and an MoE config's `moe_ep_size`), and the data (the embedded corpus); the run's length and
cadences in the adaptive_ds block. What never changes: every other key of the engine section, so the precision, the
loss scaling, the ZeRO stage, the offload and the optimizer are DeepSpeed's as written (`as_configured` asserts it).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from deepspeed.accelerator import get_accelerator

from adaptive_ds import ds_config as reader
from adaptive_ds.training.loop import TrainerHooks

# The engine-section keys a test may shrink; every other one stays as the shipped file writes it.
SHRINKABLE = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# The shipped config of each half precision that tests/integration/test_half_precision.py trains, per architecture;
# tests/integration/test_shipped_configs.py trains every other one.
HALF_PRECISION = {"fp16": "b1_t4.json", "bf16": "b1_a100.json"}


def needs(precision: str):
    """A skip mark for a test that trains in `precision`, where this machine's DeepSpeed accelerator lacks it."""
    accelerator = get_accelerator()
    supported = {"fp32": True, "fp16": accelerator.is_fp16_supported(), "bf16": accelerator.is_bf16_supported()}
    return pytest.mark.skipif(not supported[precision], reason=f"DeepSpeed's {accelerator.device_name()} accelerator "
                              f"has no {precision} on this machine (is_{precision}_supported() is false)")


def shipped(name: str) -> dict:
    """The shipped config `name` as its file holds it."""
    return reader.load(str(Path(reader.SHIPPED_DIR) / name))


def as_configured(name: str, directory, micro: int = 1, accumulation: int = 2, processes: int = 1, **block) -> str:
    """The shipped config `name` at the debug preset on the embedded corpus, `micro` x `accumulation` rows a process,
    written into `directory`; `block`: more of the adaptive_ds block (max_steps, arch, ...). Returns its path."""
    written = shipped(name)
    config = copy.deepcopy(written)
    ours = config["adaptive_ds"]
    for key in ("data_config", "tokenizer"):  # a Hub corpus's: the embedded corpus brings its own tokenizer
        ours.pop(key, None)
    ours.update(preset="debug", data="embedded", max_steps=4, warmup_steps=1, log_steps=1, eval_steps=0,
                save_steps=0, eval_batches=1)
    model = ours.get("model", {})
    if "moe_ep_size" in model:  # expert parallelism over at most the processes there are
        model["moe_ep_size"] = min(model["moe_ep_size"], processes)
    ours.update(block)
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation)
    if "train_batch_size" in config:
        config["train_batch_size"] = micro * accumulation * processes
    kept = [key for key in written if key not in (*SHRINKABLE, "adaptive_ds")]
    assert {k: config[k] for k in kept} == {k: written[k] for k in kept}, "only the shrinkable keys may change"
    path = Path(directory) / f"{Path(name).stem}-{len(list(Path(directory).glob('*.json')))}.json"
    path.write_text(json.dumps(config))
    return str(path)


def in_fp32(path: str) -> str:
    """The config at `path` with its half precision turned off (the same engine otherwise): the reference a half
    precision run is compared with. Written beside it."""
    config = json.loads(Path(path).read_text())
    for key in ("fp16", "bf16"):
        if key in config:
            config[key] = {"enabled": False}
    twin = Path(path).with_name(f"{Path(path).stem}-fp32.json")
    twin.write_text(json.dumps(config))
    return str(twin)


class EngineFacts(TrainerHooks):
    """What the engine really runs, read before the first step: precision, loss scale, ZeRO stage, offload, the
    optimizer DeepSpeed built and the dtype of the weights it trains."""

    def __init__(self):
        self.facts: dict | None = None

    def before_step(self, trainer, step: int) -> None:
        if self.facts is not None:
            return
        engine = trainer.engine
        optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO's wraps the one it steps
        self.facts = {"fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
                      "loss_scale": engine.optimizer.loss_scale if engine.fp16_enabled() else None,
                      "zero_stage": engine.zero_optimization_stage(), "offload": engine.zero_cpu_offload(),
                      "optimizer": type(optimizer).__name__,
                      "dtype": str(next(engine.module.parameters()).dtype).removeprefix("torch.")}


def expected_facts(name: str) -> dict:
    """What DeepSpeed builds for the shipped config `name`, read off its file by hand: `torch_adam` asks for torch's
    AdamW, an optimizer offloaded to the CPU gets DeepSpeed's CPU Adam, any other its FusedAdam; dynamic loss scaling
    (`loss_scale` 0) starts at 2 ** initial_scale_power."""
    raw = shipped(name)
    zero = raw.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}).get("device") == "cpu"
    fp16, bf16 = raw.get("fp16", {}), raw.get("bf16", {})
    optimizer = ("AdamW" if raw["optimizer"]["params"].get("torch_adam") else
                 "DeepSpeedCPUAdam" if offload else "FusedAdam")
    scale = (fp16.get("loss_scale") or 2.0 ** fp16["initial_scale_power"]) if fp16.get("enabled") else None
    dtype = "float16" if fp16.get("enabled") else "bfloat16" if bf16.get("enabled") else "float32"
    return {"fp16": bool(fp16.get("enabled")), "bf16": bool(bf16.get("enabled")), "loss_scale": scale,
            "zero_stage": zero.get("stage", 0), "offload": offload, "optimizer": optimizer, "dtype": dtype}
