"""A one-node Slurm cluster of this machine's own Slurm (Debian's slurm-wlm, `make slurm-deps`): munged, slurmctld and
slurmd started by hand as root, each with its state, spool, socket and log in one short-lived directory, and stopped by
their process ids whatever happens (`running_cluster`).

The configuration is the smallest a job with steps needs, without systemd or cgroups: proctrack/linuxproc (a step's
processes are the tree under its slurmstepd), task/none, select/cons_tres by CPU, one node of 2 CPUs named localhost.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from helpers.common import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "srun", "sinfo")
KILL_WAIT_S = 30  # between the SIGTERM that ends a job and the SIGKILL: above a debug run's save (a few seconds)

CONFIG = """\
ClusterName=adaptive-ds-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also holds a requeued job back (120 s by default) before it may start again
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
KillWait={kill_wait}
# a job that becomes eligible (a requeued one, after cred_expire) starts within seconds, not at the next minute's pass
SchedulerParameters=sched_interval=2,bf_interval=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(Exception):
    """Slurm cannot run here: the reason, for the test's skip."""


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    absent = [name for name in (*DAEMONS, *CLIENTS, "munge") if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed: `make slurm-deps` installs slurm-wlm and munge (root, apt-get)"
    if os.geteuid() != 0:
        return "slurmd runs jobs as root only"
    return None


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self.daemons: dict[str, subprocess.Popen] = {}

    def command(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {done.stderr.strip()}")
        return done.stdout.strip()

    def submit(self, options: list[str], script: str, args: list[str], env: dict[str, str]) -> str:
        """The id of the batch job `sbatch OPTIONS SCRIPT ARGS` makes; the job inherits `env` (and SLURM_CONF) alone."""
        done = subprocess.run(["sbatch", "--parsable", *options, script, *args],
                              env={**env, "SLURM_CONF": self.env["SLURM_CONF"]}, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ...)."""
        line = self.command("scontrol", "--oneliner", "show", "job", job_id)
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def wait_for(self, what: str, condition, timeout: float, poll: float = 0.5):
        """`condition()`'s first true value within `timeout` seconds; fails with `what` and the daemons' logs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(poll)
        raise AssertionError(f"{what}: not within {timeout:.0f} s\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in sorted((self.root / "log").glob("*")))

    def start(self) -> None:
        for name in ("state", "spool", "log", "munge"):
            (self.root / name).mkdir(mode=0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "slurm.conf").write_text(CONFIG.format(root=self.root, ctld_port=free_port(),
                                                            slurmd_port=free_port(), kill_wait=KILL_WAIT_S))
        munge = self.root / "munge"
        self._daemon("munged", "munged", "--foreground", "--force", f"--socket={munge}/munge.socket",
                     f"--key-file={key}", f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed",
                     f"--log-file={self.root}/log/munged.log")
        self._ready("munged", lambda: (munge / "munge.socket").exists())
        self._daemon("slurmctld", "slurmctld", "-D")
        self._ready("slurmctld", lambda: self.command("scontrol", "ping", check=False).count("UP") > 0)
        self._daemon("slurmd", "slurmd", "-D", "-N", "localhost")
        self._ready("slurmd", lambda: self.command("sinfo", "--noheader", "--format=%T", check=False) == "idle")

    def _daemon(self, name: str, *args: str) -> None:
        with open(self.root / "log" / f"{name}.out", "w") as out:
            self.daemons[name] = subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def _ready(self, name: str, condition) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            if self.daemons[name].poll() is not None or time.monotonic() > deadline:
                raise SlurmUnavailable(f"{name} did not start:\n{self.logs()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Kill every job (its steps are slurmstepd's, not ours), then the daemons, by their process ids."""
        if "slurmd" in self.daemons and self.daemons["slurmd"].poll() is None:
            self.command("scancel", "--full", "--signal=KILL", "--partition=test", check=False)
            with contextlib.suppress(AssertionError):
                self.wait_for("the jobs' end", lambda: not self.command(
                    "squeue", "--noheader", "--states=RUNNING,COMPLETING", check=False), timeout=20)
            self.command("scancel", "--partition=test", check=False)  # pending ones too
        for name in reversed(DAEMONS):
            process = self.daemons.get(name)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def running_cluster() -> Iterator[Cluster]:
    """A started cluster, stopped (daemons by their pids) and removed on the way out, whatever happened. In a directory
    of a short path: munge's and slurmd's unix sockets live there."""
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    cluster = Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
