"""A run that has to stop ends with its one line: when SIGTERM and a data loader worker's death race each other
during a launcher's teardown, and when the rendezvous port is taken by something else on the machine."""

import socket
import sys

import pytest
from conftest import run_command, write_ds_config

from adaptive_ds.distributed import port_choice

SIGTERM_LINE = ("error: stopped by SIGTERM (a launcher stops every process when one fails{}) before training began; "
                "rerun the same command to start again (no checkpoint was saved yet)")


@pytest.mark.parametrize("order, line", [
    ("sigterm_first", SIGTERM_LINE.format("")),
    ("worker_first", SIGTERM_LINE.format("; a data loader worker got it first")),
])
def test_sigterm_and_a_dead_loader_worker_together_end_with_one_line(order, line):
    """tests/helpers/stop_race.py holds both signals back and releases them in a fixed order, so each order of the
    race is run for real every time: the run's line, alone on stderr, never a traceback or nothing."""
    result = run_command([sys.executable, "tests/helpers/stop_race.py", order], timeout=120)
    assert result.returncode != 0
    assert result.stderr.splitlines() == [line], result.stderr[-3000:]


def _held_port() -> socket.socket:
    """A listening socket on a free port, as another run's rendezvous store would be."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "python"])
def test_a_busy_rendezvous_port_is_reported_with_the_flag_that_picks_another(launcher, tmp_path):
    out = tmp_path / "run"
    args = ["launchers/train.py", "--ds_config", write_ds_config(tmp_path), "--output_dir", str(out)]
    with _held_port() as holder:
        port = holder.getsockname()[1]
        if launcher == "deepspeed":
            result = run_command(["deepspeed", "--master_port", str(port), "--num_gpus", "1", *args], timeout=300)
            choice = "deepspeed's --master_port"
        else:
            result = run_command([sys.executable, *args], timeout=300, MASTER_PORT=str(port))
            choice = "the MASTER_PORT environment variable"
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: the rendezvous port {port} is in use (another run on this machine?); pick another "
                     f"with {choice}"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "lost contact" not in result.stderr
    assert not out.exists()


# The variables each launcher exports to the processes it starts (deepspeed/launcher/launch.py,
# torch/distributed/elastic/agent/server/local_elastic_agent.py, accelerate/utils/launch.py), and the one line's
# advice for each.
WORLD = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
TORCHRUN = {**WORLD, "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "GROUP_RANK": "0"}


@pytest.mark.parametrize("environ, choice", [
    ({**WORLD, "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "2"}, "deepspeed's --master_port"),
    (TORCHRUN, "torchrun's --master_port"),
    ({**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_DEEPSPEED": "true"},
     "accelerate launch's --main_process_port"),
    # accelerate launch with one process starts plain python: init_distributed takes MASTER_PORT, as for a plain start
    ({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False"}, "the MASTER_PORT environment variable"),
    ({"MASTER_PORT": "29500"}, "the MASTER_PORT environment variable"),
    ({}, "the MASTER_PORT environment variable"),
    (WORLD, "the MASTER_PORT your launcher exports"),
])
def test_the_port_advice_follows_the_launcher(environ, choice):
    assert port_choice(environ) == choice
