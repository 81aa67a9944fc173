"""One acceptance command for a CUDA machine, and a dry run of the same stages everywhere else.

    python -m adaptive_ds.acceptance [--out F] [--benchmarks_md BENCHMARKS.md] [--stages ...] [--micro_batch N]

On a CUDA machine (sized for one H200: about 8 minutes, DeepSpeed's op builds included), in this order:

- gpu_tests: `pytest -m gpu tests/test_gpu.py`: the grouped GEMM against the per-expert path in bf16, fp16 under
  DeepSpeed's loss scaler, bf16, a real CUDA out-of-memory under --gpu_memory_gib recovered in place, NCCL with one
  process, ZeRO-2 with DeepSpeed's CPU Adam.
- b1_t4: the training command on `ds_configs/b1_t4.json` for 30 steps under `--gpu_memory_gib 15` (a T4's memory),
  on the embedded corpus, with gradient accumulation 1 (the config's 64 would make 30 steps take ~15 minutes; the
  peak is the micro-batch's, whatever the accumulation): peak allocated and reserved beside the planner's peak.
- benchmark: `adaptive_ds.benchmark` at debug_200m in bf16, every case interleaved in one process.
- b7: b7 dense for a few optimizer steps on the one GPU, with ZeRO-2 and the optimizer offloaded to CPU as
  `ds_configs/b7_a100_40gb_offload.json` says (the planner: ~104 GiB of optimizer states do not fit beside the
  weights on the GPU), on random tokens through the DeepSpeed engine. Not through the training command: its end
  checkpoint (~110 GB of optimizer states) would not fit the machine's disk.

Each stage runs in its own process, so an out-of-memory or a crash in one does not lose the others' figures. The
figures go to one JSON file and to BENCHMARKS.md sections that carry the date, GPU, commit and command.

Without CUDA the same command runs every stage at tiny sizes on CPU (debug preset, fp32, no offload, the GPU tests
only collected, four benchmark cases, compiled with dynamo's eager backend), all in this one process, and writes no
BENCHMARKS.md section unless asked: a check that the command still works, not a measurement.
tests/test_acceptance.py runs it; a stage in its own process (`--stage`, what a CUDA machine runs) has its own test.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .distributed import DISTRIBUTED_VARIABLES

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
STAGES = ("gpu_tests", "b1_t4", "benchmark", "b7")
# Wall-clock limits per stage on the GPU machine (guards: the whole run is sized to ~8 minutes) and in a dry run.
TIMEOUT_S = {"gpu_tests": 300, "b1_t4": 180, "benchmark": 360, "b7": 300}
DRY_TIMEOUT_S = 300  # generous: killing a stage while it builds a DeepSpeed op leaves a stale build lock
DRY_RUN_CASES = ["dense", "dense_compile", "moe", "mod"]


def _ds_config(name: str, dry: bool, micro_batch: int | None = None) -> dict:
    """A ds_config from ds_configs/ with gradient accumulation 1. Dry run: no fp16/bf16 and no optimizer offload
    (DeepSpeed's fp16 needs CUDA; its CPU Adam is a ~80 s build), torch's AdamW."""
    from .ds_config import load  # the same ds_config reader as training

    config = load(str(ROOT / "ds_configs" / name))
    micro = micro_batch or config["train_micro_batch_size_per_gpu"]
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1, train_batch_size=micro)
    if dry:
        config.pop("fp16", None)
        config.pop("bf16", None)
        config["zero_optimization"].pop("offload_optimizer", None)
        config["optimizer"]["params"]["torch_adam"] = True
    return config


def _peak() -> dict:
    if torch.cuda.is_available():
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}
    import resource

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}


def stage_gpu_tests(dry: bool, workdir: Path) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"]
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
    """The training command on b1_t4.json under a 15 GiB cap; peak memory beside the planner's."""
    from .data.tokenizer import embedded_tokenizer
    from .plan import plan_ds_config
    from .training import train

    config = _ds_config("b1_t4.json", dry)
    preset, steps = ("debug", 3) if dry else ("b1", 30)
    config["adaptive_ds"].update(preset=preset, data="embedded", max_steps=steps, warmup_steps=3, log_steps=10,
                                 eval_steps=0, save_steps=0, eval_batches=2)
    path, out = workdir / "b1_t4.json", workdir / "b1_t4_run"
    path.write_text(json.dumps(config))
    argv = ["--ds_config", str(path), "--output_dir", str(out), "--gpu_memory_gib", "15"]
    train(argv)
    summary = json.loads((out / "summary.json").read_text())
    plan = plan_ds_config(preset, "dense", "t4", config, gpus=1, vocab_size=len(embedded_tokenizer()))
    result = {"command": "python -m adaptive_ds.training " + shlex.join(argv), "ds_config": config, **_peak(),
              "predicted_peak_gib": plan.peak_gib, "steps": summary["steps"],
              "training_tokens_per_s": summary.get("training_tokens_per_s"), "train_loss": summary["train_loss"],
              "validation_loss": summary["validation_loss"]}
    if "peak_allocated_gib" in result:
        result["target_peak_allocated_le_12_gib"] = result["peak_allocated_gib"] <= 12
    shutil.rmtree(out)  # the end checkpoint holds ~20 GB of optimizer states
    result["ok"] = summary["steps"] == steps
    return result


def stage_benchmark(dry: bool, workdir: Path, micro_batch: int = 8) -> dict:
    from .benchmark import CASES, run_benchmark

    if dry:  # one case of each kind (eager, compiled, routed); tests/test_benchmark.py runs every case on CPU
        report = run_benchmark("debug", steps=1, rounds=1, warmup=1, micro_batch=2, precision="fp32",
                               cases=DRY_RUN_CASES, compile_backend="eager")
        report["ok"] = set(report["results"]) == set(DRY_RUN_CASES)
        return report
    else:
        report = run_benchmark("debug_200m", steps=5, rounds=2, warmup=2, micro_batch=micro_batch,
                               precision="bf16", cases=list(CASES))
    report["ok"] = set(report["results"]) == set(CASES)
    return report


def stage_b7(dry: bool, workdir: Path) -> dict:
    """b7 dense for a few optimizer steps with ZeRO-2 and CPU Adam, as the planner says it fits one H200."""
    import deepspeed
    import psutil

    from . import distributed
    from .models import AdaptiveDSForCausalLM
    from .plan import plan
    from .presets import PRESETS, model_config
    from .training.optim import parameter_groups

    preset, steps, vocab = ("debug", 2, 32000) if dry else ("b7", 3, 32000)
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
    with torch.device(device):  # built where it trains: a 7B model's fp32 init on the CPU takes minutes
        model = AdaptiveDSForCausalLM(model_config(preset, "dense", vocab))
    model.model.gradient_checkpointing = True
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.1), config=config)
    seq_len, times, losses = PRESETS[preset].seq_len, [], []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (config["train_micro_batch_size_per_gpu"], seq_len), device=engine.device)
        start = time.perf_counter()
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())  # also waits for the step
        times.append(time.perf_counter() - start)
    tokens = config["train_micro_batch_size_per_gpu"] * seq_len
    return {**result, **_peak(), "steps": steps, "step_s": times, "losses": losses,
            "tokens_per_s_after_first": tokens * (steps - 1) / sum(times[1:]),
            "ok": all(loss == loss for loss in losses)}


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
    command = [sys.executable, "-m", "adaptive_ds.acceptance", "--stage", name, "--stage_out", str(out),
               "--workdir", str(workdir), "--micro_batch", str(micro_batch)] + (["--dry_run"] if dry else [])
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
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


