"""Train an adaptive_ds model through the DeepSpeed engine.

    deepspeed launchers/train.py --ds_config ds_configs/debug_cpu.json [--arch moe] [--max_steps N]
    torchrun --nproc_per_node 2 launchers/train.py --ds_config ...
    accelerate launch --use_deepspeed --num_processes 2 launchers/train.py --ds_config ...
    python launchers/train.py --ds_config ...    (the same as python -m adaptive_ds.training --ds_config ...)
"""

from adaptive_ds.training.__main__ import main

if __name__ == "__main__":
    main()
