"""MoE checkpoints in DeepSpeed's universal format, so an MoE (or hybrid) run resumes on another number of processes
or another expert-parallel size.

DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`) joins each parameter's ZeRO fragments by name. An
MoE rank names its experts by their local number (`...deepspeed_experts.0...` is expert 0 on ep rank 0 and expert
4 on ep rank 1 of 8 experts over 2), so the converter cannot tell the experts of different ranks apart. Here the
ZeRO-1/2 optimizer files are read directly: every parameter's fp32 master weight and optimizer moments are joined
from the fragments of its own partition group (all ranks for the rest of the model; the expert-data-parallel
group of its ep rank for an expert), each expert by its global number. The result is the layout DeepSpeed's own
loader reads with `"checkpoint": {"load_universal": true}`:

    zero/<parameter name>/{fp32,exp_avg,exp_avg_sq,step}.pt   whole tensors ({"param": tensor, ...})
    zero/optimizer_state.pt                                   loss scaler, clipping, param groups (lr, betas, ...)
    mp_rank_00_model_states.pt                                scheduler, step counts, the run's client state

An expert's folder is written for the target expert-parallel size `ep_size`: the folder of local expert slot j
holds, stacked on a new leading dimension, the tensors of the expert that slot is on each target ep rank (global
experts j, num_local + j, ...), marked as an expert parameter with `ep_size` rows, and DeepSpeed's loader takes
the row of its own ep rank (`EP_IS_EXPERT_PARAM` / `EP_NUM_EXPERTS`, deepspeed.checkpoint.universal_checkpoint).
Memory: the optimizer files are memory-mapped and one parameter is assembled at a time.
"""

from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import pickle
import re
import shutil
import zipfile

import torch
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    CAT_DIM,
    EP_IS_EXPERT_PARAM,
    EP_NUM_EXPERTS,
    FP32_WEIGHT_KEY,
    OPTIMIZER_STATE_DICT,
    PARAM,
    PARAM_GROUPS,
    PARAM_SLICE_MAPPINGS,
    PARTITION_COUNT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    ZERO_STAGE,
)

from ... import distributed
from .storage import CheckpointError, checkpoint_root

logger = logging.getLogger(__name__)

MODEL_STATES = "mp_rank_00_model_states.pt"
EXPERT = re.compile(r"(?P<prefix>.*\.deepspeed_experts\.)(?P<number>\d+)(?P<suffix>\..*)")
OPTIMIZER_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")


def has_experts(checkpoint_dir: str) -> bool:
    """Whether `checkpoint_dir` is an MoE checkpoint (DeepSpeed writes one file per expert)."""
    return bool(glob.glob(os.path.join(checkpoint_dir, "layer_*_expert_*_model_states.pt")))


def convert_moe_checkpoint(checkpoint_dir: str, output_dir: str, ep_size: int) -> None:
    """Write `checkpoint_dir` (an MoE ZeRO-1/2 checkpoint) to `output_dir` in DeepSpeed's universal format, its
    experts laid out for expert-parallel size `ep_size`. Raises ValueError for a checkpoint it cannot convert."""
    shards = ZeroShards(checkpoint_dir)
    model_states = load(os.path.join(checkpoint_dir, MODEL_STATES))
    shapes = {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}
    data_before_expert = bool(model_states["ds_config"].get("use_data_before_expert_parallelism", False))
    os.makedirs(os.path.join(output_dir, "zero"))
    for group in range(shards.num_groups):
        if shards.is_expert_group(group):
            _write_experts(shards, group, shapes, ep_size, data_before_expert, output_dir)
        else:
            for name in shards.names(group):
                _write_param(output_dir, name, shards.whole(group, range(shards.world), name, shapes[name]),
                             shards.step(group))
    torch.save(shards.common_state(ep_size), os.path.join(output_dir, "zero", "optimizer_state.pt"))
    shutil.copy2(os.path.join(checkpoint_dir, MODEL_STATES), output_dir)
    logger.info("MoE checkpoint %s: %d processes with ep_size %d, written for ep_size %d", checkpoint_dir,
                shards.world, shards.ep_size, ep_size)


def load(path: str, mmap: bool = False) -> dict:
    """A checkpoint file's contents, on the CPU; ValueError naming the file when it is not a readable torch file."""
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path!r} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})") from None


