"""One training run across two real hosts: two network namespaces joined by a veth pair (tests/helpers/hosts.py),
each node's launcher started in its own with `ip netns exec`, gloo told its link (GLOO_SOCKET_IFNAME), so every
byte between the nodes crosses that link. Both multi-node launches of docs/training.md: torchrun with `--nnodes 2`
and its c10d rendezvous at host A's address (`--local_addr` on each node), and DeepSpeed's launcher with a hostfile,
`--no_ssh --node_rank` and `--master_addr`. Each run's losses equal a run of 2 processes on one host.

The DeepSpeed run is held before step 5 (tests/helpers/train_held.py), its link is cut and it is let go: both nodes
stop with the one line within the collective timeout, and with the link restored the same commands resume from step
4. (Not cut under torchrun: its processes stop the same way, but the agent of the node cut off from the rendezvous
store blocks in a call to that store, which torch does not bound; docs/training.md says so.)

Where namespaces cannot be made (not root, no `ip`, a kernel or container that refuses) these tests skip with the
reason; the two-node test on loopback (test_examples.py) runs everywhere.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from helpers.common import ROOT, free_port, logged_losses, once_per_run, output_within, script_env, write_ds_config
from helpers.hosts import TwoHosts, Unavailable

MAX_STEPS, SAVE_STEPS, HELD_STEP = 6, 2, 5  # held (and cut) before step 5: the resume starts from step 4
TIMEOUT_S = 20  # --collective_timeout_s: short, yet above the start-up skew of the two nodes on a loaded machine
HELD = str(ROOT / "tests" / "helpers" / "train_held.py")
STOPPED = re.compile(r"^error: lost contact with another process \((.+)\) at step (\d+); rerun the same command "
                     r"to resume from checkpoint (\S+)$", re.M)
RENDEZVOUS_PORT = "29400"  # each namespace has ports of its own


@pytest.fixture
def hosts():
    try:
        made = TwoHosts.make()
    except Unavailable as reason:
        pytest.skip(f"cannot make two hosts from network namespaces: {reason}")
    yield made
    made.remove()  # kills what the test started there, even when it failed


def _ds_config(directory: Path) -> str:
    return write_ds_config(directory, 2, 1, max_steps=MAX_STEPS, warmup_steps=2, save_steps=SAVE_STEPS, log_steps=1)


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> dict[int, float]:
    """The same run (2 processes of micro-batch 2, the same global batch) on one host, over loopback: run once for
    all of this module's tests, whichever workers run them."""
    losses = once_per_run(tmp_path_factory, "two_hosts_one_host", _one_host_losses)
    return {int(step): loss for step, loss in losses.items()}


def _one_host_losses(tmp: Path) -> dict[int, float]:
    process = subprocess.Popen(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
                                "launchers/train.py", "--ds_config", _ds_config(tmp), "--output_dir", str(tmp / "out")],
                               cwd=ROOT, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    output = output_within(process, 420)
    assert process.returncode == 0, output[-3000:]
    return logged_losses(tmp / "out")


def _torchrun(hosts: TwoHosts, node: int, script: list[str]) -> list[str]:
    """torchrun's multi-node form on `node`: its c10d rendezvous at host A's address, which torch knows as its own by
    the host's name only (so host A is told, is_host), and the address the other node reaches it at (--local_addr:
    rank 0's becomes every process's MASTER_ADDR)."""
    return ["torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
            f"{hosts.addresses[0]}:{RENDEZVOUS_PORT}", "--rdzv_id", "two-hosts", "--local_addr", hosts.addresses[node],
            *(["--rdzv_conf", "is_host=1"] if node == 0 else []), *script]


def _deepspeed(hosts: TwoHosts, node: int, script: list[str], tmp_path: Path) -> list[str]:
    """DeepSpeed's launcher without ssh: the same hostfile on each node, its own --node_rank."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("host-a slots=1\nhost-b slots=1\n")
    return ["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
            hosts.addresses[0], "--master_port", RENDEZVOUS_PORT, *script]


def _until(condition, processes: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    """Wait until `condition()`; fail with the logs if one of `processes` ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p.returncode for p in processes if p.poll() is not None]
        assert not ended and time.monotonic() < deadline, _tails(logs)
        time.sleep(0.05)