def _gib(result: dict, key: str) -> str:
    return f"{result[key]:.2f} GiB" if key in result else "n/a"


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of an acceptance run: provenance and one line per stage."""
    stages = report["stages"]
    lines = [f"Measured {report['date']} on {report['machine']}, torch {report['torch']}, deepspeed "
             f"{report['deepspeed']}, commit {report['commit']}: `{report['command']}`"
             + (" (dry run on CPU: tiny sizes, no figures)." if report["dry_run"] else "."), "",
             "| stage | result | figures | seconds |", "|---|---|---|---|"]
    for name, r in stages.items():
        status = "passed" if r.get("ok") else f"**failed**: {str(r.get('error', '')).splitlines()[-1:]}"
        if name == "gpu_tests":
            figures = f"`{r.get('command', '')}`: {r.get('summary', '')}"
        elif name == "b1_t4":
            figures = (f"peak allocated {_gib(r, 'peak_allocated_gib')}, reserved {_gib(r, 'peak_reserved_gib')} "
                       f"under a 15 GiB cap; planner {_gib(r, 'predicted_peak_gib')}; "
                       f"{r.get('training_tokens_per_s') or 0:,.0f} tokens/s; `{r.get('command', '')}`")
        elif name == "benchmark":
            figures = (f"{r.get('preset')} {r.get('precision')}, micro-batch {r.get('micro_batch')}: section "
                       f"`throughput:{r.get('preset')}:gpu` below")
        else:
            micro = r.get("ds_config", {}).get("train_micro_batch_size_per_gpu")
            figures = (f"{len(r.get('step_s', []))} steps of {micro} x 2048 tokens, peak allocated "
                       f"{_gib(r, 'peak_allocated_gib')}, reserved "
                       f"{_gib(r, 'peak_reserved_gib')}; planner {_gib(r, 'predicted_peak_gib')} on the GPU, "
                       f"{_gib(r, 'predicted_cpu_states_gib')} in host memory; "
                       f"{r.get('tokens_per_s_after_first', 0):,.0f} tokens/s after the first step")
        lines.append(f"| {name} | {status} | {figures} | {r.get('seconds', 0):.0f} |")
    return "\n".join(lines)


def run(stages: list[str], dry: bool, out: str, benchmarks_md: str | None, micro_batch: int) -> dict:
    import deepspeed

    from . import benchmark
    from .report import commit, machine, replace_section

    workdir = Path(tempfile.mkdtemp(prefix="acceptance-"))
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(), "dry_run": dry,
              "command": shlex.join(["python", "-m", "adaptive_ds.acceptance", *sys.argv[1:]]),
              "torch": torch.__version__, "deepspeed": deepspeed.__version__, "stages": {}}
    for name in stages:
        logger.info("stage %s ...", name)
        report["stages"][name] = result = _run_stage(name, dry, workdir, micro_batch)
        logger.info("stage %s: %s in %.0f s", name, "passed" if result["ok"] else "FAILED", result["seconds"])
    shutil.rmtree(workdir, ignore_errors=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    if benchmarks_md:
        kind = "dry" if dry else "gpu"
        replace_section(benchmarks_md, f"acceptance:{kind}", markdown(report),
                        f"GPU acceptance (`python -m adaptive_ds.acceptance`), {report['machine']}")
        bench = report["stages"].get("benchmark", {})
        if bench.get("ok"):
            benchmark.write_section(benchmarks_md, bench)
    return report


def main(argv: list[str] | None = None) -> None:
    from . import distributed

    p = argparse.ArgumentParser(description="The GPU acceptance run (a dry run of every stage without CUDA).")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--out", help="the JSON report (default: benchmarks/acceptance_gpu.json; dry run: a temp file)")
    p.add_argument("--benchmarks_md", help="write the sections into this file (default on CUDA: BENCHMARKS.md)")
    p.add_argument("--micro_batch", type=int, default=8, help="the benchmark's micro-batch at debug_200m")
    p.add_argument("--dry_run", action="store_true", help="tiny sizes on CPU even where CUDA is available")
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # internal: one stage in this process
    p.add_argument("--stage_out", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
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
    out = args.out or (os.path.join(tempfile.gettempdir(), "acceptance_dry_run.json") if dry
                       else str(ROOT / "benchmarks" / "acceptance_gpu.json"))
    benchmarks_md = args.benchmarks_md or (None if dry else str(ROOT / "BENCHMARKS.md"))
    report = run(args.stages, dry, out, benchmarks_md, args.micro_batch)
    for name, r in report["stages"].items():
        print(f"{name}: {'passed' if r['ok'] else 'FAILED'} ({r['seconds']:.0f} s)"
              + ("" if r["ok"] else f": {str(r.get('error', ''))[-300:]}"))
    print(f"report: {out}")
    if not all(r["ok"] for r in report["stages"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
