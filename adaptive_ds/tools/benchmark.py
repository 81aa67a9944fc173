"""Side-by-side training throughput of the architectures at one preset, through the DeepSpeed engine.

    python -m adaptive_ds.tools.benchmark --preset debug --steps 20 --rounds 5
    python -m adaptive_ds.tools.benchmark --restate benchmarks/throughput_debug_cpu.json --benchmarks_md BENCHMARKS.md
    python -m adaptive_ds.tools.benchmark --memory --preset debug_200m --cases dense --micro_batch 1
    python -m adaptive_ds.tools.benchmark --generate --cases dense mod hybrid --micro_batch 1 --trained mod=RUN/final

Each case is a model at the preset, trained with real optimizer steps on the embedded corpus. Cases run in rounds in
one process, each round every case back to back for --steps optimizer steps (each round starting one case later
than the last, so that a steady drift in the machine's speed favours no case), after a warm-up round like them that is
not counted (allocator, kernels, JIT, compilation). A case's tokens/s is the median over the rounds; a ratio of two
cases is paired: case a's tokens/s over case b's within each round (both measured close together, under the same
load), the median of those per-round ratios reported with their min and max. Cases: dense; moe (our index-based
dispatch); moe_deepspeed (DeepSpeed's stock MoE dispatch on the same model and routing, the baseline); mod and
hybrid at MoD capacity 0.5 in every block (what the GPU targets name); mod_paper (12.5% in every other block, mod's
default); and what a user would pick instead, under the same DeepSpeed engine: transformers' LlamaForCausalLM
(hf_llama) and MixtralForCausalLM (hf_mixtral), built from the dense and MoE models' own weights, and HF Llama
compiled (hf_llama_compile: `torch.compile` through DeepSpeed's `engine.compile()`, inductor), beside ours compiled
the same way (dense_compile). Our models are called as the trainer calls them, with `skip_logits=True` (the loss
without the logits as an output: compiled, a returned logits tensor costs the backward a zero gradient of them);
transformers' models return their logits, as their forward always does, and hf_llama_loss_compile is that compiled
Llama returning only its loss, the two compiled models under the same call. The warm-up round absorbs the
compilation, and each compiled case reports its graph breaks and the graphs compiled after warm-up (recompilations;
0 when the shapes settle). MFU counts the FLOPs of the tokens actually routed (`adaptive_ds.flops`) against the GPU's
dense peak; on a CPU, where no peak is defined, achieved TFLOP/s is reported instead.

`--generate` measures inference instead: `generate()` tokens/s of each case at equal length (the same prompts,
the same number of new tokens, greedy, with the KV cache), beside the share of tokens each MoD block ran on.
A MoD model's cost depends on how many tokens its router routes, which a random router does not show (it routes
about half, whatever the capacity): pass trained models with `--trained CASE=FOLDER`.

Each measurement writes its JSON report into --out (default `runs/benchmark`), named after its BENCHMARKS.md section
(`throughput_<preset>_<cpu|gpu>.json`, `generate_<preset>_<cpu|gpu>_batch<N>.json`), and prints its table; the
section goes into a Markdown file only when --benchmarks_md names one. Nothing a user runs writes into the
repository's committed results unless asked: publishing is `--out benchmarks --benchmarks_md BENCHMARKS.md`, and
each section is rendered from its report alone, labelled "stale since <commit>" once the code it measured has changed
(`adaptive_ds.tools.staleness`). `--restate REPORT ...` works a throughput report's ratios out anew from its recorded
rounds, without measuring, and rewrites it (and its section where --benchmarks_md says).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import shlex
import statistics
import sys
import time

import deepspeed
import torch

from .. import distributed
from ..data import build_training_data
from ..export.convert import load_any
from ..flops import training_flops_per_token
from ..hardware import DEVICES, detect_device
from ..models import AdaptiveDSForCausalLM
from ..models.families.llama import to_llama
from ..models.families.mixtral import to_mixtral
from ..presets import PRESETS, model_config
from ..training import moe_adapter
from ..training.optim import parameter_groups
from .benchmark_cases import CASES, GENERATION_CASES, RATIOS, LossOnly
from .report import check_markdown_path, commit, machine, write_report
from .staleness import write_labelled_section

logger = logging.getLogger(__name__)


def _ds_config(micro_batch: int, precision: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        # torch's AdamW on CPU; DeepSpeed's FusedAdam (a JIT-built op) where it pays off, on CUDA
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": not torch.cuda.is_available(),
                                                  "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 1}, "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"}, "steps_per_print": 10**9,
    }


def dynamo_counts() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process, from torch._dynamo's counters."""
    counters = torch._dynamo.utils.counters
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


