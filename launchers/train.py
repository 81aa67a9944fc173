"""Train an adaptive_ds model through the DeepSpeed engine.

    deepspeed launchers/train.py --ds_config ds_configs/debug_cpu.json [--arch moe] [--max_steps N]
    torchrun --nproc_per_node 2 launchers/train.py --ds_config ...
    accelerate launch --use_deepspeed --num_processes 2 launchers/train.py --ds_config ...
    python launchers/train.py --ds_config ...
"""

import sys

from adaptive_ds import distributed
from adaptive_ds.training import ConfigError, train
from adaptive_ds.training.checkpoint import CheckpointError
from adaptive_ds.training.controller import TrainingStopped

if __name__ == "__main__":
    try:
        train(sys.argv[1:])
        distributed.close()
    except (ConfigError, CheckpointError, TrainingStopped) as error:
        sys.exit(f"error: {error}")
