"""Process-group setup for every launcher (deepspeed, torchrun, accelerate launch, plain python), and rank-0 logging."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.constants import CROSS_RANK

# What a launcher (or init_distributed for a plain start) exports; a child process that should start its own
# process group must not inherit them.
DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortInUse(Exception):
    """The rendezvous port is taken by another program: nothing of this run was lost, it needs another port."""


# torch's words for a port another socket holds: its libuv store's, then its socket store's (errno 98)
_ADDRESS_IN_USE = ("EADDRINUSE", "Address already in use")


def init_distributed(timeout_s: float | None = None) -> None:
    """Join the launcher's process group; a plain `python` start becomes a world of one.

    Launchers export RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK; without them we set a
    single-process world ourselves rather than let DeepSpeed try MPI discovery. A world of one (a plain start, or
    any launcher's single process) rendezvouses in-process and binds no port; under torchrun's agent each restart
    round takes a store prefix of its own (`restart_round_store`). CUDA uses NCCL; CPU uses gloo.
    `timeout_s` bounds every collective: a process whose peer hangs (alive, but no longer taking part) gets the
    backend's error after this long instead of waiting forever (None: DeepSpeed's default, $DEEPSPEED_TIMEOUT
    minutes or 10). A peer that died is noticed sooner: its closed connection fails the next collective. A
    rendezvous port that another program holds raises PortInUse, which names the launcher's way to pick another.
    """
    if dist.is_initialized():
        return
    use_this_environments_ninja()
    arch_list_deepspeed_can_read()
    choice = port_choice(os.environ)  # before a plain start exports a launcher's variables itself
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    problem = gloo_address_problem(os.environ) if backend == "gloo" else None
    if problem:
        raise UnreachableAddress(problem)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    try:
        if os.environ.get("WORLD_SIZE") == "1":
            # A world of one needs no rendezvous: an in-process store, so no port is bound or dialled (a MASTER_PORT
            # another job holds cannot stop it, and two single-process runs never collide).
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **timeout)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = restart_round_store(timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S))
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), **timeout)
        # DeepSpeed's communication backend wraps the group made above, or makes it from the launcher's variables
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, **timeout)
        _release_shared_memory_name()
    except dist.DistNetworkError as error:
        # Rank 0 hosts the rendezvous store on MASTER_PORT. torchrun's agent hosts it itself (static rendezvous,
        # TORCHELASTIC_USE_AGENT_STORE), and so does accelerate's multi-process launch, which runs torchrun (and on
        # one machine moves to a free port first): there a busy port fails in the launcher, before we start.
        if not any(marker in str(error) for marker in _ADDRESS_IN_USE):
            raise
        raise PortInUse(f"the rendezvous port {os.environ['MASTER_PORT']} is in use (another run on this machine?); "
                        f"pick another with {choice}") from None


# DeepSpeed's CPU communication backend (deepspeed/comm/torch.py, its shm op) gives each process a 66 MB POSIX
# shared-memory segment for a low-latency allreduce when all of a world's processes are on one machine (a launcher's
# LOCAL_SIZE, which deepspeed's exports, equals the world size), named after the user, the rendezvous address and
# port, and the rank. Nothing of DeepSpeed's ever removes the name: every such run, finished or killed, left 66 MB
# of memory per process in /dev/shm until the machine restarted.
SHARED_MEMORY_SEGMENT = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{address}_{port}_{rank}"


def _release_shared_memory_name() -> None:
    """Remove this process's name for its allreduce segment, once every process has mapped every segment (the
    backend maps its peers' before its set-up returns; a barrier waits for all of them): the mappings stay valid
    while the processes live, and the memory returns to the machine when the last of them ends, however it ends."""
    if os.environ.get("LOCAL_SIZE") != str(dist.get_world_size()):
        return  # DeepSpeed's own condition for the segments (shm_interface.cpp), the same on every rank
    backend = getattr(deepspeed.comm.comm, "cdb", None)
    if getattr(backend, "shm_comm_op", None) is None:
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    path = SHARED_MEMORY_SEGMENT.format(uid=os.getuid(), address=os.environ.get("MASTER_ADDR", ""),
                                        port=os.environ.get("MASTER_PORT", ""), rank=dist.get_rank())
    try:
        os.unlink(path)
    except FileNotFoundError:  # not created: a world spread over machines, or a platform without /dev/shm
        pass


class UnreachableAddress(Exception):
    """gloo would give the other machines an address of this one that they cannot reach: the run could only fail,
    so it stops before it joins, with the setting that fixes it."""


def gloo_address_problem(environ: Mapping[str, str], hostname: str | None = None) -> str | None:
    """Why gloo's connections between machines cannot work, in one sentence, or None.

    Without GLOO_SOCKET_IFNAME gloo listens on the first address of this host's name that it can bind, or on the
    loopback address where there is none (torch's GlooDeviceFactory), and gives it to every other process. Many
    hosts name themselves with a loopback address (Debian's /etc/hosts: 127.0.1.1, a container's: 127.0.0.1): the
    other machines would dial their own loopback, and gloo's connection set-up would fail with words that blame a
    lost process (and a stop line that advises a rerun, which cannot help). Only a world that spans machines (a
    launcher's local process count below the world size) at a rendezvous address that is not loopback is judged: at
    a loopback MASTER_ADDR every process runs on this machine, which loopback reaches.
    """
    world = int(environ.get("WORLD_SIZE", "1"))
    local = environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE")  # torchrun's, deepspeed's launcher's
    if "GLOO_SOCKET_IFNAME" in environ or not (local or "").isdigit() or int(local) >= world:
        return None
    if _resolves_to_loopback(environ.get("MASTER_ADDR", "")) is not False:
        return None
    hostname = hostname or socket.gethostname()
    address = _bindable_address(hostname)
    if address is not None and not ipaddress.ip_address(address).is_loopback:
        return None
    why = (f"this host's name {hostname!r} resolves to {address}" if address else
           f"this host's name {hostname!r} resolves to no address of this host, so gloo falls back to 127.0.0.1")
    return (f"the run spans {world // int(local)} machines, but gloo would listen on loopback ({why}), which the "
            "other machines cannot reach; set GLOO_SOCKET_IFNAME on every machine to its network interface that "
            "reaches the others (`ip -brief address` lists them)")


def _resolves_to_loopback(host: str) -> bool | None:
    """Whether every address of `host` is a loopback one; None where it does not resolve (torch will say so)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _bindable_address(hostname: str) -> str | None:
    """The first address of `hostname` that a socket on this machine can bind, as gloo picks it; None if none."""
    try:
        infos = socket.getaddrinfo(hostname, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(address)
            return address[0].split("%")[0]
        except OSError:
            continue
    return None


DEFAULT_TIMEOUT_S = 1800  # the rendezvous's bound when the run gives none (gloo's default collective timeout)
_ROUND = "adaptive_ds/round"  # the agent store's keys of the handshake below


def restart_round_store(timeout: timedelta, poll_s: float = 0.05) -> dist.Store:
    """The store of this restart round of torchrun's agent: its TCPStore under a prefix that only this round's
    processes share.

    torchrun's agent hosts one TCPStore for the whole job (static rendezvous, and the c10d one since torch 2.4,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset) and its workers connect to it without a prefix, on the assumption
    that every restart round gets a new store (torch/distributed/rendezvous.py, `_create_c10d_store`; pytorch
    issue 135712). It does not: after a restart the keys of the dead round are still there, so gloo's rendezvous
    (`connectFullMesh`) and the groups DeepSpeed makes at `deepspeed.initialize` can read a dead process's address
    and dial it until they time out. TORCHELASTIC_RESTART_COUNT cannot name the round either: each agent counts
    its own restarts, and on several nodes an agent whose workers were healthy restarts them without counting.

    So the round agrees on a fresh prefix through the agent's store. Every process of the previous round is gone
    before this one starts (the agents stop their workers before the next rendezvous), and only live processes
    write. Rank 0 deletes the ranks' hello keys, then answers each hello it finds with a new round token; every
    other rank writes its hello (a nonce of its own, written again until answered, in case rank 0's delete came
    after it) and reads the token under that nonce, which no earlier round can have answered.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        token = uuid.uuid4().hex
        for peer in range(1, world):
            base.delete_key(f"{_ROUND}/hello/{peer}")
        waiting = set(range(1, world))
        while waiting:
            for peer in sorted(waiting):
                if base.check([f"{_ROUND}/hello/{peer}"]):
                    nonce = base.get(f"{_ROUND}/hello/{peer}").decode()
                    base.set(f"{_ROUND}/answer/{nonce}", token)
                    waiting.discard(peer)
            if waiting:
                _pause(deadline, poll_s, f"ranks {sorted(waiting)} of this restart round")
    else:
        nonce = uuid.uuid4().hex
        while not base.check([f"{_ROUND}/answer/{nonce}"]):
            base.set(f"{_ROUND}/hello/{rank}", nonce)
            _pause(deadline, poll_s * 4, "rank 0 of this restart round")
        token = base.get(f"{_ROUND}/answer/{nonce}").decode()
    return dist.PrefixStore(f"{_ROUND}/{token}/", base)


def job_store() -> dist.Store | None:
    """The store of torchrun's agent, which lives as long as the torchrun job (all its restart rounds), or None
    where no agent hosts one (another launcher, a plain start)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))


def restart_counts(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """How often a launcher started this run's processes again: torchrun's agent after a failed process
    (`restarts`: TORCHELASTIC_RESTART_COUNT, as this node's agent counts them) and Slurm after a requeue
    (`requeues`: SLURM_RESTART_COUNT). Only the launchers that started the run have a field."""
    counts = {}
    for name, variable in (("restarts", "TORCHELASTIC_RESTART_COUNT"), ("requeues", "SLURM_RESTART_COUNT")):
        if environ.get(variable, "").isdigit():
            counts[name] = int(environ[variable])
    return counts


def _pause(deadline: float, pause_s: float, whom: str) -> None:
    """Sleep `pause_s` before asking the store again, or raise once `deadline` has passed."""
    if time.monotonic() > deadline:
        raise dist.DistStoreError(f"no answer from {whom} within the collective timeout")
    time.sleep(pause_s)


def port_choice(environ: Mapping[str, str]) -> str:
    """Where the user picks another rendezvous port, judged from the variables the launcher exported.

    deepspeed's launcher (deepspeed/launcher/launch.py) exports CROSS_RANK, torchrun's agent TORCHELASTIC_RUN_ID, and
    every `accelerate launch` ACCELERATE_MIXED_PRECISION (it then starts torchrun, or deepspeed's launcher across
    machines, with its --main_process_port). Without RANK nothing launched us: a world of one, which binds no port
    (so is `accelerate launch` of one process, which starts plain python).
    """
    if "RANK" not in environ:
        return "the MASTER_PORT environment variable"
    if "ACCELERATE_MIXED_PRECISION" in environ:
        return "accelerate launch's --main_process_port"
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun's --master_port"
    if CROSS_RANK in environ:
        return "deepspeed's --master_port"
    return "the MASTER_PORT your launcher exports"


def use_this_environments_ninja() -> None:
    """Put this interpreter's bin directory first on PATH when it holds `ninja` (pip's, a DeepSpeed dependency).

    DeepSpeed JIT-builds its ops (the shared-memory collectives, here at `init_distributed`) with the first ninja on
    PATH, and a system ninja records a build differently from pip's: processes of one project that find different
    ones (a shell with the virtualenv activated, one without, a launcher's children) rebuild the op each time, a
    compile at every start. Every process of ours takes the environment's own.
    """
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if os.path.exists(os.path.join(bin_dir, "ninja")) and path[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *path])


def arch_list_deepspeed_can_read() -> None:
    """Rewrite TORCH_CUDA_ARCH_LIST's arch-specific entries ("9.0a", "10.0f") to their plain compute capability.

    torch reads these suffixes (the Hopper and Blackwell features of `sm_90a`, `sm_100f`), and CUDA images set them,
    but DeepSpeed's JIT builder reads each entry as numbers and stops with "invalid literal for int()" while building
    FusedAdam, the optimizer of every CUDA config that names Adam. Its kernels use none of those features, so the
    plain capability builds the same op. Entries DeepSpeed reads ("8.0", "9.0+PTX") stay as they are.
    """
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return
    entries = [entry for entry in value.replace(" ", ";").split(";") if entry]
    readable = list(dict.fromkeys(re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", entry) for entry in entries))
    if readable != entries:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(readable)
        logging.getLogger(__name__).warning(
            "TORCH_CUDA_ARCH_LIST %r taken as %r: DeepSpeed's op builder reads no arch-specific suffix", value,
            os.environ["TORCH_CUDA_ARCH_LIST"])


def bound_collectives(timeout_s: float) -> None:
    """Give every process group that exists now the run's collective timeout.

    DeepSpeed makes its own groups (ZeRO's data-parallel clone of the world, MoE's expert groups), which torch
    creates with its default timeout (30 minutes for gloo, 10 for NCCL) whatever the world group has; call this
    after `deepspeed.initialize`. (torch's setter is private; torchtitan uses it the same way.)
    """
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)


def close() -> None:
    """Leave the process group together: without it a rank can abort at exit while its peer still tears down."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_object(obj) -> list | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


# What gloo's transport says when a peer died or stopped answering (it raises a plain RuntimeError); NCCL and
# the rendezvous store raise torch.distributed.DistError subclasses.
_GLOO_PEER_LOST = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "pair closure")


def lost_contact(error: BaseException) -> bool:
    """Whether `error` is the backend reporting a process of the run that died or timed out."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in _GLOO_PEER_LOST)


def describe_lost_contact(error: BaseException) -> str:
    """The backend's message in a few words: without its source location and its advice paragraph."""
    text = re.sub(r"^\[[^\]]*\] ", "", " ".join(str(error).split()))
    return text.split(". This is typically")[0][:200]


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return rank() == 0 or record.levelno >= logging.WARNING


def setup_logging(level: int = logging.INFO) -> None:
    """The one place logging is configured: rank 0 logs INFO, other ranks only warnings and errors."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankZeroFilter())
    root = logging.getLogger("adaptive_ds")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
