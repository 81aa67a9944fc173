"""The real-size benchmark's measurements (`tools/realsize.py`), each in a process of its own (`tools/realsize_run.py`)
so that its peak resident set is its model's alone, started once the memory it needs is available."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil

GIB = 2**30


def run_tool(args: list[str]) -> str:
    """Run `python -m adaptive_ds.tools.<args>` in a process of its own; its stdout. A failure ends the benchmark
    with the process's last lines."""
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    if done.returncode == -signal.SIGKILL:  # what the kernel's out-of-memory killer sends
        raise SystemExit(f"error: {args[0]} was killed (SIGKILL), most likely out of memory: run it alone")
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"error: {' '.join(args[:1])} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def measure(*flags: str) -> dict:
    """One measurement (`realsize_run` with `flags`): the JSON object its last line prints."""
    out = run_tool(["adaptive_ds.tools.realsize_run", *flags])
    return json.loads(out.strip().splitlines()[-1])


def wait_for_memory(needed_gib: float, wait_s: float, poll_s: float = 10.0) -> None:
    """Return once the machine has `needed_gib` available (other processes' memory would distort the peak, or end the
    measurement out of memory); after `wait_s` seconds without it, end the benchmark in one line."""
    deadline = time.monotonic() + wait_s
    while (available := psutil.virtual_memory().available / GIB) < needed_gib:
        if time.monotonic() >= deadline:
            raise SystemExit(f"error: the measurement needs about {needed_gib:.1f} GiB of memory and {available:.1f} "
                             "GiB are available: run it alone, or pass --wait SECONDS to wait for the memory")
        time.sleep(poll_s)


def phases_over_start(measured: dict) -> dict:
    """A measurement's peaks as the reports state them: each phase's peak over the resident set before the model,
    the largest of them (`measured_gib`), and the process's own resident sets, in GiB."""
    before = measured["rss_before_model"]
    phases = {k: (v - before) / GIB for k, v in measured["phases"].items()}
    return {"rss_before_model_gib": before / GIB, "peak_rss_gib": max(measured["phases"].values()) / GIB,
            "measured_gib": max(phases.values()), "phases_gib": phases}