class Case:
    def __init__(self, name: str, preset: str, vocab_size: int, micro_batch: int, precision: str, seed: int,
                 compile_backend: str = "inductor"):
        torch.manual_seed(seed)
        self.name = name
        self.config = model_config(preset, vocab_size=vocab_size, moe_drop_tokens=False, **CASES[name].model)
        model = AdaptiveDSForCausalLM(self.config)
        if name.startswith("hf_llama"):
            model = to_llama(model)
            if name == "hf_llama_loss_compile":
                model = LossOnly(model)
        elif name == "hf_mixtral":
            model = to_mixtral(model)
        moe_adapter.prepare(model)  # as the trainer's engine is built (training.engine.build_engine)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.1),
                                               config=_ds_config(micro_batch, precision))
        if name.endswith("_compile"):
            self.engine.compile(backend=compile_backend)
        # ours called as the trainer calls them (the loss without the logits as an output); transformers' models
        # return their logits, as their forward always does, but for the one wrapped in LossOnly
        self.call_options = {} if name.startswith("hf_") else {"skip_logits": True}
        self.rates: list[float] = []  # tokens/s of each counted round
        self.warmup_rate: float | None = None  # tokens/s of the warm-up round, not counted
        self.compiles: list[tuple[int, int]] = []  # (graph breaks, graphs compiled) during each run: warm-up first
        self.routed: list[float] = []

    def run(self, batches, steps: int) -> float:
        """`steps` optimizer steps; their tokens/s."""
        tokens = 0
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        before = dynamo_counts()
        start = time.perf_counter()
        for _ in range(steps):
            batch = {k: v.to(self.engine.device) for k, v in next(batches).items()}
            out = self.engine(**batch, **self.call_options)
            self.engine.backward(out.loss)
            self.engine.step()
            tokens += batch["input_ids"].numel()
            if getattr(out, "mod_routing", None):
                self.routed = [float(r.routed.float().mean()) for r in out.mod_routing]
        sync()
        rate = tokens / (time.perf_counter() - start)
        after = dynamo_counts()
        self.compiles.append((after[0] - before[0], after[1] - before[1]))
        return rate

    def result(self, seq_len: int, peak_tflops: float | None) -> dict:
        tokens_per_s = statistics.median(self.rates)
        flops = training_flops_per_token(self.config, seq_len, self.routed or None)
        achieved = tokens_per_s * flops / 1e12
        compiled = self.engine.is_compiled
        return {"tokens_per_s": tokens_per_s, "rounds": self.rates, "warmup_tokens_per_s": self.warmup_rate,
                "flops_per_token": flops, "compiled": compiled,
                "graph_breaks": sum(b for b, _ in self.compiles) if compiled else None,
                "recompiles_after_warmup": sum(g for _, g in self.compiles[1:]) if compiled else None,
                "achieved_tflops": achieved, "mfu": achieved / peak_tflops if peak_tflops else None}


def paired_ratios(results: dict, pairs) -> dict[str, list[float]]:
    """Each pair's per-round ratios ("a/b": case a's tokens/s over case b's in each round) of the cases in `results`:
    round r of one case and round r of another ran back to back, under the same load."""
    return {f"{a}/{b}": [x / y for x, y in zip(results[a]["rounds"], results[b]["rounds"], strict=True)]
            for a, b in pairs if a in results and b in results}


def restate(report: dict) -> dict:
    """A throughput report with its ratios worked out anew from its recorded rounds by this version (`ratios`: the
    median of each pair's per-round ratios, `ratio_rounds`: those per-round ratios); nothing else changes."""
    rounds = paired_ratios(report["results"], RATIOS)
    return {**report, "ratios": {name: statistics.median(values) for name, values in rounds.items()},
            "ratio_rounds": rounds}


