"""Train as launchers/train.py does, and write what the engine holds right after a checkpoint is saved and right
after one is loaded, so a test can compare the two across a change of process count or expert parallelism.

    [torchrun --nproc_per_node N] tests/helpers/train_and_dump.py DUMP_DIR TRAIN_ARGUMENTS...

or in a test's own process, `with dumping(DUMP_DIR): train(TRAIN_ARGUMENTS)`.

Each rank writes DUMP_DIR/{saved,loaded}_step<N>_rank<R>.pt: {"params": {global name: {"weight" (the module's),
"fp32", "exp_avg", "exp_avg_sq" (ZeRO's), "step", "group" (lr, betas, ...)}}, "engine": {"global_steps",
"scheduler"}}. Tensors are whole (gathered over the ZeRO partitions);
an expert is named by its global number (a rank holds experts ep_rank * num_local ... + num_local - 1, numbered
from 0 locally), so dumps from different layouts name the same parameter the same way.
"""

import contextlib
import os
import re
import sys

import torch
from deepspeed.utils import (
    groups,
    lazy_init_hp_params_optimizer_state,
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
)

from adaptive_ds import distributed
from adaptive_ds.training import train
from adaptive_ds.training.checkpoint import manager

EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")


def _global_name(name: str, param, num_experts: int) -> str:
    match = EXPERT.match(name)
    if not match:
        return name
    ep_size = groups._get_expert_parallel_world_size(param.group_name)
    number = groups._get_expert_parallel_rank(param.group_name) * (num_experts // ep_size) + int(match.group(2))
    return f"{match.group(1)}{number}{match.group(3)}"


def _state(engine) -> dict:
    """Collective: every rank walks the same groups in the same order (the gathers reduce over each group)."""
    zero = engine.optimizer
    params = {}
    for lp_group, flat, group in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups,
                                     zero.optimizer.param_groups, strict=True):
        # ZeRO links the moments to each parameter once, after the first group's first step, when later groups
        # have no state yet (so safe_get_full_optimizer_state finds none for them): link them to the state now
        lazy_init_hp_params_optimizer_state(lp_group, flat, zero.optimizer.state)
        step = zero.optimizer.state[group["params"][0]]["step"]
        hyper = {k: v for k, v in group.items() if k not in ("params", "name")}
        for lp in lp_group:
            name = _global_name(zero.param_names[lp], lp, engine.module.config.num_local_experts)
            params[name] = {"weight": lp.detach().float().clone(), "fp32": safe_get_full_fp32_param(lp).clone(),
                            "exp_avg": safe_get_full_optimizer_state(lp, "exp_avg").clone(),
                            "exp_avg_sq": safe_get_full_optimizer_state(lp, "exp_avg_sq").clone(),
                            "step": float(step), "group": hyper}
    scheduler = {k: v for k, v in engine.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
    return {"params": params, "engine": {"global_steps": engine.global_steps, "scheduler": scheduler}}


def _dump(engine, dump_dir: str, event: str) -> None:
    state = _state(engine)
    os.makedirs(dump_dir, exist_ok=True)
    torch.save(state, os.path.join(dump_dir, f"{event}_rank{distributed.rank()}.pt"))


@contextlib.contextmanager
def dumping(dump_dir: str):
    """Within it, every checkpoint the Checkpointer saves or loads (in this process) is dumped to `dump_dir`."""
    save, load = manager.save, manager.load

    def save_and_dump(engine, output_dir, step, *args, **kwargs):
        tag = save(engine, output_dir, step, *args, **kwargs)
        _dump(engine, dump_dir, f"saved_step{step}")
        return tag

    def load_and_dump(engine, *args, **kwargs):
        run_state = load(engine, *args, **kwargs)
        _dump(engine, dump_dir, f"loaded_step{run_state['step']}")
        return run_state

    manager.save, manager.load = save_and_dump, load_and_dump  # what the Checkpointer calls
    try:
        yield
    finally:
        manager.save, manager.load = save, load


def main() -> None:
    dump_dir, argv = sys.argv[1], sys.argv[2:]
    with dumping(dump_dir):
        train(argv)
    distributed.close()


if __name__ == "__main__":
    main()
