"""The stop line's advice for a busy rendezvous port names the option of the launcher that started the run."""


import pytest

from adaptive_ds.distributed import port_choice

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