def run_benchmark(preset: str, steps: int, rounds: int, warmup: int | None, micro_batch: int, precision: str,
                  cases: list[str], seed: int = 0, compile_backend: str = "inductor") -> dict:
    """`rounds` counted rounds of `steps` optimizer steps per case, after a warm-up round of `warmup` steps per case
    (None: `steps`, a round like the others). `compile_backend`: torch.compile's backend for the compiled cases
    ("eager" traces without code generation, for a quick check of the graphs)."""
    warmup = steps if warmup is None else warmup
    distributed.init_distributed()
    seq_len = PRESETS[preset].seq_len
    data = build_training_data("embedded", seq_len, seed)
    built = [Case(name, preset, len(data.tokenizer), micro_batch, precision, seed, compile_backend) for name in cases]
    batches = data.step_batches(0, micro_batch)
    for case in built:  # the warm-up round: allocator, kernels, JIT, compilation
        case.warmup_rate = case.run(batches, warmup)
    orders = []
    for r in range(rounds):  # each round starts one case later, so a steady drift favours no case
        order = built[r % len(built):] + built[:r % len(built)]
        orders.append([case.name for case in order])
        for case in order:
            case.rates.append(case.run(batches, steps))
    device = detect_device()
    peak = DEVICES[device].peak_tflops if device else None  # a CPU has no agreed peak; nor has an unknown GPU
    results = {case.name: case.result(seq_len, peak) for case in built}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    return restate({
        "preset": preset, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(),
        "command": f"python -m adaptive_ds.tools.benchmark --preset {preset} --steps {steps} --rounds {rounds} "
                   f"--warmup {warmup} --micro_batch {micro_batch} --precision {precision}"
                   + ("" if list(cases) == list(CASES) else " --cases " + " ".join(cases)),
        "seq_len": seq_len, "micro_batch": micro_batch, "precision": precision, "steps_per_round": steps,
        "rounds": rounds, "warmup_steps": warmup, "device": device, "peak_tflops": peak, "torch": torch.__version__,
        "deepspeed": deepspeed.__version__, "results": results, "round_orders": orders})


def forget_peak_rss() -> None:
    """Reset this process's resident high-water mark to its resident set now (Linux: /proc/self/clear_refs "5"), so
    that a later peak is measured from here; elsewhere the peak stays the process's lifetime one."""
    if os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_rss() -> int:
    """This process's resident high-water mark in bytes (since `forget_peak_rss` on Linux)."""
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def measure_peak_memory(preset: str, case: str, micro_batch: int, checkpointing: bool, vocab_size: int = 128,
                        steps: int = 2, experts: int | None = None) -> dict:
    """Peak memory of training steps of one of our models (`case`: one of GENERATION_CASES) through DeepSpeed
    (fp32, ZeRO-1), beside the planner's prediction. `experts`: another number of experts than the preset's (a MoE
    model that fits the machine).

    On CUDA the allocator's peak; on CPU the process's peak resident set minus its resident set before the
    model was built (the Python, torch and DeepSpeed runtime is not the model's).
    """
    import psutil

    from .planner import plan

    distributed.init_distributed()
    baseline = psutil.Process().memory_info().rss
    forget_peak_rss()  # the peak measured is the model's and its training's, not one of start-up before it
    seq_len = PRESETS[preset].seq_len
    overrides = {**CASES[case].model, "moe_drop_tokens": False, **({"num_local_experts": experts} if experts else {})}
    arch = overrides.pop("arch")
    config = model_config(preset, arch, vocab_size, **overrides)
    model = AdaptiveDSForCausalLM(config)
    model.model.gradient_checkpointing = checkpointing
    ds_config = _ds_config(micro_batch, "fp32")
    moe_adapter.prepare(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.1), config=ds_config)
    for _ in range(steps):
        ids = torch.randint(0, vocab_size, (micro_batch, seq_len), device=engine.device)
        # with the logits returned, as the planner's count of a step's memory has it (the trainer's skip_logits
        # holds them no longer than the loss needs them: a peak at most that, not yet in the planner's model)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
    if torch.cuda.is_available():
        measured = torch.cuda.max_memory_allocated()
    else:
        measured = peak_rss() - baseline
    predicted = plan(preset, arch, "h200", ds_config, vocab_size=vocab_size, activation_checkpointing=checkpointing,
                     model_overrides=overrides, cpu_process=not torch.cuda.is_available()).peak_gib
    command = (f"python -m adaptive_ds.tools.benchmark --memory --preset {preset} --cases {case} "
               f"--micro_batch {micro_batch}"
               + (" --checkpointing" if checkpointing else "") + (f" --experts {experts}" if experts else ""))
    return {"preset": preset, "case": case, "arch": arch, "model": overrides, "vocab_size": vocab_size,
            "micro_batch": micro_batch, "seq_len": seq_len, "activation_checkpointing": checkpointing,
            "precision": "fp32", "zero_stage": 1, "experts": config.num_local_experts,
            "device": "cuda" if torch.cuda.is_available() else "cpu", "measured_gib": measured / 2**30,
            "predicted_gib": predicted, "error": predicted / (measured / 2**30) - 1,
            "date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(), "command": command,
            "torch": torch.__version__, "deepspeed": deepspeed.__version__}


