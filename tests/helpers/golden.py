"""Golden losses: scenarios whose per-step losses must stay bit for bit what tests/fixtures/golden_losses.json holds.

Each scenario is defined here once (its ds_configs and commands), and both the recorder and
tests/integration/test_golden_losses.py run it from this definition: the default run of each architecture for 40
steps, and tiny runs through the fault paths (a kill and a resume, an out-of-memory retry, a spike rollback, a stop
request and its resume, a 2-process run resumed on one process). Every command runs as a user would start it, in a
subprocess from the repository root, on THREADS intra-op threads: bit-identical CPU losses hold only at a fixed
thread count.

    python tests/helpers/golden.py record tests/fixtures/golden_losses.json

records every scenario at the checked-out commit (a tree with uncommitted changes to tracked files is refused: the
fixture names the commit it was recorded at).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, as under pytest

from helpers.common import ROOT, logged_losses, script_env, with_free_port, write_ds_config  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "golden_losses.json"
THREADS = 1
ARCHS = ("dense", "moe", "mod", "hybrid")
DEFAULT_STEPS = 40

TRAIN = ("python", "launchers/train.py")
FAULTS = ("python", "tests/helpers/train_with_faults.py")
TORCHRUN_2 = ("torchrun", "--nproc_per_node", "2")
ARGS = ("--ds_config", "{ds}", "--output_dir", "{out}")  # {ds}: the scenario's ds_config, {out}: its run directory


@dataclass(frozen=True)
class Stage:
    """One command of a scenario and the exit status it must end with (None: any failure, as a killed torchrun's)."""

    name: str
    argv: tuple[str, ...]
    returncode: int | None = 0


@dataclass(frozen=True)
class Scenario:
    """What a scenario exercises, its commands in order (in one run directory), and the ds_config they read."""

    what: str
    stages: tuple[Stage, ...]
    ds_config: dict = field(default_factory=dict)  # write_ds_config's arguments; empty: the commands name their own


def _faults(faults: dict) -> tuple[str, ...]:
    return (*FAULTS, json.dumps(faults))


def _default(arch: str) -> Scenario:
    argv = (*TRAIN, "--ds_config", "ds_configs/debug_cpu.json", "--arch", arch, "--max_steps", str(DEFAULT_STEPS),
            "--log_steps", "1", "--output_dir", "{out}")
    return Scenario(f"the default run of {arch}, {DEFAULT_STEPS} steps", (Stage("train", argv),))


SCENARIOS: dict[str, Scenario] = {
    **{f"default-{arch}": _default(arch) for arch in ARCHS},
    "resume": Scenario(
        "SIGKILL before step 5 (step 3's checkpoint on disk); the same command resumes at step 3",
        (Stage("killed before step 5", (*_faults({"kill_before_step": 5}), *ARGS), returncode=-9),
         Stage("resumed", (*TRAIN, *ARGS))),
        dict(micro=2, accum=2, max_steps=6, save_steps=3)),
    "oom-retry": Scenario(
        "out of memory in step 3's second micro-batch of 4 rows: retried in place at 2 rows x 4",
        (Stage("train", (*_faults({"oom_micro_batch_above": 2, "oom_from_step": 3, "oom_at_micro_index": 1}),
                         *ARGS)),),
        dict(micro=4, accum=2, max_steps=6, save_steps=2)),
    "spike-rollback": Scenario(
        "the lm_head scaled x30 before step 6: the spike rolls back to step 4's checkpoint at half the lr",
        (Stage("train", (*_faults({"spike_at_step": 6}), *ARGS)),),
        dict(micro=8, accum=1, max_steps=8, save_steps=2, controller={"spike_window": 3, "spike_sigma": 3.0})),
    "stop-request": Scenario(
        "SIGTERM before step 3: saved at step 3, exit 143; the same command resumes at step 3",
        (Stage("stopped at step 3", (*_faults({"signal_before_step": 3}), *ARGS), returncode=143),
         Stage("resumed", (*TRAIN, *ARGS))),
        dict(micro=2, accum=2, max_steps=6)),
    "2-to-1-processes": Scenario(
        "2 processes x 2 rows x 2 micro-batches, SIGKILL before step 5; resumed on one process at step 3's "
        "checkpoint (through the universal format) with the same global batch of 8 rows",
        (Stage("2 processes, killed before step 5",
               (*TORCHRUN_2, "tests/helpers/train_with_faults.py", json.dumps({"kill_before_step": 5}), *ARGS),
               returncode=None),
         Stage("resumed on 1 process", (*TRAIN, *ARGS))),
        dict(micro=2, accum=2, max_steps=6, save_steps=3, model={"num_hidden_layers": 2})),
}


def environment(root: Path) -> dict:
    """The commands' environment: THREADS intra-op threads, and the package of `root` imported."""
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return script_env(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), PYTHONPATH=path)


