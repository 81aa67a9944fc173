"""Real-size pretrained models on this machine: a folder with exactly a published config, and what `--init_from`
it costs in host memory beside the planner's projection.

    python -m adaptive_ds.tools.realsize [--models Llama-3.2-1B Qwen2.5-0.5B SmolLM2-360M] [--seq_len 256] [--wait S]
    python -m adaptive_ds.tools.realsize --build CONFIG_JSON FOLDER
    python -m adaptive_ds.tools.realsize --preset b1 --layers 2 4 8 --ds_config ds_configs/b1_t4.json [--seq_len 256]
    python -m adaptive_ds.tools.realsize --restate benchmarks/realsize_b1_cpu.json [--benchmarks_md BENCHMARKS.md]

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

With --layers, the width mode (`realsize_width`): a preset's model at its width with those layer counts, on the
engine of --ds_config as configured (ZeRO-Offload included) but at micro-batch 1 without accumulation, measured,
fitted to a line and extrapolated to the preset's depth beside the planner; report `realsize_<preset>_cpu.json`,
section ``<!-- realsize:<preset>:cpu -->``. It checks the largest depth's projected peak against the machine before it
measures any, and takes a --seq_len up to the preset's.
`--restate REPORT` rewrites a width report (and, with --benchmarks_md, its section) with its projections and host
question worked out anew by this version's planner from its recorded measurements; nothing is measured (a --models
report keeps the projections it recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import psutil

from ..hardware import GPUS
from ..markdown_sections import replace_section
from ..presets import NO_PRESET_SEQ_LEN, PRESETS
from . import realsize_width
from .realsize_process import GIB, measure, phases_over_start, run_tool, wait_for_memory
from .report import add_publish_arguments, check_markdown_path, commit, machine, write_report

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "tests" / "fixtures" / "published_configs"
KEY = "realsize:cpu"
WIDTH_HEADING = "A preset's width on CPU ({preset}): host memory, fitted"
__all__ = ["GIB", "build_folder", "ensure_folder", "main", "markdown", "run_benchmark", "wait_for_memory"]
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


def ensure_folder(config_path: Path, work: Path, seed: int) -> Path:
    """The folder of the model `config_path` describes under `work` (named after the config): built unless it holds
    that config already."""
    folder = work / config_path.stem
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and \
            not config_differences(folder, config_path):
        return folder
    run_tool(["adaptive_ds.tools.realsize", "--build", str(config_path), str(folder), "--seed", str(seed)])
    return folder


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
    measured = measure("--init_from", str(folder), "--seq_len", str(seq_len), *(() if step else ("--no_step",)))
    facts = _folder_facts(folder)
    source = config_path.resolve()
    return {"source": str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else str(source), **facts,
            "parameters": measured["parameters"], "vocab_size": measured["vocab_size"],
            "optimizer_step": step, "loss": measured["loss"],
            "why_no_step": None if step else (f"the planner projects {planned['projected_step_gib']:.1f} GiB for the "
                                              f"optimizer step, more than 90% of this machine's {machine_gib:.1f} GiB"),
            **phases_over_start(measured), **planned}


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
    """The BENCHMARKS.md section of a report: provenance, peak memory against the planner, per phase, the upcast (a
    preset's width at a few depths: `realsize_width.markdown`)."""
    if "preset_layers" in report:
        return realsize_width.markdown(report)
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
    p.add_argument("--models", nargs="+", choices=list(published_configs()),
                   help="the published configs' models to measure (default: all)")
    p.add_argument("--layers", nargs="+", type=int,
                   help="instead: the width mode, the --preset's model with these layer counts (two or more)")
    p.add_argument("--preset", choices=list(PRESETS), help="with --layers: the preset (default: the --ds_config's)")
    p.add_argument("--ds_config", help="with --layers: the engine, as configured (e.g. ds_configs/b1_t4.json)")
    p.add_argument("--vocab_size", type=int, default=32000, help="with --layers: the model's vocabulary (default: "
                                                                   "the presets' published 32,000)")
    p.add_argument("--gpu", default="t4", choices=GPUS, help="with --layers: the GPU whose host the report answers "
                                                             "for (default: t4)")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--work", default="runs/realsize", help="folder of the built model folders (reused)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the memory a measurement needs (default: refuse at once)")
    p.add_argument("--build", nargs=2, metavar=("CONFIG_JSON", "FOLDER"),
                   help="instead: build one folder of the config (random weights, embedded tokenizer) and stop")
    p.add_argument("--restate", metavar="REPORT",
                   help="instead: work a width report's projections and host question out anew from its recorded "
                        "measurements and rewrite it (and its section, with --benchmarks_md); nothing is measured")
    add_publish_arguments(p, "realsize_cpu.json")
    return p


def check(args: argparse.Namespace) -> None:
    """What main checks before it builds or measures: ValueError in one line."""
    if args.build:
        if not os.path.isfile(args.build[0]):
            raise ValueError(f"--build {args.build[0]!r}: no such file; pass a model's config.json")
        return
    check_markdown_path(args.benchmarks_md)
    if args.restate:
        others = [flag for flag, on in (("--layers", args.layers is not None), ("--models", args.models)) if on]
        if others:
            raise ValueError(f"--restate rewrites a report without measuring: drop {', '.join(others)}")
        _width_report(args.restate)
        return
    _width_preset(args, _parser())
    if args.layers is None and args.seq_len > NO_PRESET_SEQ_LEN:
        raise ValueError(f"--seq_len {args.seq_len}: at most {NO_PRESET_SEQ_LEN}, the longest a run of a folder "
                         "trains at (its max_position_embeddings up to the longest preset's seq_len)")


WIDTH_REPORT_KEYS = ("preset", "ds_config", "seq_len", "vocab_size", "preset_layers", "models", "fit", "host")


def _width_report(path: str) -> dict:
    """The width report at `path` (what --restate rewrites), or ValueError in one line."""
    if not os.path.isfile(path):
        raise ValueError(f"--restate {path}: no such file; pass a width report (benchmarks/realsize_<preset>_cpu.json)")
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--restate {path}: not a JSON report ({error})") from None
    missing = [key for key in WIDTH_REPORT_KEYS if key not in report] if isinstance(report, dict) else ["all"]
    if missing:
        raise ValueError(f"--restate {path}: not a width report (no {', '.join(missing)}; a --models report keeps "
                         "its recorded projections)")
    return report


def _restate(path: str, benchmarks_md: str | None) -> None:
    """--restate: the width report at `path` restated (`realsize_width.restate`) and written back, with its section."""
    try:
        report = realsize_width.restate(_width_report(path))
    except (ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"error: --restate {path}: {error!r}" if not isinstance(error, ValueError) else
                         f"error: {error}") from None
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    if benchmarks_md:
        replace_section(benchmarks_md, f"realsize:{report['preset']}:cpu", markdown(report),
                        WIDTH_HEADING.format(preset=report["preset"]))
    print(f"restated {path}" + (f" and its section in {benchmarks_md}" if benchmarks_md else ""))


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    if args.build:
        config_path, folder = map(Path, args.build)
        try:
            build_folder(config_path, folder, args.seed)
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"error: --build {config_path}: {error}") from None
        print(f"built {folder}")
        return
    if args.restate:
        _restate(args.restate, args.benchmarks_md)
        return
    preset = _width_preset(args, p)
    if preset is not None:
        key, heading = f"realsize:{preset}:cpu", WIDTH_HEADING.format(preset=preset)
        report = realsize_width.run_width_benchmark(preset, args.ds_config, args.layers, args.seq_len,
                                                    args.vocab_size, args.gpu, args.wait)
    else:
        published = published_configs()
        key, heading = KEY, "Real-size pretrained models on CPU: host memory against the planner"
        report = run_benchmark({name: published[name] for name in args.models or published}, Path(args.work),
                               args.seq_len, args.seed, args.wait)
    print(markdown(report))
    print(f"report: {write_report(args.out or args.work, key, report)}")
    if args.benchmarks_md:
        replace_section(args.benchmarks_md, key, markdown(report), heading)


