"""The Slurm batch script (launchers/slurm/train.sbatch) on a real one-node Slurm (tests/helpers/slurm_cluster.py), one
launcher of 2 processes on the CPU, the debug preset on the embedded corpus (ds_configs/debug_cpu.json): a job runs to
its end; a job that `scontrol requeue` stops mid-run saves before KillWait, and its requeued run's losses are the
uninterrupted job's, bit for bit; a job warned before its time limit (`--signal=B:USR1@60`) saves, requeues itself
from the script's trap, and its requeued run resumes where it stopped. They skip where Slurm is not installed
(`make slurm-deps`) or its daemons cannot start."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import slurm_cluster
from helpers.common import DEBUG_CPU, ROOT, free_port, script_env

SCRIPT = str(ROOT / "launchers" / "slurm" / "train.sbatch")
TRAIN = ["--ds_config", DEBUG_CPU, "--warmup_steps", "2", "--log_steps", "1", "--micro_batch", "2",
         "--eval_batches", "1"]
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture
def cluster():
    reason = slurm_cluster.missing()
    if reason:
        pytest.skip(reason)
    try:
        with slurm_cluster.running_cluster() as running:
            yield running
    except slurm_cluster.SlurmUnavailable as error:
        pytest.skip(str(error))


class Job:
    """A batch job of the script: one node, its 2 CPUs, one launcher of 2 processes; the run without --output_dir, so
    in `directory`/runs/debug-dense-slurm-JOBID."""

    def __init__(self, cluster, directory: Path, launcher: str, options: list[str], args: list[str]):
        self.cluster, self.directory = cluster, directory
        # a thread per process on the node's 2 CPUs: torchrun sets that by itself, the deepspeed launcher does not
        env = script_env(ADAPTIVE_DS_LAUNCHER=launcher, ADAPTIVE_DS_NPROC_PER_NODE="2",
                         ADAPTIVE_DS_MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
        self.id = cluster.submit(["--chdir", str(directory), "--output", str(directory / "job-%j.out"), "--nodes=1",
                                  "--cpus-per-task=2", *options], SCRIPT, args, env)

    def fields(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def output(self) -> str:
        path = self.directory / f"job-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def records(self) -> list[dict]:
        """Its metrics.jsonl's records, without a line the run is still writing."""
        path = self.directory / "runs" / f"debug-dense-slurm-{self.id}" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []

    def wait(self, what: str, condition, timeout: float = 300):
        """`condition()`'s first true value within `timeout` seconds; fails with the job's output and daemons' logs."""
        try:
            return self.cluster.wait_for(f"job {self.id}: {what}", condition, timeout, poll=0.2)
        except AssertionError as error:
            raise AssertionError(f"{error}\n--- job-{self.id}.out\n{self.output()[-4000:]}") from None

    def ended(self) -> str:
        """Its final state, once Slurm is done with it (nothing left completing, and no requeue on the way)."""
        def done():
            state = self.fields()["JobState"]
            gone = not self.cluster.command("squeue", "--noheader", f"--jobs={self.id}", check=False)
            return state if state in FINAL_STATES and gone else None
        return self.wait("its end", done)

    def stop_step(self) -> int:
        """The step the run saved at on a signal, from its one line."""
        stops = re.findall(r"stopped by SIGTERM at step (\d+), saved", self.output())
        assert stops, f"no save on a signal:\n{self.output()[-4000:]}"
        return int(stops[0])

    def check_resumed(self, stop: int, steps: int) -> None:
        """The first run's steps 1..stop, then the requeued run's (SLURM_RESTART_COUNT 1) from stop + 1, each once."""
        assert f"resumed from step{stop:08d} at step {stop}" in self.output(), self.output()[-4000:]
        logged = [(r["step"], r.get("requeues", 0)) for r in self.records()]
        assert logged == [(step, int(step > stop)) for step in range(1, steps + 1)], logged


@pytest.mark.slow
def test_a_job_ends_and_a_job_requeued_mid_run_continues_the_curve(cluster, tmp_path):
    """The deepspeed launcher runs the reference job to its end. torchrun runs the same one, which `scontrol requeue`
    stops after step 3: Slurm signals every process of the job, the run saves at a step boundary within KillWait
    (30 s), and the requeued job (the same id, so the same directory) resumes there by itself and ends."""
    train = [*TRAIN, "--max_steps", "10"]
    reference = Job(cluster, tmp_path, "deepspeed", [], train)
    requeued = Job(cluster, tmp_path, "torchrun", [], train)  # starts once the reference has left the 2 CPUs
    assert reference.ended() == "COMPLETED", reference.output()[-4000:]
    assert [r["step"] for r in reference.records()] == list(range(1, 11))

    requeued.wait("step 3", lambda: len(requeued.records()) >= 3)
    cluster.command("scontrol", "requeue", requeued.id)
    assert requeued.ended() == "COMPLETED", requeued.output()[-4000:]
    assert requeued.fields()["Restarts"] == "1"
    assert "before the time limit" not in requeued.output()  # Slurm's own SIGTERM is not taken for a warning
    stop = requeued.stop_step()
    assert 3 <= stop < 10
    requeued.check_resumed(stop, 10)
    assert [r["loss"] for r in requeued.records()] == [r["loss"] for r in reference.records()]


@pytest.mark.slow
def test_a_job_warned_before_its_time_limit_saves_requeues_itself_and_resumes(cluster, tmp_path):
    """A two-minute job warned a minute before its end (`--time=2 --signal=B:USR1@60`). slurmctld checks time limits
    every 30 s from its start, and sends the warning at the first check at most a check before the time the job asked
    for (sbatch's manual: up to 60 s early): this cluster is fresh and the job starts at once, so the warning comes at
    the check 60 s after slurmctld started, about 58 s into the job, when the run is training even on a loaded machine
    (a one-minute job would be warned at the first check, 28 s in, which some starts outlast). The script passes
    SIGTERM on, the run saves, and the script requeues the job. A requeued job gets its time limit again, and with it
    an early warning: it is given 10 minutes here, then cancelled once it has trained 2 steps; a cancel is not
    requeued."""
    job = Job(cluster, tmp_path, "torchrun", ["--time=2", "--signal=B:USR1@60"], [*TRAIN, "--max_steps", "1000"])
    job.wait("its requeue", lambda: job.fields()["Restarts"] == "1", timeout=240)
    cluster.command("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")
    assert job.output().count("SIGUSR1 before the time limit") == 1, job.output()[-4000:]
    assert "before training began" not in job.output(), "the warning came before the run trained: a slow start"
    stop = job.stop_step()

    job.wait("2 steps after its requeue", lambda: len(job.records()) >= stop + 2)
    cluster.command("scancel", job.id)
    assert job.ended() == "CANCELLED"
    assert job.fields()["Restarts"] == "1"
    assert job.output().count("before the time limit") == 1  # the cancel's SIGTERM is not taken for a warning
    job.check_resumed(stop, len(job.records()))
