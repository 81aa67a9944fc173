"""Real-size pretrained models on this machine: a folder with exactly a published config, and what `--init_from`
it costs in host memory beside the planner's projection.

    python -m adaptive_ds.tools.realsize [--models Llama-3.2-1B Qwen2.5-0.5B SmolLM2-360M] [--seq_len 256] [--wait S]
    python -m adaptive_ds.tools.realsize --build CONFIG_JSON FOLDER

The published configs are tests/fixtures/published_configs/ (each with its source). `--build` makes a folder of one:
that config, read and saved by transformers; random weights made here (seeded) in the config's dtype, saved as
safetensors; the embedded corpus's tokenizer, while the published vocabulary size is kept (nothing downloads, so
neither the weights nor the tokenizer are the published ones).

The benchmark builds each folder under --work (reused while it holds that config), then measures, each in a process of
its own (`realsize_run`): `--init_from` the folder with ds_configs/debug_cpu.json's engine (fp32, ZeRO-1, torch's
AdamW) at micro-batch 1 and a short sequence on CPU, the model built and loaded as a training run builds it, then one
forward and backward pass and one optimizer step. A model whose step the planner projects beyond this machine's
memory runs forward and backward only, and the report says so. Measured: the peak resident set of that process
minus its resident set before the model, per phase (load, engine, forward and backward, step); projected: the
planner's peak for a CPU process in the same setting (`tools/planner.py`, `cpu_process`). The folders are bf16 and
training is fp32: the report states what the upcast costs, computed from the parameter counts and measured as the
load phase's peak.

It writes the JSON report `realsize_cpu.json` into --out (default: --work) and prints the table; the table goes into
a Markdown file as the section ``<!-- realsize:cpu -->`` only when --benchmarks_md names one. It needs most of the
machine's memory: run it alone. Before each measurement it waits up to --wait seconds (default: none) for the memory
the planner projects, and ends in one line without it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ..markdown_sections import replace_section
from .report import add_publish_arguments, check_markdown_path, commit, machine, write_report

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "tests" / "fixtures" / "published_configs"
KEY = "realsize:cpu"
GIB = 2**30
# Config fields that describe the file rather than the model: who wrote it, and its dtype's old spelling
_WRITER_FIELDS = ("transformers_version", "torch_dtype", "dtype", "architectures", "_name_or_path")


def published_configs() -> dict[str, Path]:
    """The committed published configs by model name (file name without .json)."""
    return {path.stem: path for path in sorted(PUBLISHED.glob("*.json"))}


def _model_config(config_path: Path):
    """The config as transformers reads the published file (its own class, old field names read as today's)."""
    from transformers import AutoConfig

    with open(config_path) as f:
        raw = json.load(f)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{config_path}: no model_type; pass a Hugging Face config.json")
    return AutoConfig.for_model(model_type, **raw)


def config_differences(folder: Path, config_path: Path) -> list[str]:
    """The fields on which the folder's config, read by transformers, differs from the published one read the same
    way (none: the folder has exactly that config)."""
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(folder).to_dict()
    published = _model_config(config_path).to_dict()
    keys = sorted(set(ours) | set(published))
    return [f"{k}: {ours.get(k)!r} (published {published.get(k)!r})" for k in keys
            if k not in _WRITER_FIELDS and ours.get(k) != published.get(k)]


def build_folder(config_path: Path, folder: Path, seed: int = 0, dtype: str | None = None) -> Path:
    """A folder of the model `config_path` describes: that config, random weights drawn from `seed` in the config's
    dtype (or `dtype`), saved by transformers as safetensors, and the embedded corpus's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..data.tokenizer import embedded_tokenizer

    config = _model_config(config_path)
    dtype = getattr(torch, dtype) if dtype else (config.dtype or torch.float32)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    embedded_tokenizer().save_pretrained(folder)
    return folder


def _run(args: list[str]) -> str:
    """Run `python -m adaptive_ds.tools.<args>` in a process of its own; its stdout. A failure ends the benchmark
    with the process's last lines."""
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    if done.returncode == -signal.SIGKILL:  # what the kernel's out-of-memory killer sends
        raise SystemExit(f"error: {args[0]} was killed (SIGKILL), most likely out of memory: run it alone")
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"error: {' '.join(args[:1])} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def ensure_folder(config_path: Path, work: Path, seed: int) -> Path:
    """The folder of the model `config_path` describes under `work` (named after the config): built unless it holds
    that config already."""
    folder = work / config_path.stem
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and \
            not config_differences(folder, config_path):
        return folder
    _run(["adaptive_ds.tools.realsize", "--build", str(config_path), str(folder), "--seed", str(seed)])
    return folder


def _measure(folder: Path, seq_len: int, *flags: str) -> dict:
    out = _run(["adaptive_ds.tools.realsize_run", "--init_from", str(folder), "--seq_len", str(seq_len), *flags])
    return json.loads(out.strip().splitlines()[-1])


def projection(folder: Path, seq_len: int, optimizer_step: bool) -> dict:
    """The planner's peak for a CPU process training the folder's model in the measured setting (plus its full
    step's, when it projects forward and backward only), and its parameter count."""
    from .plan import init_from_model
    from .planner import plan
    from .realsize_run import engine_config

    preset, vocab, model, _ = init_from_model(str(folder), "dense", None)
    ds_config = engine_config({})

    def peak(step: bool):  # the GPU only names a device for the plan; a CPU process's peak does not depend on it
        return plan(preset, "dense", "h200", ds_config, vocab_size=vocab, model_overrides=model, cpu_process=True,
                    seq_len=seq_len, optimizer_step=step)

    planned = peak(optimizer_step)
    return {"projected_gib": planned.peak_gib, "planned_parameters": planned.total_parameters,
            "projected_step_gib": peak(True).peak_gib}


def _folder_facts(folder: Path) -> dict:
    """The folder's weights on disk: their bytes and dtype, and its largest tensor (what loading holds twice)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    largest, dtype = ("", 0), None
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                numel = 1
                for size in view.get_shape():
                    numel *= size
                largest = max(largest, (name, numel), key=lambda item: item[1])
                dtype = dtype or view.get_dtype()
    return {"weights_bytes": sum(p.stat().st_size for p in files), "weights_dtype": dtype,
            "largest_tensor": largest[0], "largest_tensor_numel": largest[1]}


def wait_for_memory(needed_gib: float, wait_s: float, poll_s: float = 10.0) -> None:
    """Return once the machine has `needed_gib` available (other processes' memory would distort the peak, or end the
    measurement out of memory); after `wait_s` seconds without it, end the benchmark in one line."""
    deadline = time.monotonic() + wait_s
    while (available := psutil.virtual_memory().available / GIB) < needed_gib:
        if time.monotonic() >= deadline:
            raise SystemExit(f"error: the measurement needs about {needed_gib:.1f} GiB of memory and {available:.1f} "
                             "GiB are available: run it alone, or pass --wait SECONDS to wait for the memory")
        time.sleep(poll_s)


def measure_model(config_path: Path, work: Path, seq_len: int, seed: int, wait_s: float = 0.0) -> dict:
    """Build (or reuse) the folder of the model `config_path` describes, then measure it: with an optimizer step
    where the planner projects the step within this machine's memory, else forward and backward only. It waits up to
    `wait_s` seconds for the memory the planner projects (and a margin) to be available."""
    folder = ensure_folder(config_path, work, seed)
    machine_gib = psutil.virtual_memory().total / GIB
    planned = projection(folder, seq_len, optimizer_step=True)
    step = planned["projected_step_gib"] < 0.9 * machine_gib
    if not step:
        planned = projection(folder, seq_len, optimizer_step=False)
    wait_for_memory(planned["projected_gib"] + 0.5, wait_s)  # and the process's runtime, before the model
    measured = _measure(folder, seq_len, *(() if step else ("--no_step",)))
    before = measured["rss_before_model"]
    phases = {k: (v - before) / GIB for k, v in measured["phases"].items()}
    facts = _folder_facts(folder)
    source = config_path.resolve()
    return {"source": str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else str(source), **facts,
            "parameters": measured["parameters"], "vocab_size": measured["vocab_size"],
            "optimizer_step": step, "loss": measured["loss"],
            "why_no_step": None if step else (f"the planner projects {planned['projected_step_gib']:.1f} GiB for the "
                                              f"optimizer step, more than 90% of this machine's {machine_gib:.1f} GiB"),
            "rss_before_model_gib": before / GIB, "peak_rss_gib": max(measured["phases"].values()) / GIB,
            "measured_gib": max(phases.values()), "phases_gib": phases, **planned}


def run_benchmark(configs: dict[str, Path], work: Path, seq_len: int, seed: int = 0, wait_s: float = 0.0) -> dict:
    """`configs`: the config.json of each model by its name (the published ones: `published_configs`)."""
    import deepspeed
    import torch
    import transformers

    from .realsize_run import ENGINE

    command = (f"python -m adaptive_ds.tools.realsize --models {' '.join(configs)} --seq_len {seq_len}"
               + (f" --seed {seed}" if seed else ""))
    models = {name: measure_model(path, work, seq_len, seed, wait_s) for name, path in configs.items()}
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(), "command": command,
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "machine_memory_gib": psutil.virtual_memory().total / GIB, "ds_config": f"ds_configs/{ENGINE}",
            "precision": "fp32", "zero_stage": 1, "micro_batch": 1, "seq_len": seq_len, "models": models}


def _gib(value: float) -> str:
    return f"{value:.2f} GiB"


def _upcast_rows(report: dict) -> list[str]:
    rows = []
    for name, m in report["models"].items():
        fp32 = 4 * m["parameters"] / GIB
        transient = (2 + 4) * m["largest_tensor_numel"] / GIB
        rows.append(f"| {name} | {_gib(m['weights_bytes'] / GIB)} ({m['weights_dtype']}) | {_gib(fp32)} | "
                    f"{_gib(fp32 - m['weights_bytes'] / GIB)} | {_gib(transient)} (`{m['largest_tensor']}`) | "
                    f"{_gib(m['phases_gib']['load'])} |")
    return rows


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a report: provenance, peak memory against the planner, per phase, the upcast."""
    lines = [
        f"Measured {report['date']} on {report['machine']} ({report['machine_memory_gib']:.1f} GiB), torch "
        f"{report['torch']}, deepspeed {report['deepspeed']}, transformers {report['transformers']}, commit "
        f"{report['commit']}: `{report['command']}`. Each folder holds its published config "
        "(`tests/fixtures/published_configs/`), random weights made here in the config's dtype and the embedded "
        "tokenizer, with the published vocabulary; `--init_from` it as a training run builds it, with the engine of "
        f"`{report['ds_config']}` ({report['precision']}, ZeRO-{report['zero_stage']}, torch's AdamW), micro-batch "
        f"{report['micro_batch']} x seq {report['seq_len']}, one process on CPU. Measured: the process's peak "
        "resident set minus its resident set before the model; projected: the peak the planner "
        "(`adaptive_ds/tools/planner.py`) predicts for a CPU process in the same setting.",
        "",
        "| model | parameters (built / planned) | ran | measured peak | projected | error |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        ran = "forward, backward, optimizer step" if m["optimizer_step"] else "forward and backward only"
        lines.append(f"| {name} | {m['parameters']:,} / {m['planned_parameters']:,} | {ran} | "
                     f"{_gib(m['measured_gib'])} | {_gib(m['projected_gib'])} | "
                     f"{100 * (m['projected_gib'] / m['measured_gib'] - 1):+.1f}% |")
    skipped = [f"{name}: {m['why_no_step']}" for name, m in report["models"].items() if not m["optimizer_step"]]
    if skipped:
        lines += ["", "No optimizer step: " + "; ".join(skipped) + "."]
    lines += ["", "Each phase's peak over the resident set before the model (measured):", "",
              "| model | load | engine | forward and backward | optimizer step |", "|---|---|---|---|---|"]
    for name, m in report["models"].items():
        p = m["phases_gib"]
        lines.append(f"| {name} | {_gib(p['load'])} | {_gib(p['engine'])} | {_gib(p['forward_backward'])} | "
                     f"{_gib(p['step']) if 'step' in p else 'not run'} |")
    lines += ["", "The upcast: the folders hold bf16 weights and training is fp32, so the model holds 4 bytes per "
              "parameter where the folder has 2 (computed from the counts); the load reads one tensor at a time, "
              "its bf16 copy and its fp32 one together at most (computed for the largest tensor); the load phase's "
              "peak is measured, and holds the fp32 model:", "",
              "| model | folder's weights | fp32 weights | upcast's extra | largest tensor in bf16 and fp32 | "
              "load peak (measured) |", "|---|---|---|---|---|---|", *_upcast_rows(report)]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Host memory of --init_from real-size folders on "
                                                                "CPU, against the planner.")
    p.add_argument("--models", nargs="+", default=list(published_configs()), choices=list(published_configs()))
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--work", default="runs/realsize", help="folder of the built model folders (reused)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the memory a measurement needs (default: refuse at once)")
    p.add_argument("--build", nargs=2, metavar=("CONFIG_JSON", "FOLDER"),
                   help="instead: build one folder of the config (random weights, embedded tokenizer) and stop")
    add_publish_arguments(p, "realsize_cpu.json")
    return p


def check(args: argparse.Namespace) -> None:
    """What main checks before it builds or measures: ValueError in one line."""
    if args.build:
        if not os.path.isfile(args.build[0]):
            raise ValueError(f"--build {args.build[0]!r}: no such file; pass a model's config.json")
        return
    check_markdown_path(args.benchmarks_md)


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as error:
        p.error(str(error))
    if args.build:
        config_path, folder = map(Path, args.build)
        try:
            build_folder(config_path, folder, args.seed)
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"error: --build {config_path}: {error}") from None
        print(f"built {folder}")
        return
    published = published_configs()
    report = run_benchmark({name: published[name] for name in args.models}, Path(args.work), args.seq_len, args.seed,
                           args.wait)
    print(markdown(report))
    print(f"report: {write_report(args.out or args.work, KEY, report)}")
    if args.benchmarks_md:
        replace_section(args.benchmarks_md, KEY, markdown(report), "Real-size pretrained models on CPU: host "
                        "memory against the planner")


if __name__ == "__main__":
    main()
