"""Two hosts on one machine: two network namespaces joined by a veth pair, each with an address of its own and its
loopback up, so that a process started in one reaches the other only over that link (as root: `ip netns`).

    hosts = TwoHosts.make()          # raises Unavailable with the reason where namespaces cannot be made
    process = hosts.start(0, ["torchrun", ...], log)   # runs in host 0 with GLOO_SOCKET_IFNAME=its link
    hosts.cut(); hosts.restore()     # the link down, then up again (the addresses stay)
    hosts.remove()                   # kills every process in them, then deletes them

The names are drawn at random per instance, so that concurrent test runs (pytest -n) never share one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

from helpers.common import ROOT, script_env

SUBNET = "10.77.0"


class Unavailable(Exception):
    """This machine cannot make the namespaces (not root, no `ip`, or the kernel refuses)."""


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise Unavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


class TwoHosts:
    def __init__(self, tag: str):
        self.namespaces = (f"{tag}a", f"{tag}b")
        self.links = (f"{tag}va", f"{tag}vb")  # interface names: at most 15 characters
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.processes: list[subprocess.Popen] = []
        self.made: list[str] = []

    @classmethod
    def make(cls) -> TwoHosts:
        if os.geteuid() != 0:
            raise Unavailable(f"network namespaces need root (this runs as uid {os.geteuid()})")
        if shutil.which("ip") is None:
            raise Unavailable("`ip` (iproute2) is not installed")
        hosts = cls(f"ads{secrets.token_hex(3)}")
        try:
            hosts._make()
        except Unavailable:
            hosts.remove()
            raise
        return hosts

    def _make(self) -> None:
        for name in self.namespaces:
            _ip("netns", "add", name)
            self.made.append(name)
        (a, b), (link_a, link_b) = self.namespaces, self.links
        _ip("link", "add", link_a, "netns", a, "type", "veth", "peer", "name", link_b, "netns", b)
        for name, link, address in zip(self.namespaces, self.links, self.addresses, strict=True):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", link, "up")

    def start(self, host: int, args: list[str], log: Path, **env) -> subprocess.Popen:
        """`args` started in host `host` from the repository's root, its output to `log`, in a process group of its
        own; gloo is told the host's link (GLOO_SOCKET_IFNAME) unless `env` sets it to None."""
        env = {k: v for k, v in {"GLOO_SOCKET_IFNAME": self.links[host], **env}.items() if v is not None}
        with open(log, "w") as sink:
            process = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *args], cwd=ROOT,
                                       env=script_env(**env), stdout=sink, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.processes.append(process)
        return process

    def cut(self) -> None:
        _ip("-n", self.namespaces[0], "link", "set", self.links[0], "down")

    def restore(self) -> None:
        _ip("-n", self.namespaces[0], "link", "set", self.links[0], "up")

    def received_bytes(self, host: int) -> int:
        """What host `host`'s end of the link has received so far."""
        (link,) = json.loads(_ip("-n", self.namespaces[host], "-s", "-j", "link", "show", "dev", self.links[host]))
        return link["stats64"]["rx"]["bytes"]

    def kill(self, process: subprocess.Popen) -> None:
        """`process` and its process group, killed and reaped."""
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()

    def remove(self) -> None:
        """Every process started here killed (with any other left in the namespaces), then the namespaces deleted
        (which deletes the veth pair with them)."""
        for process in self.processes:
            self.kill(process)
        for name in self.made:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        self.made = []