def _finish(hosts: TwoHosts, commands: list[list[str]], logs: list[Path]) -> None:
    """Both nodes' commands run to their end, with status 0."""
    nodes = [hosts.start(node, commands[node], logs[node]) for node in (0, 1)]
    _until(lambda: all(p.poll() is not None for p in nodes), [], logs, timeout=300)
    assert [p.returncode for p in nodes] == [0, 0], _tails(logs)


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-2500:]}" for log in logs)


@pytest.mark.slow
def test_torchrun_across_two_hosts_trains_as_one_host_does(hosts, one_host, tmp_path):
    script = ["launchers/train.py", "--ds_config", _ds_config(tmp_path), "--output_dir", str(tmp_path / "run")]
    _finish(hosts, [_torchrun(hosts, node, script) for node in (0, 1)], [tmp_path / "a.log", tmp_path / "b.log"])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2
    assert hosts.received_bytes(1) > 1_000_000  # each step's gradients reached host B over the link
    assert logged_losses(tmp_path / "run") == pytest.approx(one_host, rel=1e-6, abs=0)


@pytest.mark.slow
def test_deepspeed_across_two_hosts_stops_when_its_link_is_cut_and_resumes(hosts, one_host, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    script = [HELD, str(gate), str(HELD_STEP), "--ds_config", _ds_config(tmp_path), "--output_dir",
              str(tmp_path / "run"), "--collective_timeout_s", str(TIMEOUT_S)]
    commands = [_deepspeed(hosts, node, script, tmp_path) for node in (0, 1)]
    logs = [tmp_path / "first-a.log", tmp_path / "first-b.log"]
    first = [hosts.start(node, commands[node], logs[node]) for node in (0, 1)]
    _until(lambda: all((gate / f"held.{rank}").exists() for rank in (0, 1)), first, logs, timeout=300)
    assert hosts.received_bytes(1) > 1_000_000  # steps 1-4's gradients reached host B over the link

    hosts.cut()
    (gate / "open").touch()
    opened = time.monotonic()
    waited = {}

    def both_stopped() -> bool:
        for node, log in enumerate(logs):
            if node not in waited and STOPPED.search(log.read_text()):
                waited[node] = time.monotonic() - opened
        return len(waited) == 2

    _until(both_stopped, [], logs, timeout=TIMEOUT_S + 60)
    for node, log in enumerate(logs):
        (what, step, checkpoint), = STOPPED.findall(log.read_text())  # one line on each host
        assert "Timed out" in what and step == str(HELD_STEP), what
        assert checkpoint == str(tmp_path / "run" / "checkpoints" / "step00000004")
        assert TIMEOUT_S - 1 < waited[node] < TIMEOUT_S + 15, waited
    for process in first:  # each node's launcher ends by itself
        assert process.wait(timeout=60) != 0

    hosts.restore()
    _finish(hosts, commands, [tmp_path / "again-a.log", tmp_path / "again-b.log"])  # the same commands
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["world_size"], summary["resumed_from_step"], summary["steps"]) == (2, 4, MAX_STEPS)
    # steps 1-4 from before the cut, 5-6 from after the resume
    assert logged_losses(tmp_path / "run") == pytest.approx(one_host, rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_node_whose_gloo_would_listen_on_loopback_stops_with_one_line(hosts, tmp_path):
    """Without GLOO_SOCKET_IFNAME gloo listens on the address of the host's name, here loopback (inside a namespace
    no other address of the name can be bound): the other node could never connect, so the run stops before it
    joins with a line that names the fix, not a lost process."""
    log = tmp_path / "a.log"
    script = ["launchers/train.py", "--ds_config", write_ds_config(tmp_path)]
    node = hosts.start(0, _deepspeed(hosts, 0, script, tmp_path), log, GLOO_SOCKET_IFNAME=None)
    assert node.wait(timeout=240) != 0
    lines = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: the run spans 2 machines, but gloo would listen on "
                                                   "loopback"), log.read_text()[-3000:]
    assert "set GLOO_SOCKET_IFNAME" in lines[0]