def _pairs(records: list[dict], key: str) -> list[list]:
    return [[r["step"], r[key]] for r in records if key in r]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(name: str, directory: Path, root: Path = ROOT) -> dict:
    """Runs scenario `name` from `root` with its files in `directory`; returns what the fixture records of it: its
    definition (the commands with their placeholders, the ds_config they read) and what it trained."""
    scenario = SCENARIOS[name]
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "run"
    places = {"{out}": str(out)}
    if scenario.ds_config:
        places["{ds}"] = write_ds_config(directory, **scenario.ds_config)
    definition = {"what": scenario.what,
                  "ds_config": json.loads(Path(places["{ds}"]).read_text()) if scenario.ds_config else None,
                  "commands": [{"name": s.name, "argv": list(s.argv), "returncode": s.returncode}
                               for s in scenario.stages]}
    env = environment(root)
    losses = {}
    for stage in scenario.stages:
        argv = [sys.executable if a == "python" else places.get(a, a) for a in stage.argv]
        done = subprocess.run(with_free_port(argv), cwd=root, env=env, capture_output=True, text=True, timeout=900)
        failed = done.returncode == 0 if stage.returncode is None else done.returncode != stage.returncode
        if failed:
            raise AssertionError(f"{name}: {stage.name} exited {done.returncode}, expected "
                                 f"{stage.returncode if stage.returncode is not None else 'a failure'}:\n"
                                 f"{done.stderr[-3000:]}")
        losses[f"losses after {stage.name}"] = [[s, loss] for s, loss in sorted(logged_losses(out).items())]
    losses["losses"] = losses.pop(f"losses after {scenario.stages[-1].name}")
    records = _jsonl(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    return {
        **definition,
        "losses": losses,
        "validation_losses": _pairs(records, "validation_loss"),
        "abandoned_losses": _pairs(_jsonl(out / "abandoned_metrics.jsonl"), "loss"),
        "final_validation_loss": summary["validation_loss"],
        "resumed_from_step": summary["resumed_from_step"],
        "decision_steps": [d["step"] for d in _jsonl(out / "decisions.jsonl")],
    }


def differences(name: str, recorded: dict, got: dict) -> list[str]:
    """Each way `got` differs from `recorded` (exact equality), naming the first differing step of each series."""
    problems = [f"{name}: {key} changed since the fixture was recorded (re-record it)"
                for key in ("what", "ds_config", "commands") if got[key] != recorded[key]]
    series = {**recorded["losses"], "validation_losses": recorded["validation_losses"],
              "abandoned_losses": recorded["abandoned_losses"]}
    new = {**got["losses"], "validation_losses": got["validation_losses"], "abandoned_losses": got["abandoned_losses"]}
    for key in sorted(set(series) | set(new)):
        want, have = series.get(key, []), new.get(key, [])
        for index, (a, b) in enumerate(zip(want, have, strict=False)):
            if a != b:
                problems.append(f"{name}: {key} differ first at step {a[0]} (entry {index}): recorded {a[1]!r}, "
                                f"got {b[1]!r} at step {b[0]}")
                break
        else:
            if len(want) != len(have):
                problems.append(f"{name}: {key} has {len(have)} entries, recorded {len(want)}: steps "
                                f"{[s for s, _ in have]} vs {[s for s, _ in want]}")
    for key in ("final_validation_loss", "resumed_from_step", "decision_steps"):
        if got[key] != recorded[key]:
            problems.append(f"{name}: {key} is {got[key]!r}, recorded {recorded[key]!r}")
    return problems


def threads_in_subprocess(root: Path = ROOT) -> int:
    """torch's intra-op thread count in a command started with environment(root)."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], cwd=root,
                          env=environment(root), capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def _commit(root: Path) -> str:
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.split("\n")
    changed = [line[3:] for line in changed if line.strip()]
    if changed:
        raise SystemExit(f"uncommitted changes to tracked files ({', '.join(changed)}): record at a clean commit")
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def _dumps(value, indent: str = "") -> str:
    """JSON, indented, with each list of plain values (a command, a [step, loss] pair) on one line."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = (f"{inner}{json.dumps(key)}: {_dumps(item, inner)}" for key, item in value.items())
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and any(isinstance(item, (list, dict)) for item in value):
        return "[\n" + ",\n".join(inner + _dumps(item, inner) for item in value) + f"\n{indent}]"
    return json.dumps(value)


def record(path: Path) -> None:
    commit = _commit(ROOT)
    threads = threads_in_subprocess()
    assert threads == THREADS, f"the commands run on {threads} threads, not {THREADS}"
    fixture = {"commit": commit, "threads": THREADS, "torch": version("torch"), "deepspeed": version("deepspeed"),
               "python": sys.version.split()[0], "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        for name in SCENARIOS:
            print(f"{name}: {SCENARIOS[name].what}", flush=True)
            fixture["scenarios"][name] = run(name, Path(tmp) / name)
    path.write_text(_dumps(fixture) + "\n")
    print(f"recorded {len(SCENARIOS)} scenarios at {commit} in {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recorder = commands.add_parser("record", help="run every scenario and write the fixture")
    recorder.add_argument("path", type=Path, nargs="?", default=FIXTURE)
    args = parser.parse_args(argv)
    record(args.path)


if __name__ == "__main__":
    main()
