"""One acceptance command for a CUDA machine, and a dry run of the same stages everywhere else.

    python -m adaptive_ds.tools.acceptance [--out F] [--benchmarks_md BENCHMARKS.md] [--stages ...] [--micro_batch N]

On a CUDA machine (sized for one H200, each stage within its limit in `TIMEOUT_S`, DeepSpeed's op builds
included), in this order:

- gpu_tests: `pytest -m gpu tests/integration/test_gpu.py`: the grouped GEMM against the per-expert path in bf16,
  fp16 under DeepSpeed's loss scaler, bf16, a real CUDA out-of-memory under --gpu_memory_gib recovered in place,
  NCCL with one process, ZeRO-2 with DeepSpeed's CPU Adam.
- b1_t4: the training command on `ds_configs/b1_t4.json` for 30 steps under `--gpu_memory_gib 15` (a T4's memory),
  on the embedded corpus, with gradient accumulation 1 (the config's 64 would make every step 64 micro-batches long
  for the same figure: the peak is the micro-batch's, whatever the accumulation): peak allocated and reserved
  beside the planner's peak.
- benchmark: `adaptive_ds.tools.benchmark` at debug_200m in bf16, every case in one process: 5 rounds, each every
  case back to back, after a warm-up round like them; its ratios paired within the rounds.
- b7: b7 dense for three optimizer steps on the one GPU, with ZeRO-2 and the optimizer offloaded to CPU as
  `ds_configs/b7_a100_40gb_offload.json` says (the planner: its optimizer states do not fit beside the weights on
  the GPU; their host memory is b7's CPU RAM in BENCHMARKS.md, `plan:projections`), on random tokens through the
  DeepSpeed engine. Not through the training command: its end checkpoint would write every optimizer state of b7
  to disk, which the stage has no use for.

Each stage runs in its own process, so an out-of-memory or a crash in one does not lose the others' figures. A
stage passes when it runs to completion; the run passes when every stage does and every target of `TARGETS` (the
GPU targets of BENCHMARKS.md, one table: the stage, the figure of its record, the threshold) is met. Each target is
reported met or missed with its measured figure, in the JSON report, in the printed summary and in the BENCHMARKS.md
section; the command exits non-zero when a stage failed or a target was missed or its figure is missing, and its
last lines name the stage and the target. b7's rule: its three optimizer steps all ran with finite losses, and
its peak allocated GPU memory is within an H200's (`adaptive_ds/hardware.py`).

The JSON report goes to `--out` (default `runs/acceptance/acceptance_<gpu|dry>_<date>_<time>.json` under the
working directory, which git ignores); a section of a Markdown file (with date, GPU, commit and command) only when
`--benchmarks_md` names one: publishing is `--out benchmarks/acceptance_gpu.json --benchmarks_md BENCHMARKS.md`.

Without CUDA the same command runs every stage at tiny sizes on CPU (debug preset, the GPU tests only collected, four
benchmark cases, compiled with dynamo's eager backend), all in this one process, with the configs' fp16, bf16 and
optimizer offload wherever DeepSpeed's CPU accelerator runs them (a warning names what it leaves out, and why): a
check that the command still works, not a measurement; its targets are "not measured (dry run)" and it exits 0 when
every stage completed. tests/unit/test_acceptance.py checks the verdicts on made-up stage records;
tests/integration/test_acceptance.py runs the dry run, and a stage in its own process (`--stage`, what a CUDA
machine runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import operator
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from ..distributed import DISTRIBUTED_VARIABLES
from ..hardware import DEVICES

logger = logging.getLogger(__name__)

# The GPU tests are the repository's (a checkout, or an editable install of one): a wheel ships no tests.
ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = "tests/integration/test_gpu.py"
GIB = 2**30
STAGES = ("gpu_tests", "b1_t4", "benchmark", "b7")
# Wall-clock limits per stage on the GPU machine (guards: a hung stage ends and the others still run) and in a dry
# run.
TIMEOUT_S = {"gpu_tests": 300, "b1_t4": 180, "benchmark": 600, "b7": 300}
DRY_TIMEOUT_S = 300  # generous: killing a stage while it builds a DeepSpeed op leaves a stale build lock
DRY_RUN_CASES = ["dense", "dense_compile", "moe", "mod"]
B1_T4_CAP_GIB = 15  # a T4's memory, as CUDA shows it
B7_STEPS = 3


class Target(NamedTuple):
    """A GPU target: met when the figure at `figure` (a path of keys into its stage's record) compares to
    `threshold` as `op` says. `name` is its row of the "GPU targets" table in BENCHMARKS.md."""

    name: str
    stage: str
    figure: tuple[str, ...]
    op: str  # ">=" or "<="
    threshold: float
    unit: str  # how the figure prints: "%" (a fraction as a percentage), "x" (a ratio), "GiB", "steps"


H200_GIB = DEVICES["h200"].memory_gib
# b7 "trains within one H200": every one of its optimizer steps ran (an out-of-memory fails the stage) with a finite
# loss, and its allocator's peak is within an H200's memory (on an H200 the out-of-memory decides; on a larger GPU
# this says whether it would have fit).
TARGETS = (
    Target("dense debug_200m >= 45% MFU", "benchmark", ("results", "dense", "mfu"), ">=", 0.45, "%"),
    Target("dense >= 1.3x HF `LlamaForCausalLM` + `torch.compile` tokens/s (dense / hf_llama_compile)", "benchmark",
           ("ratios", "dense/hf_llama_compile"), ">=", 1.3, "x"),
    Target("moe >= 2.5x DeepSpeed's stock MoE (moe / moe_deepspeed), same routing", "benchmark",
           ("ratios", "moe/moe_deepspeed"), ">=", 2.5, "x"),
    Target("moe >= 2.5x HF `MixtralForCausalLM` (moe / hf_mixtral), same routing", "benchmark",
           ("ratios", "moe/hf_mixtral"), ">=", 2.5, "x"),
    Target("mod (capacity 0.5 in every block: the `mod` case) >= 1.6x dense (mod / dense)", "benchmark",
           ("ratios", "mod/dense"), ">=", 1.6, "x"),
    Target("hybrid (MoD 0.5 in every block) >= 1.4x moe (hybrid / moe)", "benchmark", ("ratios", "hybrid/moe"),
           ">=", 1.4, "x"),
    Target(f"`b1_t4.json` peak allocated <= 12 GiB under the {B1_T4_CAP_GIB} GiB cap, beside the planner's "
           "prediction", "b1_t4", ("peak_allocated_gib",), "<=", 12.0, "GiB"),
    Target(f"b7 dense trains on one H200 (ZeRO-2 + CPU Adam): its {B7_STEPS} optimizer steps ran with finite "
           "losses", "b7", ("finite_loss_steps",), ">=", B7_STEPS, "steps"),
    Target(f"b7 dense peak allocated within an H200's memory (<= {H200_GIB:g} GiB)", "b7", ("peak_allocated_gib",),
           "<=", H200_GIB, "GiB"),
)
_OPS = {">=": operator.ge, "<=": operator.le}
MET, MISSED, FIGURE_MISSING = "met", "missed", "not measured (figure missing)"


def _ds_config(name: str, dry: bool, micro_batch: int | None = None) -> dict:
    """A shipped ds_config with gradient accumulation 1. A dry run keeps its precision, loss scaling and optimizer
    offload wherever this machine runs them (`_unsupported_here`), so that it runs the config as written."""
    from ..ds_config import SHIPPED_DIR, load  # the same ds_config reader as training

    config = load(os.path.join(SHIPPED_DIR, name))
    micro = micro_batch or config["train_micro_batch_size_per_gpu"]
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1, train_batch_size=micro)
    if dry:
        for problem in _unsupported_here(config):
            logger.warning("dry run of %s without %s", name, problem)
    return config


def _unsupported_here(config: dict) -> list[str]:
    """Take out of `config` what DeepSpeed's accelerator here cannot run, each named with why: a half precision it
    lacks (`is_fp16_supported()`, `is_bf16_supported()`), and the optimizer offload where DeepSpeed's CPU Adam does
    not build (then torch's AdamW); `make setup` built it, so it loads from the cache."""
    from deepspeed.accelerator import get_accelerator

    accelerator, problems = get_accelerator(), []
    for key, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        if config.get(key, {}).get("enabled") and not supported():
            config.pop(key)
            problems.append(f"{key}: DeepSpeed's {accelerator.device_name()} accelerator has no {key} here")
    zero = config.get("zero_optimization", {})
    if zero.get("offload_optimizer"):
        try:
            accelerator.create_op_builder("CPUAdamBuilder").load()
        except Exception as error:  # a compiler missing or failing: DeepSpeed raises what the build raised
            zero.pop("offload_optimizer")
            config["optimizer"]["params"]["torch_adam"] = True
            problems.append(f"the optimizer offload: DeepSpeed's CPU Adam does not build here ({error})")
    return problems


def _peak() -> dict:
    if torch.cuda.is_available():
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}
    import resource

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}


