"""DeepSpeed's ops that the shipped configs need, built once per environment: `make setup` runs this, so that no test
and no first run waits for a compile.

    python -m adaptive_ds.tools.build_ops [--fresh] [--out DIR] [--benchmarks_md BENCHMARKS.md]

DeepSpeed compiles some ops with the machine's C++ compiler (through ninja; CUDA's for FusedAdam on a GPU) the first
time a run needs one, into TORCH_EXTENSIONS_DIR (the Makefile sets it to the virtualenv's), and loads them from
there afterwards: its CPU Adam (the optimizer of a config that offloads it to the CPU: b1_t4.json), FusedAdam (the
optimizer of the other GPU configs) and, on DeepSpeed's CPU accelerator, its shared-memory collectives. An op that
fails to build is named with DeepSpeed's error and the command exits non-zero.

`--fresh` builds each op in an empty temporary folder instead, and times it: the report (`--out DIR`:
DIR/ops-build_<cpu|gpu>.json) holds each op's wall and compiler CPU seconds and the load average as it started, and
`--benchmarks_md` writes the section `ops-build:cpu` (or `:gpu`) from it.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import psutil

# (DeepSpeed's builder, the op's name in TORCH_EXTENSIONS_DIR, what needs it)
OPS = (("CPUAdamBuilder", "cpu_adam", "an optimizer offloaded to the CPU (b1_t4.json, b7_a100_40gb_offload.json, "
                                      "b7_moe_8gpu.json)"),
       ("FusedAdamBuilder", "fused_adam", "Adam without offload or torch_adam (the other GPU configs)"),
       ("ShareMemCommBuilder", "deepspeed_shm_comm", "collectives of DeepSpeed's CPU accelerator (every run on a CPU)"))
CPU_ONLY = {"ShareMemCommBuilder"}


def _kind(accelerator) -> str:
    return "cpu" if accelerator.device_name() == "cpu" else "gpu"


def _compiler() -> str:
    """The C++ compiler's first line of `--version` (torch builds with $CXX, else c++)."""
    try:
        done = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "no C++ compiler"
    return done.stdout.splitlines()[0].strip()


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the compiler's processes, once they have ended
    return usage.ru_utime + usage.ru_stime


def build(accelerator) -> list[dict]:
    """Load (building where it is not built yet) each op this accelerator uses; one record per op."""
    results = []
    for builder_name, name, needed_by in OPS:
        if builder_name in CPU_ONLY and _kind(accelerator) != "cpu":
            continue
        load, started, cpu = os.getloadavg()[0], time.perf_counter(), _children_cpu_s()
        try:
            accelerator.create_op_builder(builder_name).load()
            error = None
        except Exception as failure:  # a compiler missing or failing: DeepSpeed raises what the build raised
            last = str(failure).strip().splitlines() or [""]
            error = f"{type(failure).__name__}: {last[-1]}"
        results.append({"op": name, "needed_by": needed_by, "wall_s": round(time.perf_counter() - started, 1),
                        "compiler_cpu_s": round(_children_cpu_s() - cpu, 1), "load_average_at_start": round(load, 2),
                        "ok": error is None, **({"error": error} if error else {})})
    return results


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a `--fresh` report: provenance and one row per op."""
    lines = [f"Measured {report['date']} on {report['machine']} ({report['cpu']}, {report['memory_gib']} GiB), "
             f"torch {report['torch']}, deepspeed {report['deepspeed']}, {report['compiler']}, commit "
             f"{report['commit']}: `{report['command']}`. Each op built from an empty TORCH_EXTENSIONS_DIR, one "
             "after the other, as `make setup` builds them once per virtualenv (a run then loads each from there). "
             "The wall time grows with what else the machine runs (its load average as each build started: near 0 "
             "on an idle machine); the CPU time is the compiler's.", "",
             "| op | needed by | wall time | compiler CPU time | load average at its start |", "|---|---|---|---|---|"]
    for r in report["results"]:
        status = "" if r["ok"] else f" (**failed**: {r['error']})"
        lines.append(f"| `{r['op']}` | {r['needed_by']} | {r['wall_s']:.0f} s{status} | {r['compiler_cpu_s']:.0f} s | "
                     f"{r['load_average_at_start']:.2f} |")
    wall, cpu = sum(r["wall_s"] for r in report["results"]), sum(r["compiler_cpu_s"] for r in report["results"])
    lines.append(f"| all | `make setup`, once | {wall:.0f} s | {cpu:.0f} s | |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from .report import add_publish_arguments

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m adaptive_ds.tools.build_ops",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--fresh", action="store_true", help="build each op in an empty temporary folder and time it "
                                                        "(the environment's built ops are left alone)")
    add_publish_arguments(p, "ops-build_<cpu|gpu>.json")
    return p


def check(args: argparse.Namespace) -> None:
    """What main checks before it builds: ValueError in one line."""
    from .report import check_markdown_path

    if (args.out or args.benchmarks_md) and not args.fresh:
        raise ValueError("--out and --benchmarks_md report a build from nothing: add --fresh (loading built ops "
                         "measures nothing)")
    check_markdown_path(args.benchmarks_md)


def main(argv: list[str] | None = None) -> None:
    from ..distributed import arch_list_deepspeed_can_read, use_this_environments_ninja
    from .quickstart import cpu_model
    from .report import commit, machine, write_report

    p = _parser()
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as error:
        p.error(str(error))
    use_this_environments_ninja()  # the environment's ninja, as every run of ours uses: a build each one reuses
    arch_list_deepspeed_can_read()
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    with tempfile.TemporaryDirectory(prefix="torch_extensions-") as fresh:
        if args.fresh:
            os.environ["TORCH_EXTENSIONS_DIR"] = fresh
        results = build(accelerator)
    for r in results:
        print(f"{r['op']}: " + (f"ready in {r['wall_s']:.1f} s" if r["ok"] else f"did not build: {r['error']}"))
    if args.out:
        kind = _kind(accelerator)
        report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "cpu": cpu_model(),
                  "memory_gib": round(psutil.virtual_memory().total / 2**30),
                  "torch": torch.__version__, "deepspeed": deepspeed.__version__, "compiler": _compiler(),
                  "commit": commit(), "command": " ".join(["python -m adaptive_ds.tools.build_ops",
                                                           *(sys.argv[1:] if argv is None else argv)]),
                  "results": results}
        print(f"report: {write_report(args.out, f'ops-build:{kind}', report)}")
        if args.benchmarks_md:
            from ..markdown_sections import replace_section

            replace_section(args.benchmarks_md, f"ops-build:{kind}", markdown(report),
                            "DeepSpeed's op builds (measured)")
    failed = [r for r in results if not r["ok"]]
    if failed:
        raise SystemExit("error: " + "; ".join(f"DeepSpeed's {r['op']} op did not build ({r['error']}), needed by "
                                               f"{r['needed_by']}" for r in failed)
                         + "; install a C++ compiler (and CUDA's, nvcc, for a GPU's FusedAdam) and run it again")


if __name__ == "__main__":
    main()