def memory_key(report: dict) -> str:
    """The name of a peak-memory report: memory:PRESET:cpu|cuda:CASE:mbN[:checkpointing][:eE] (the planner's
    validation table reads the committed ones, benchmarks/memory_*.json)."""
    return (f"memory:{report['preset']}:{report['device']}:{report['case']}:mb{report['micro_batch']}"
            + (":checkpointing" if report["activation_checkpointing"] else "")
            + (f":e{report['experts']}" if report["experts"] != PRESETS[report["preset"]].num_local_experts else ""))


def _generation_model(preset: str, name: str, folder: str | None, vocab_size: int, seed: int) -> torch.nn.Module:
    """Case `name`'s model for generation: the trained one in `folder`, else random weights drawn from `seed`."""
    torch.manual_seed(seed)
    if folder is None:
        return AdaptiveDSForCausalLM(model_config(preset, vocab_size=vocab_size, moe_drop_tokens=False,
                                                  **CASES[name].model))
    model = load_any(folder)[0]
    if model.config.arch != CASES[name].model["arch"]:
        raise ValueError(f"--trained {name}={folder} is a {model.config.arch} model, not {name}")
    return model


def measure_generation(preset: str, cases: list[str], batch: int, prompt_len: int, new_tokens: int, rounds: int,
                       precision: str = "fp32", seed: int = 0, trained: dict[str, str] | None = None) -> dict:
    """generate() tokens/s of each case: `batch` held-out prompts of `prompt_len` tokens, `new_tokens` greedy
    tokens each (no early stop), with the KV cache; median over the rounds, each every case back to back, after a
    warm-up round; each case's ratio to dense paired (`paired_ratios`).

    `trained`: case -> a trained model folder (save_pretrained / final) used instead of random weights. Each case
    also reports the share of tokens each MoD block ran on in its generated sequences, and whether generation
    without the KV cache gave the same tokens.
    """
    trained = trained or {}
    unknown = sorted(set(cases) - set(GENERATION_CASES)) + sorted(set(trained) - set(cases))
    if unknown:
        raise ValueError(f"cannot measure generation of {', '.join(unknown)}; valid cases: "
                         f"{', '.join(GENERATION_CASES)} (each --trained CASE also among --cases)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    data = build_training_data("embedded", PRESETS[preset].seq_len, seed)
    prompts = data.validation_batches(batch, 1)[0]["input_ids"][:, :prompt_len].to(device)
    models = {name: _generation_model(preset, name, trained.get(name), len(data.tokenizer), seed).to(device, dtype)
              .eval() for name in cases}
    steps = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                 pad_token_id=data.tokenizer.pad_token_id)
    rates = {name: [] for name in cases}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for round_index in range(rounds + 1):  # round 0 warms up
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            sequences = model.generate(prompts, use_cache=True, **steps)
            sync()
            if round_index:
                rates[name].append(batch * new_tokens / (time.perf_counter() - start))
    results = {}
    for name, model in models.items():
        sequences = model.generate(prompts, use_cache=True, **steps)
        equal = torch.equal(sequences, model.generate(prompts, use_cache=False, **steps))
        with torch.no_grad():
            routing = model(input_ids=sequences, use_cache=False).mod_routing  # the decisions generation made
        results[name] = {"tokens_per_s": statistics.median(rates[name]), "rounds": rates[name],
                         "trained": trained.get(name), "equal_without_cache": equal,
                         "routed": [float(r.routed.float().mean()) for r in routing or ()]}
    paired = paired_ratios(results, [(name, "dense") for name in results if name != "dense"])
    command = (f"python -m adaptive_ds.tools.benchmark --generate --preset {preset} --cases {' '.join(cases)} "
               f"--micro_batch {batch} --prompt_len {prompt_len} --new_tokens {new_tokens} --rounds {rounds} "
               f"--precision {precision}")
    if trained:
        command += " --trained " + " ".join(shlex.quote(f"{name}={path}") for name, path in trained.items())
    return {"preset": preset, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(),
            "command": command, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else
            f"cpu ({torch.get_num_threads()} threads)", "precision": precision, "batch": batch,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds, "results": results,
            "ratios": {name: statistics.median(values) for name, values in paired.items()}, "ratio_rounds": paired}