def stage_gpu_tests(dry: bool, workdir: Path) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", GPU_TESTS]
    if not (ROOT / GPU_TESTS).is_file():
        return {"command": shlex.join(command[2:]), "ok": False,
                "error": f"{GPU_TESTS} is not beside the package (an installed wheel ships no tests): run the stage "
                         "from a checkout of the repository, or pass --stages b1_t4 benchmark b7"}
    if dry:
        command.append("--collect-only")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    result = {"command": shlex.join(command[2:]), "summary": lines[-1] if lines else done.stderr[-500:]}
    if done.returncode != 0:
        result["failures"] = [line for line in lines if line.startswith(("FAILED", "ERROR"))] or lines[-30:]
    result["ok"] = done.returncode == 0
    return result


def stage_b1_t4(dry: bool, workdir: Path) -> dict:
    """The training command on b1_t4.json under a 15 GiB cap; peak memory beside the planner's. Completes when it
    trained its steps (the peak is judged by its target)."""
    from ..data.tokenizer import embedded_tokenizer
    from ..training import train
    from .planner import plan_ds_config

    config = _ds_config("b1_t4.json", dry)
    preset, steps = ("debug", 3) if dry else ("b1", 30)
    config["adaptive_ds"].update(preset=preset, data="embedded", max_steps=steps, warmup_steps=3, log_steps=10,
                                 eval_steps=0, save_steps=0, eval_batches=2)
    # named apart from the shipped b1_t4.json, which a bare "b1_t4.json" would resolve to: this is its stage copy
    path, out = workdir / "b1_t4_stage.json", workdir / "b1_t4_stage_run"
    path.write_text(json.dumps(config))
    argv = ["--ds_config", str(path), "--output_dir", str(out), "--gpu_memory_gib", str(B1_T4_CAP_GIB)]
    train(argv)
    summary = json.loads((out / "summary.json").read_text())
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])  # fp16's loss scale, skipped steps
    plan = plan_ds_config(preset, "dense", "t4", config, gpus=1, vocab_size=len(embedded_tokenizer()))
    shown = [arg.replace(f"{workdir}{os.sep}", "") for arg in argv]  # the stage's own files, not this machine's
    result = {"command": "python -m adaptive_ds.training " + shlex.join(shown), "ds_config": config, **_peak(),
              "predicted_peak_gib": plan.peak_gib, "steps": summary["steps"],
              "training_tokens_per_s": summary.get("training_tokens_per_s"), "train_loss": summary["train_loss"],
              "validation_loss": summary["validation_loss"], "gpu_memory_cap_gib": B1_T4_CAP_GIB,
              "loss_scale": last.get("loss_scale"), "skipped_steps": last.get("skipped_steps")}
    shutil.rmtree(out)  # the end checkpoint holds every optimizer state of b1: disk the report does not need
    result["ok"] = summary["steps"] == steps
    return result


