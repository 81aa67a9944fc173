"""A run that has to stop ends with its one line: when SIGTERM and a data loader worker's death race each other
during a launcher's teardown, when SIGTERM cuts an import short, and when the rendezvous port is taken by something
else on the machine."""

import socket
import sys

import pytest

SIGTERM_LINE = ("error: stopped by SIGTERM (a launcher stops every process when one fails{}) before training began; "
                "rerun the same command to start again (no checkpoint was saved yet)")


@pytest.mark.parametrize("order, line", [
    ("sigterm_first", SIGTERM_LINE.format("")),
    ("worker_first", SIGTERM_LINE.format("; a data loader worker got it first")),
])
def test_sigterm_and_a_dead_loader_worker_together_end_with_one_line(order, line, run_command):
    """tests/helpers/stop_race.py holds both signals back and releases them in a fixed order, so each order of the
    race is run for real every time: the run's line, alone on stderr, never a traceback or nothing."""
    result = run_command([sys.executable, "tests/helpers/stop_race.py", order], timeout=120)
    assert result.returncode != 0
    assert result.stderr.splitlines() == [line], result.stderr[-3000:]


def test_sigterm_while_the_libraries_load_ends_with_one_line(tmp_path, run_command, tiny_ds_config):
    """A launcher stops every process when one fails early, so a peer can get SIGTERM in the middle of an import
    (tests/helpers/sigterm_in_import.py cuts sympy's short, as torch's symbolic shapes load it for transformers).
    Choosing the line must not import anything more: the half-initialised package would fail the import, and a
    traceback would take the line's place."""
    args = ["--ds_config", tiny_ds_config(), "--output_dir", str(tmp_path / "run")]
    result = run_command([sys.executable, "tests/helpers/sigterm_in_import.py", "sympy.printing", *args], timeout=120)
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if "[WARNING]" not in line] == [SIGTERM_LINE.format("")], \
        result.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_sigterm_whose_exception_a_del_swallowed_still_stops_the_run(tmp_path, run_command, tiny_ds_config):
    """Python runs a signal's handler wherever the process is; inside a __del__ (or a weakref callback) the exception
    it raises is printed and lost. The run still stops: during the imports with its line, before anything trains;
    while it builds its engine, at its first step boundary, saved (the loop takes the signal up), as a stop request
    does. Without the record of it, the run trained to its end and exited 0, its handler gone."""
    config = tiny_ds_config(max_steps=3)
    early = tmp_path / "early"
    result = run_command([sys.executable, "tests/helpers/sigterm_in_import.py", "--in-del", "sympy.printing",
                          "--ds_config", config, "--output_dir", str(early)], timeout=120)
    assert result.returncode == 1 and result.stderr.splitlines()[-1] == SIGTERM_LINE.format(""), \
        result.stderr[-3000:]
    assert "Exception ignored" in result.stderr and not early.exists()
    late = tmp_path / "late"
    result = run_command([sys.executable, "tests/helpers/sigterm_in_import.py", "--in-del", "deepspeed.initialize",
                          "--ds_config", config, "--output_dir", str(late)], timeout=120)
    assert result.returncode == 128 + 15, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == ("stopped by SIGTERM at step 1, saved; rerun the same command to "
                                              "resume from step 1")
    assert (late / "checkpoints" / "latest").read_text() == "step00000001" and not (late / "summary.json").exists()


def _held_port() -> socket.socket:
    """A listening socket on a free port, as another run's rendezvous store would be."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "python"])
def test_a_busy_rendezvous_port_is_reported_with_the_flag_that_picks_another(launcher, tmp_path, run_command,
                                                                             tiny_ds_config):
    """Two processes: rank 0 hosts the rendezvous store on the port (a plain start of rank 0 by hand, as a user's
    own launcher would; or deepspeed's launcher). The line comes before anything is trained, not after a timeout."""
    out = tmp_path / "run"
    args = ["launchers/train.py", "--ds_config", tiny_ds_config(), "--output_dir", str(out)]
    with _held_port() as holder:
        port = holder.getsockname()[1]
        if launcher == "deepspeed":
            result = run_command(["deepspeed", "--master_port", str(port), "--num_gpus", "2", *args], timeout=120)
            choice = "deepspeed's --master_port"
        else:
            result = run_command([sys.executable, *args], timeout=120, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            choice = "the MASTER_PORT your launcher exports"
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    # The cause comes first. Under deepspeed's launcher the other rank, waiting on the held port, is then stopped by
    # the launcher, and may end with the line that says so (whether it got that far before the SIGTERM depends on
    # the machine's load): a consequence, never a second cause.
    assert lines[:1] == [f"error: the rendezvous port {port} is in use (another run on this machine?); pick another "
                         f"with {choice}"], result.stderr[-3000:]
    assert lines[1:] in ([], [SIGTERM_LINE.format("")] if launcher == "deepspeed" else []), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "lost contact" not in result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_single_process_run_needs_no_port(tmp_path, run_command, tiny_ds_config):
    """A world of one binds and dials no port: the MASTER_PORT another job holds does not stop it (it hung for
    minutes, then stopped, when a plain start took MASTER_PORT from the environment). One process of a launcher
    takes the same path (a world size of 1)."""
    out = tmp_path / "run"
    args = ["launchers/train.py", "--ds_config", tiny_ds_config(max_steps=1), "--output_dir", str(out)]
    with _held_port() as holder:
        result = run_command([sys.executable, *args], timeout=300, MASTER_PORT=str(holder.getsockname()[1]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "summary.json").exists()