def generation_table(report: dict) -> str:
    lines = [f"generate() on {report['device']}, {report['precision']}, batch {report['batch']}, prompt "
             f"{report['prompt_len']} + {report['new_tokens']} new tokens, median of {report['rounds']} rounds",
             f"{'case':<11}{'tokens/s':>10}{'vs dense':>10}  {'cache = no cache':<18}routed share per MoD block"]
    for name, r in report["results"].items():
        ratio = report["ratios"].get(f"{name}/dense")
        routed = " ".join(f"{x:.2f}" for x in r["routed"]) or "-"
        lines.append(f"{name:<11}{r['tokens_per_s']:>10,.1f}{f'{ratio:.2f}x' if ratio else '':>10}  "
                     f"{str(r['equal_without_cache']):<18}{routed}{' (trained)' if r['trained'] else ''}")
    return "\n".join(lines)


def _span(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def _device_kind(report: dict) -> str:
    return "cpu" if report["device"].startswith("cpu") else "gpu"


def generation_key(report: dict) -> str:
    """The BENCHMARKS.md section of a generation report: generate:PRESET:cpu|gpu:batchN."""
    return f"generate:{report['preset']}:{_device_kind(report)}:batch{report['batch']}"


def generation_markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a generation report: provenance, then tokens/s per case."""
    lines = [
        f"Measured {report['date']} on {report['machine']} ({report['device']}), torch {report['torch']}, deepspeed "
        f"{report['deepspeed']}, commit {report['commit']}: `{report['command']}`. {report['precision']}, batch "
        f"{report['batch']}, prompt {report['prompt_len']} + {report['new_tokens']} new tokens (greedy, no early "
        f"stop, with the KV cache), median of {report['rounds']} rounds, each running every case back to back, after a "
        "warm-up round that is not counted; vs dense: the median of the per-round ratios (their min–max).",
        "",
        "| case | model | tokens/s | vs dense | KV cache = no cache | routed share per MoD block |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        ratio = f"{name}/dense"
        routed = ", ".join(f"{x:.2f}" for x in r["routed"]) or "-"
        model = f"trained, `{r['trained']}`" if r["trained"] else "random weights"
        shown = f"{report['ratios'][ratio]:.2f}x" if ratio in report["ratios"] else "-"
        if ratio in report.get("ratio_rounds", {}):
            shown += " ({:.2f}x–{:.2f}x)".format(*_span(report["ratio_rounds"][ratio]))
        lines.append(f"| `{name}` | {model} | {r['tokens_per_s']:,.1f} | {shown} | "
                     f"{'yes' if r['equal_without_cache'] else '**no**'} | {routed} |")
    return "\n".join(lines)


def _table(report: dict) -> str:
    lines = [f"{report['preset']} on {report['device']}, {report['precision']}, micro-batch {report['micro_batch']} "
             f"x seq {report['seq_len']}, median of {report['rounds']} rounds x {report['steps_per_round']} steps",
             f"{'case':<17}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}  graph breaks, recompiles after warm-up"]
    for name, r in report["results"].items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        graphs = f"  {r['graph_breaks']}, {r['recompiles_after_warmup']}" if r["compiled"] else ""
        lines.append(f"{name:<17}{r['tokens_per_s']:>12,.0f}{r['achieved_tflops']:>10.3f}{mfu:>8}{graphs}")
    lines += [f"{name}: {statistics.median(values):.2f}x, per round " + " ".join(f"{v:.2f}x" for v in values)
              for name, values in paired_ratios(report["results"], RATIOS).items()]
    return "\n".join(lines)


def _warmup_text(report: dict) -> str:
    """How the counted rounds were warmed up: a round like them, or (the reports before it was) the command's
    --warmup steps."""
    steps = report.get("warmup_steps")
    if steps is None:
        steps = int(re.search(r"--warmup (\d+)", report["command"]).group(1))
    if steps == report["steps_per_round"]:
        return "after a warm-up round like them, not counted"
    return f"after a warm-up of {steps} optimizer steps per case, not a full round, not counted"


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a report: provenance, tokens/s per case, the paired ratios (worked out from the
    recorded rounds, so a report of any version renders so)."""
    gpu = report["peak_tflops"] is not None
    lines = [
        f"Measured {report['date']} on {report['machine']}, torch {report['torch']}, deepspeed {report['deepspeed']}, "
        f"commit {report['commit']}: `{report['command']}`. {report['precision']}, ZeRO-1, micro-batch "
        f"{report['micro_batch']} x seq {report['seq_len']}, embedded corpus, every case through the same DeepSpeed "
        f"engine. {report['rounds']} rounds, each running every case back to back for {report['steps_per_round']} "
        f"optimizer steps{' (each round starting one case later than the last)' * bool(report.get('round_orders'))}"
        f", {_warmup_text(report)}. A case's tokens/s is its median over the rounds; a ratio is "
        "paired: case a's tokens/s over case b's in the same round, the median of those per-round ratios, with "
        "their min and max.",
        "",
        "| case | tokens/s | " + ("MFU |" if gpu else "achieved TFLOP/s |"),
        "|---|---|---|",
    ]
    for name, r in report["results"].items():
        speed = f"{100 * r['mfu']:.1f}%" if gpu else f"{r['achieved_tflops']:.3f}"
        lines.append(f"| {CASES[name].description} (`{name}`) | {r['tokens_per_s']:,.0f} | {speed} |")
    lines += ["", f"| ratio | median of {report['rounds']} rounds | min – max | per round |", "|---|---|---|---|"]
    for name, values in paired_ratios(report["results"], RATIOS).items():
        lines.append(f"| {name.replace('/', ' / ')} | {statistics.median(values):.2f}x | "
                     "{:.2f}x – {:.2f}x | ".format(*_span(values)) + ", ".join(f"{v:.2f}x" for v in values) + " |")
    compiled = [f"`{name}` {r['graph_breaks']} graph breaks, {r['recompiles_after_warmup']} recompilations after "
                "warm-up" for name, r in report["results"].items() if r.get("compiled")]
    if compiled:
        lines += ["", "Compiled cases (torch._dynamo's counters): " + "; ".join(compiled) + "."]
    return "\n".join(lines)


def throughput_key(report: dict) -> str:
    """The BENCHMARKS.md section of a throughput report: throughput:PRESET:cpu|gpu."""
    return f"throughput:{report['preset']}:{_device_kind(report)}"


def write_section(path: str, report: dict) -> None:
    """The report's section of the Markdown file at `path`, labelled if the code it measured has changed since."""
    write_labelled_section(path, throughput_key(report), markdown(report),
                           f"Training throughput side by side, {report['preset']}, {report['machine']}",
                           report["commit"])


def write_generation_section(path: str, report: dict) -> None:
    write_labelled_section(path, generation_key(report), generation_markdown(report),
                           f"generate() tokens/s, {report['preset']}, batch {report['batch']}, {report['machine']}",
                           report["commit"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="Side-by-side training throughput of the architectures.")
    p.add_argument("--preset", default="debug", choices=list(PRESETS))
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per case per round")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds counted, each every case back to back: the ratios' median, min and max are over them")
    p.add_argument("--warmup", type=int,
                   help="optimizer steps per case in the warm-up round, which is not counted (default: --steps)")
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--precision", default="bf16" if torch.cuda.is_available() else "fp32",
                   choices=["fp32", "bf16", "fp16"])
    p.add_argument("--cases", nargs="+", choices=list(CASES),
                   help=f"default: every case; with --generate {' '.join(GENERATION_CASES)}")
    p.add_argument("--out", default="runs/benchmark",
                   help="folder of the JSON report, named after its section (the repository's committed results: "
                        "benchmarks)")
    p.add_argument("--benchmarks_md", help="also write its table as a section of this Markdown file (the "
                                           "repository's: BENCHMARKS.md); by default no file is touched")
    p.add_argument("--memory", action="store_true",
                   help="instead: measure one case's peak memory (--cases CASE, one of "
                        f"{' '.join(GENERATION_CASES)}) beside the planner's prediction")
    p.add_argument("--checkpointing", action="store_true", help="with --memory: activation checkpointing")
    p.add_argument("--experts", type=int, help="with --memory: number of experts (default: the preset's)")
    p.add_argument("--generate", action="store_true",
                   help="instead: generate() tokens/s of each case at equal length (--micro_batch prompts)")
    p.add_argument("--prompt_len", type=int, default=32, help="with --generate: prompt tokens")
    p.add_argument("--new_tokens", type=int, default=128, help="with --generate: tokens generated per prompt")
    p.add_argument("--trained", nargs="+", default=[], metavar="CASE=FOLDER",
                   help="with --generate: trained models (save_pretrained folders) instead of random weights")
    p.add_argument("--restate", nargs="+", metavar="REPORT",
                   help="instead: work each throughput report's ratios out anew from its recorded rounds and rewrite "
                        "it (and its section, with --benchmarks_md); nothing is measured")
    return p