def stage_benchmark(dry: bool, workdir: Path, micro_batch: int = 8) -> dict:
    from .benchmark import CASES, run_benchmark

    # a dry run: one case of each kind (eager, compiled, routed), in the stage's bf16 where the machine has it;
    # tests/integration/test_benchmark.py runs every case on CPU
    if dry:
        from deepspeed.accelerator import get_accelerator

        precision = "bf16" if get_accelerator().is_bf16_supported() else "fp32"
        report = run_benchmark("debug", steps=1, rounds=1, warmup=1, micro_batch=2, precision=precision,
                               cases=DRY_RUN_CASES, compile_backend="eager")
        report["ok"] = set(report["results"]) == set(DRY_RUN_CASES)
        return report
    else:
        report = run_benchmark("debug_200m", steps=5, rounds=5, warmup=None, micro_batch=micro_batch,
                               precision="bf16", cases=list(CASES))
    report["ok"] = set(report["results"]) == set(CASES)
    return report


def stage_b7(dry: bool, workdir: Path) -> dict:
    """b7 dense for a few optimizer steps with ZeRO-2 and CPU Adam, as the planner says it fits one H200. Completes
    when its steps ran (their losses and the peak are judged by its targets)."""
    import deepspeed
    import psutil

    from .. import distributed
    from ..models import AdaptiveDSForCausalLM
    from ..presets import PRESETS, model_config
    from ..training.optim import parameter_groups
    from .planner import plan

    preset, steps, vocab = ("debug", 2, 32000) if dry else ("b7", B7_STEPS, 32000)
    config = _ds_config("b7_a100_40gb_offload.json", dry)
    config.pop("adaptive_ds")
    predicted = plan(preset, "dense", "h200", config, gpus=1, vocab_size=vocab, activation_checkpointing=True)
    host_gib = psutil.virtual_memory().available / GIB
    result = {"ds_config": config, "predicted_peak_gib": predicted.peak_gib,
              "predicted_cpu_states_gib": predicted.cpu_states_gib, "host_available_gib": host_gib}
    if predicted.cpu_states_gib * 1.1 + 4 > host_gib:
        return {**result, "ok": False, "error": f"not run: the offloaded optimizer states need "
                f"~{predicted.cpu_states_gib:.0f} GiB of host memory, {host_gib:.0f} GiB available"}
    distributed.init_distributed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # built where it trains: a 7B model's fp32 init on the CPU is slow
        model = AdaptiveDSForCausalLM(model_config(preset, "dense", vocab))
    model.model.gradient_checkpointing = True
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.1), config=config)
    seq_len, times, losses = PRESETS[preset].seq_len, [], []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (config["train_micro_batch_size_per_gpu"], seq_len), device=engine.device)
        start = time.perf_counter()
        out = engine(input_ids=ids, labels=ids, skip_logits=True)  # as the trainer calls it
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())  # also waits for the step
        times.append(time.perf_counter() - start)
    tokens = config["train_micro_batch_size_per_gpu"] * seq_len
    return {**result, **_peak(), "steps": steps, "step_s": times, "losses": losses,
            "finite_loss_steps": sum(math.isfinite(loss) for loss in losses),
            "tokens_per_s_after_first": tokens * (steps - 1) / sum(times[1:]), "ok": len(losses) == steps}