def _width_preset(args, parser: argparse.ArgumentParser) -> str | None:
    """The preset of the width mode (None: the --models mode); flags that do not go together, or a layer count, a
    vocabulary or a ds_config that cannot run, refused in one line (ValueError) before anything is measured."""
    from ..ds_config import load

    width_flags = [f"--{name}" for name in ("preset", "ds_config", "gpu", "vocab_size")
                   if getattr(args, name) != parser.get_default(name)]
    if args.layers is None:
        if width_flags:
            raise ValueError(f"{', '.join(width_flags)} belong to the width mode: pass --layers too")
        return None
    if args.models:
        raise ValueError("--models and --layers are two modes: pass one")
    if len(set(args.layers)) < 2 or min(args.layers) < 1:
        raise ValueError(f"--layers {' '.join(map(str, args.layers))}: two or more distinct positive layer counts "
                         "(a line is fitted through them)")
    if args.vocab_size < 1 or args.seq_len < 1:
        raise ValueError("--vocab_size and --seq_len must be positive")
    if args.ds_config is None:
        raise ValueError("--layers needs --ds_config: the engine to measure, e.g. ds_configs/b1_t4.json")
    raw = load(args.ds_config)  # read and checked whether or not it names the preset
    preset = args.preset or raw.get("adaptive_ds", {}).get("preset")
    if preset not in PRESETS:
        raise ValueError(f"{args.ds_config} names no preset: pass --preset ({', '.join(PRESETS)})")
    if args.seq_len > PRESETS[preset].seq_len:
        raise ValueError(f"--seq_len {args.seq_len}: at most {PRESETS[preset].seq_len}, preset {preset}'s context "
                         "(the sequence its runs train at)")
    return preset


if __name__ == "__main__":
    main()