class ZeroShards:
    """The ZeRO-1/2 optimizer files of one checkpoint, one per data-parallel rank, memory-mapped."""

    def __init__(self, checkpoint_dir: str):
        files = {}
        for path in glob.glob(os.path.join(checkpoint_dir, "*_optim_states.pt")):
            match = OPTIMIZER_FILE.fullmatch(os.path.basename(path))
            if match:
                files[int(match.group(1))] = path
        if not files:
            raise ValueError(f"{checkpoint_dir!r} has no ZeRO optimizer files (zero_pp_rank_*_optim_states.pt): an "
                             "MoE checkpoint is read only from ZeRO stage 1 or 2")
        if sorted(files) != list(range(len(files))):
            raise ValueError(f"{checkpoint_dir!r} lacks some ranks' optimizer files (found ranks {sorted(files)})")
        self.world = len(files)
        self.states = [load(files[rank], mmap=True)[OPTIMIZER_STATE_DICT] for rank in range(self.world)]
        stage = self.states[0].get(ZERO_STAGE)
        if stage not in (1, 2):  # the ZeRO-1/2 optimizer's layout: flat fp32 partitions and their slice mappings
            raise ValueError(f"{checkpoint_dir!r} was written with ZeRO stage {stage}: an MoE checkpoint is read "
                             "only from ZeRO stage 1 or 2")
        self.param_groups = self.states[0][BASE_OPTIMIZER_STATE][PARAM_GROUPS]
        self.num_groups = len(self.param_groups)
        expert_counts = {self.states[0][PARTITION_COUNT][g] for g in range(self.num_groups) if self.is_expert_group(g)}
        if len(expert_counts) != 1:
            raise ValueError(f"expected one expert-data-parallel size, found {sorted(expert_counts)}")
        self.ep_size = self.world // expert_counts.pop()  # experts are partitioned over world / ep_size ranks

    def is_expert_group(self, group: int) -> bool:
        return bool(self.param_groups[group].get("moe"))

    def names(self, group: int) -> list[str]:
        """The group's parameter names, in the order of the flat buffer (as rank 0 names them)."""
        seen = {}
        for state in self.states:
            seen.update(dict.fromkeys(state[PARAM_SLICE_MAPPINGS][group]))
        return list(seen)

    def step(self, group: int):
        return self.states[0][BASE_OPTIMIZER_STATE]["state"][group].get("step")

    def whole(self, group: int, ranks, name: str, shape, weight_only: bool = False) -> dict[str, torch.Tensor]:
        """Parameter `name`'s fp32 weight and moments (only the weight, `weight_only`), joined from the fragments
        that `ranks` (its partition group, in partition order) hold: partition k holds a contiguous piece of the
        group's flat buffer."""
        pieces: dict[str, list[torch.Tensor]] = {}
        for rank in ranks:
            state = self.states[rank]
            fragment = state[PARAM_SLICE_MAPPINGS][group].get(name)
            if fragment is None:
                continue
            flat = {FP32_WEIGHT_KEY: state[SINGLE_PARTITION_OF_FP32_GROUPS][group]}
            if not weight_only:
                flat.update({key: value for key, value in state[BASE_OPTIMIZER_STATE]["state"][group].items()
                             if key != "step" and torch.is_tensor(value) and value.dim() == 1})
            for key, tensor in flat.items():
                pieces.setdefault(key, []).append(tensor.narrow(0, fragment.start, fragment.numel))
        if sum(part.numel() for part in pieces.get(FP32_WEIGHT_KEY, [])) != math.prod(shape):
            raise ValueError(f"the optimizer files do not hold all of {name} {tuple(shape)}")
        return {key: torch.cat(parts).view(shape) for key, parts in pieces.items()}

    def expert_slots(self, group: int) -> dict[tuple[str, str], int]:
        """Expert group `group`'s parameters as {(prefix, suffix): number of local experts}: every ep rank names
        its experts `<prefix><0..n-1><suffix>`, and global expert `ep_rank * n + local` is the model's."""
        slots: dict[tuple[str, str], set[int]] = {}
        for name in self.names(group):
            match = EXPERT.fullmatch(name)
            if match is None:
                raise ValueError(f"{name} is in an expert param group but is not named like a DeepSpeed expert")
            slots.setdefault((match["prefix"], match["suffix"]), set()).add(int(match["number"]))
        for (prefix, suffix), numbers in slots.items():
            if numbers != set(range(len(numbers))):
                raise ValueError(f"{prefix}*{suffix}: local experts {sorted(numbers)} are not numbered from 0")
        return {key: len(numbers) for key, numbers in slots.items()}

    def expert_source(self, number: int, num_local: int, data_before_expert: bool) -> tuple[range, int]:
        """Where global expert `number` (of `num_local` per ep rank) is: the ranks that partition its weights, in
        partition order, and its local number there."""
        ep_rank, local = divmod(number, num_local)
        return _expert_data_parallel_ranks(self.world, self.ep_size, ep_rank, data_before_expert), local

    def common_state(self, ep_size: int) -> dict:
        """What zero/optimizer_state.pt holds: rank 0's state without the partitions, the param groups with
        the expert groups named for the target layout (DeepSpeed names them ep_size_<N>)."""
        sharded = (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)
        state = {key: value for key, value in self.states[0].items() if key not in sharded}
        state[PARAM_GROUPS] = [{**group, "name": f"ep_size_{ep_size}"} if group.get("moe") else group
                               for group in self.param_groups]
        return state