def _stage_function(name: str):
    return {"gpu_tests": stage_gpu_tests, "b1_t4": stage_b1_t4, "benchmark": stage_benchmark, "b7": stage_b7}[name]


def _run_stage(name: str, dry: bool, workdir: Path, micro_batch: int) -> dict:
    """One stage; a crash or timeout is reported, not raised.

    On a CUDA machine each stage runs in its own process (figures come back as JSON): a fresh allocator for each
    peak, a crash or hang contained. Without CUDA, a dry run's stages run in this process, one after another:
    there they measure nothing, and four interpreter start-ups would be most of the dry run's time.
    """
    if dry and not torch.cuda.is_available():
        return _run_stage_here(name, workdir, micro_batch)
    out = workdir / f"{name}.json"
    command = [sys.executable, "-m", "adaptive_ds.tools.acceptance", "--stage", name, "--stage_out", str(out),
               "--workdir", str(workdir), "--micro_batch", str(micro_batch)] + (["--dry_run"] if dry else [])
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=DRY_TIMEOUT_S if dry else TIMEOUT_S[name])
        error = None if done.returncode == 0 else done.stderr[-3000:]
    except subprocess.TimeoutExpired:
        error = f"timed out after {DRY_TIMEOUT_S if dry else TIMEOUT_S[name]} s"
    result = json.loads(out.read_text()) if out.exists() else {"ok": False}
    if error:
        result.update(ok=False, error=result.get("error", error))
    return {**result, "seconds": time.perf_counter() - start}