def _restate_files(paths: list[str], benchmarks_md: str | None) -> None:
    """--restate: every report read and restated before any is written, so a bad one leaves them all as they were."""
    reports = []
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
            if "steps_per_round" not in report:
                raise KeyError("steps_per_round")
            reports.append(restate(report))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"error: --restate {path}: not a throughput report ({error!r})") from None
    for path, report in zip(paths, reports, strict=True):
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        if benchmarks_md:
            write_section(benchmarks_md, report)
        print(f"restated {path}" + (f" and its section in {benchmarks_md}" if benchmarks_md else ""))


def check(args: argparse.Namespace) -> None:
    """What main checks before it measures: ValueError in one line."""
    check_markdown_path(args.benchmarks_md)
    trained = dict(item.split("=", 1) for item in args.trained if "=" in item)
    if len(trained) != len(args.trained):
        raise ValueError("--trained takes CASE=FOLDER pairs, e.g. mod=runs/mod/final")
    if missing := [folder for folder in trained.values() if not os.path.isdir(folder)]:
        raise ValueError(f"--trained: no folder {', '.join(map(repr, missing))}; pass trained models' "
                         "save_pretrained folders (OUTPUT_DIR/final)")
    if args.memory and args.cases and args.cases[0] not in GENERATION_CASES:
        raise ValueError(f"--memory measures one of our models; --cases one of {', '.join(GENERATION_CASES)}")
    if missing := [path for path in args.restate or () if not os.path.isfile(path)]:
        raise ValueError(f"--restate {', '.join(map(repr, missing))}: no such file; pass throughput reports (JSON)")


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    distributed.setup_logging(logging.WARNING)
    try:
        check(args)
    except ValueError as error:
        p.error(str(error))
    if args.restate:
        return _restate_files(args.restate, args.benchmarks_md)
    for name in ("steps", "rounds", "warmup", "micro_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.generate:
        trained = dict(item.split("=", 1) for item in args.trained)
        try:
            report = measure_generation(args.preset, args.cases or list(GENERATION_CASES), args.micro_batch,
                                        args.prompt_len, args.new_tokens, args.rounds, args.precision,
                                        trained=trained)
        except ValueError as error:
            p.error(str(error))
        print(generation_table(report))
        print(f"report: {write_report(args.out, generation_key(report), report)}")
        if args.benchmarks_md:
            write_generation_section(args.benchmarks_md, report)
        return
    args.cases = args.cases or list(CASES)
    if args.memory:
        report = measure_peak_memory(args.preset, args.cases[0], args.micro_batch, args.checkpointing,
                                     experts=args.experts)
        print(json.dumps(report, indent=2))
        print(f"report: {write_report(args.out, memory_key(report), report)}")
        return
    report = run_benchmark(args.preset, args.steps, args.rounds, args.warmup, args.micro_batch, args.precision,
                           args.cases)
    print(_table(report))
    print(f"report: {write_report(args.out, throughput_key(report), report)}")
    if args.benchmarks_md:
        write_section(args.benchmarks_md, report)


if __name__ == "__main__":
    main()