def _write_experts(shards: ZeroShards, group: int, shapes: dict, ep_size: int, data_before_expert: bool,
                   output_dir: str) -> None:
    """Each expert slot of the target layout: the experts it holds on each target ep rank, stacked."""
    for (prefix, suffix), num_local in shards.expert_slots(group).items():
        num_experts = num_local * shards.ep_size
        if num_experts % ep_size:
            raise ValueError(f"{prefix}*{suffix}: {num_local} experts on each of {shards.ep_size} ep ranks cannot "
                             f"be laid out over ep_size {ep_size}")
        target_local = num_experts // ep_size
        for slot in range(target_local):
            experts = []
            for target_rank in range(ep_size):
                ranks, source_slot = shards.expert_source(target_rank * target_local + slot, num_local,
                                                          data_before_expert)
                local_name = f"{prefix}{source_slot}{suffix}"
                experts.append(shards.whole(group, ranks, local_name, shapes[local_name]))
            stacked = {key: torch.stack([expert[key] for expert in experts]) for key in experts[0]}
            _write_param(output_dir, f"{prefix}{slot}{suffix}", stacked, shards.step(group),
                         {EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: ep_size})


def _expert_data_parallel_ranks(world: int, ep_size: int, ep_rank: int, data_before_expert: bool) -> range:
    """The ranks that hold the experts of `ep_rank`, in the order they partition them (as
    deepspeed.utils.groups._create_expert_and_data_parallel builds the groups)."""
    if data_before_expert:
        stride = world // ep_size
        return range(ep_rank * stride, (ep_rank + 1) * stride)
    return range(ep_rank, world, ep_size)


def _write_param(output_dir: str, name: str, tensors: dict[str, torch.Tensor], step, extra: dict | None = None) -> None:
    folder = os.path.join(output_dir, "zero", name)
    os.makedirs(folder, exist_ok=True)
    for key, tensor in tensors.items():
        torch.save({PARAM: tensor, CAT_DIM: 0, **(extra or {})}, os.path.join(folder, f"{key}.pt"))
    if step is not None:
        torch.save(step, os.path.join(folder, "step.pt"))


def universal_tag(output_dir: str, tag: str, ep_size: int = 1) -> str:
    """Convert checkpoint `tag` to DeepSpeed's universal format (once; rank 0) and return the converted tag.

    A universal checkpoint stores each parameter's fp32 weights and optimizer moments whole, so ZeRO can
    re-partition them over a different number of ranks (`"checkpoint": {"load_universal": true}`). An MoE
    checkpoint is converted by `convert_moe_checkpoint`, its experts laid out for `ep_size`.
    """
    from deepspeed.checkpoint import ds_to_universal

    root = checkpoint_root(output_dir)
    experts = has_experts(os.path.join(root, tag))
    converted = f"{tag}-universal-ep{ep_size}" if experts else f"{tag}-universal"
    error = None
    if distributed.rank() == 0 and not os.path.isdir(os.path.join(root, converted)):
        # written under another name and renamed when complete: an interrupted conversion is never loaded
        partial = os.path.join(root, f"{converted}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        args = argparse.Namespace(input_folder=os.path.join(root, tag), output_folder=partial,
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                  strict=True, inject_missing_state=False)
        try:
            if experts:
                convert_moe_checkpoint(args.input_folder, partial, ep_size)
            else:
                ds_to_universal.main(args)
            os.replace(partial, os.path.join(root, converted))
            logger.info("converted %s to DeepSpeed's universal checkpoint %s", tag, converted)
        except (AssertionError, RuntimeError, OSError, KeyError, ValueError) as e:
            shutil.rmtree(partial, ignore_errors=True)
            error = (f"checkpoint {tag!r} cannot be converted to DeepSpeed's universal format for another number "
                     f"of processes or ep_size ({type(e).__name__}: {e})")
    error = distributed.broadcast_object(error)  # every rank fails together, none waits for rank 0
    if error:
        raise CheckpointError(error)
    return converted


def check_param_groups(engine, universal_dir: str, tag: str) -> None:
    """Refuse a universal checkpoint whose optimizer param groups do not pair with this run's: DeepSpeed's loader
    pairs them by position, and a group without a partner would keep its fresh weights and moments, silently.
    (MoE layers whose experts exceed one param group are grouped by ep_size: training/optim.py `moe_group_size`.)"""
    saved = torch.load(os.path.join(universal_dir, "zero", "optimizer_state.pt"), map_location="cpu",
                       weights_only=False)["param_groups"]
    current = engine.optimizer.optimizer.param_groups
    if len(saved) != len(current):
        raise CheckpointError(f"checkpoint {tag!r} holds {len(saved)} optimizer param groups and this run's layout "
                              f"{len(current)} (its MoE layers split into param groups by ep_size): resume on the "
                              f"checkpoint's moe_ep_size, or one whose layers fit one param group each")