class _StageTimeout(Exception):
    pass


def _on_alarm(signum, frame) -> None:
    raise _StageTimeout(f"timed out after {DRY_TIMEOUT_S} s")


def _run_stage_here(name: str, workdir: Path, micro_batch: int) -> dict:
    """A dry-run stage in this process, under the same time limit as a stage process (SIGALRM)."""
    start = time.perf_counter()
    kwargs = {"micro_batch": micro_batch} if name == "benchmark" else {}
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(DRY_TIMEOUT_S)
    try:
        result = json.loads(json.dumps(_stage_function(name)(True, workdir, **kwargs), default=str))
    except (Exception, SystemExit) as error:  # the training CLI exits with its one line
        logger.exception("stage %s failed", name)
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return {**result, "seconds": time.perf_counter() - start}


def _figure(record: dict, path: tuple[str, ...]) -> float | None:
    """The number at `path` in a stage's record; None where it is absent, not a number, or not finite (an unknown
    GPU's MFU, a peak a CPU does not have)."""
    value = record
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def judge(stages: dict[str, dict], dry: bool) -> list[dict]:
    """Each target's verdict from the stage records: "met" or "missed" with the measured figure, or "not measured"
    and why (a dry run; its stage not among --stages; its stage failed; its figure missing from the record)."""
    verdicts = []
    for target in TARGETS:
        record, measured = stages.get(target.stage), None
        if dry:
            verdict = "not measured (dry run)"
        elif record is None:
            verdict = "not measured (stage not run)"
        elif not record.get("ok"):
            verdict = "not measured (stage failed)"
        else:
            measured = _figure(record, target.figure)
            if measured is None:
                verdict = FIGURE_MISSING
            else:
                verdict = MET if _OPS[target.op](measured, target.threshold) else MISSED
        verdicts.append({"target": target.name, "stage": target.stage, "figure": ".".join(target.figure),
                         "op": target.op, "threshold": target.threshold, "unit": target.unit, "measured": measured,
                         "verdict": verdict})
    return verdicts


