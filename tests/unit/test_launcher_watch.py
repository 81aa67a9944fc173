"""Which ancestors of a training process are its launchers (the processes whose end stops the run)."""

import pytest

from adaptive_ds.training.launcher_watch import is_launcher

PY = "/venv/bin/python"


@pytest.mark.parametrize("cmdline", [
    [PY, "/venv/bin/deepspeed", "--num_gpus", "2", "launchers/train.py"],  # the runner the user starts
    [PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--master_addr=127.0.0.1"],  # its child
    [PY, "/venv/bin/torchrun", "--nproc_per_node", "2", "launchers/train.py"],
    [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"],
    [PY, "/venv/bin/accelerate", "launch", "--num_processes", "2", "train.py"],
    ["/venv/bin/torchrun", "--standalone", "train.py"],  # a console script started directly
    [PY, "-W", "ignore", "-X", "faulthandler", "/venv/bin/deepspeed", "train.py"],  # interpreter options and values
])
def test_launchers_are_recognised(cmdline):
    assert is_launcher(cmdline)


@pytest.mark.parametrize("cmdline", [
    [PY, "-u", "launchers/train.py", "--local_rank=0"],  # a worker
    [PY, "launchers/train.py", "--ds_config", "ds_configs/deepspeed.json"],  # a flag's value is no launcher
    [PY, "-W", "torchrun", "train.py"],  # an interpreter option's value is no launcher
    ["bash", "-c", "torchrun train.py"],  # a shell that started one
    ["/usr/bin/srun", "torchrun", "train.py"],  # Slurm's own launcher stops its steps itself
    ["slurmstepd: [12.0]"],
    [PY],
    [],
])
def test_other_processes_are_not_launchers(cmdline):
    assert not is_launcher(cmdline)