def _show(value: float, unit: str) -> str:
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "GiB":
        return f"{value:.2f} GiB"
    return f"{value:g} {unit}"


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def _last_line(error) -> str:
    """The line that says what went wrong: a traceback's own last line, the exception (a process's exit can print
    warnings after it, as NCCL's teardown does), else the last line."""
    lines = [_RANK_PREFIX.sub("", line) for line in str(error or "").strip().splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if starts:  # the traceback's frames are indented; the first line after them that is not names the exception
        raised = next((line for line in lines[starts[-1] + 1:] if line and not line[0].isspace()), None)
        if raised:
            return raised
    return (lines or ["no error message"])[-1]


def failures(report: dict) -> list[str]:
    """One line per failed stage (naming the targets it left unmeasured) and per target missed or without its
    figure; empty when the run passed."""
    lines = []
    for name, result in report["stages"].items():
        if not result.get("ok"):
            left = [v["target"] for v in report["targets"] if v["stage"] == name]
            lines.append(f"stage {name} failed: {_last_line(result.get('error'))}"
                         + (f"; not measured: {'; '.join(left)}" if left else ""))
    for v in report["targets"]:
        if v["verdict"] == MISSED:
            lines.append(f"stage {v['stage']} missed target \"{v['target']}\": measured "
                         f"{_show(v['measured'], v['unit'])}, needs {v['op']} {_show(v['threshold'], v['unit'])}")
        elif v["verdict"] == FIGURE_MISSING:
            lines.append(f"stage {v['stage']} did not measure target \"{v['target']}\": its record has no figure "
                         f"{v['figure']}")
    return lines


def _gib(result: dict, key: str) -> str:
    return f"{result[key]:.2f} GiB" if key in result else "n/a"


def _verdict_text(v: dict) -> str:
    if v["verdict"] in (MET, MISSED):
        return "met" if v["verdict"] == MET else "**missed**"
    return v["verdict"]


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of an acceptance run: provenance, one line per stage, one line per target."""
    stages = report["stages"]
    lines = [f"Measured {report['date']} on {report['machine']}, torch {report['torch']}, deepspeed "
             f"{report['deepspeed']}, "
             + (f"transformers {report['transformers']}, " if "transformers" in report else "")
             + f"commit {report['commit']}: `{report['command']}`"
             + (" (dry run on CPU: tiny sizes, no figures)." if report["dry_run"] else "."), "",
             "| stage | result | figures | seconds |", "|---|---|---|---|"]
    for name, r in stages.items():
        status = "completed" if r.get("ok") else f"**failed**: {_last_line(r.get('error'))}"
        if name == "gpu_tests":
            figures = f"`{r.get('command', '')}`: {r.get('summary', '')}"
        elif name == "b1_t4":
            scale = "" if r.get("loss_scale") is None else f"fp16 loss scale {r['loss_scale']:g} at the end, "
            figures = (f"peak allocated {_gib(r, 'peak_allocated_gib')}, reserved {_gib(r, 'peak_reserved_gib')} "
                       f"under a {B1_T4_CAP_GIB} GiB cap; planner {_gib(r, 'predicted_peak_gib')}; "
                       f"{r.get('training_tokens_per_s') or 0:,.0f} tokens/s; {scale}"
                       f"{r.get('skipped_steps', 0)} steps skipped; `{r.get('command', '')}` (b1_t4_stage.json: "
                       "the stage's `ds_config` in the report)")
        elif name == "benchmark":
            figures = (f"{r['preset']} {r['precision']}, micro-batch {r['micro_batch']}: section "
                       f"`throughput:{r['preset']}:gpu` below" if r.get("ok") else "-")
        else:
            micro = r.get("ds_config", {}).get("train_micro_batch_size_per_gpu")
            figures = (f"{len(r.get('step_s', []))} steps of {micro} x 2048 tokens, losses "
                       f"{', '.join(f'{loss:.3f}' for loss in r.get('losses', []))}, peak allocated "
                       f"{_gib(r, 'peak_allocated_gib')}, reserved "
                       f"{_gib(r, 'peak_reserved_gib')}; planner {_gib(r, 'predicted_peak_gib')} on the GPU, "
                       f"{_gib(r, 'predicted_cpu_states_gib')} in host memory; "
                       f"{r.get('tokens_per_s_after_first', 0):,.0f} tokens/s after the first step")
        seconds = "-" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        lines.append(f"| {name} | {status} | {figures} | {seconds} |")
    for name, rerun in report.get("reruns", {}).items():  # a stage's record from a run of that stage alone
        lines += ["", f"Stage {name}'s record comes from a second run of that stage alone, in its own process as "
                      f"the command runs each stage, `{rerun['command']}`: {rerun['why']}."]
    lines += ["", "| target | stage | needs | measured | verdict |", "|---|---|---|---|---|"]
    for v in report["targets"]:
        measured = "-" if v["measured"] is None else _show(v["measured"], v["unit"])
        lines.append(f"| {v['target']} | {v['stage']} | {v['op']} {_show(v['threshold'], v['unit'])} | {measured} | "
                     f"{_verdict_text(v)} |")
    return "\n".join(lines)


def run(stages: list[str], dry: bool, micro_batch: int, command: str) -> dict:
    """Every stage of `stages`, then the targets' verdicts: the report."""
    import deepspeed

    from .report import commit, machine

    workdir = Path(tempfile.mkdtemp(prefix="acceptance-"))
    import transformers  # the hf_* cases of the benchmark stage measure its models

    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(), "dry_run": dry,
              "command": command, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
              "transformers": transformers.__version__, "stages": {}}
    try:
        for name in stages:
            logger.info("stage %s ...", name)
            report["stages"][name] = result = _run_stage(name, dry, workdir, micro_batch)
            logger.info("stage %s: %s in %.0f s", name, "completed" if result["ok"] else "FAILED",
                        result["seconds"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["targets"] = judge(report["stages"], dry)
    return report


def write(report: dict, out: str, benchmarks_md: str | None) -> None:
    """The JSON report at `out`; the Markdown sections (acceptance, and the benchmark's throughput) only into
    `benchmarks_md`."""
    from ..markdown_sections import replace_section
    from . import benchmark

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    if benchmarks_md:
        kind = "dry" if report["dry_run"] else "gpu"
        replace_section(benchmarks_md, f"acceptance:{kind}", markdown(report),
                        f"GPU acceptance (`python -m adaptive_ds.tools.acceptance`), {report['machine']}")
        bench = report["stages"].get("benchmark", {})
        if bench.get("ok"):
            benchmark.write_section(benchmarks_md, bench)


def summary_lines(report: dict, out: str) -> list[str]:
    """What the command prints: each stage, each target, the report's path, and last, what failed (if anything)."""
    lines = [f"stage {name}: {'completed' if r['ok'] else 'FAILED'} ({r.get('seconds') or 0:.0f} s)"
             for name, r in report["stages"].items()]
    for v in report["targets"]:
        measured = "" if v["measured"] is None else f": {_show(v['measured'], v['unit'])}"
        lines.append(f"target {v['target']} [{v['stage']}, needs {v['op']} {_show(v['threshold'], v['unit'])}]: "
                     f"{v['verdict'].upper() if v['verdict'] == MISSED else v['verdict']}{measured}")
    lines.append(f"report: {out}")
    failed = failures(report)
    if failed:
        lines += [f"FAILED: {line}" for line in failed]
    elif report["dry_run"]:
        lines.append("dry run: every stage completed; no target measured")
    else:
        lines.append("passed: every stage completed and every target measured was met")
    return lines


def default_out(dry: bool) -> str:
    """Under the working directory's runs/ (git-ignored): never the repository's committed results."""
    return os.path.join("runs", "acceptance",
                        f"acceptance_{'dry' if dry else 'gpu'}_{time.strftime('%Y-%m-%d_%H%M%S')}.json")


def check(args: argparse.Namespace) -> None:
    """What main checks before a stage runs: ValueError in one line."""
    from .report import check_markdown_path

    if args.micro_batch < 1:
        raise ValueError(f"--micro_batch {args.micro_batch} must be at least 1")
    check_markdown_path(args.benchmarks_md)
    if args.out and os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a folder; it names the JSON report's file")


def main(argv: list[str] | None = None) -> None:
    from .. import distributed

    p = argparse.ArgumentParser(
        allow_abbrev=False, description="The GPU acceptance run (a dry run of every stage without CUDA).")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--out", help="the JSON report (default: runs/acceptance/acceptance_<gpu|dry>_<date>_<time>.json "
                                 "under the working directory)")
    p.add_argument("--benchmarks_md", help="also write the sections into this Markdown file (BENCHMARKS.md to "
                                           "publish); by default no Markdown file is touched")
    p.add_argument("--micro_batch", type=int, default=8, help="the benchmark's micro-batch at debug_200m")
    p.add_argument("--dry_run", action="store_true", help="tiny sizes on CPU even where CUDA is available")
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # internal: one stage in this process
    p.add_argument("--stage_out", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as error:
        p.error(str(error))
    distributed.setup_logging(logging.INFO)
    dry = args.dry_run or not torch.cuda.is_available()
    if args.stage:
        if dry:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a forced dry run stays on the CPU
        kwargs = {"micro_batch": args.micro_batch} if args.stage == "benchmark" else {}
        result = _stage_function(args.stage)(dry, Path(args.workdir), **kwargs)
        Path(args.stage_out).write_text(json.dumps(result, indent=2, default=str))
        return
    if dry:
        logger.warning("no CUDA device (or --dry_run): dry run of every stage at tiny sizes on CPU; nothing measured")
    out = args.out or default_out(dry)
    try:  # a report that cannot be written is found before the stages run, not after
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        p.error(f"--out {out!r}: cannot make its folder ({error.strerror})")
    command = shlex.join(["python", "-m", "adaptive_ds.tools.acceptance", *(sys.argv[1:] if argv is None else argv)])
    report = run(args.stages, dry, args.micro_batch, command)
    write(report, out, args.benchmarks_md)
    print("\n".join(summary_lines(report, out)))
    if failures(report):
        sys.exit(1)


if __name__ == "__main__":
    main()
