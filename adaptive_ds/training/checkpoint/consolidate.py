"""Consolidate a training checkpoint into one state dict, for every architecture: what DeepSpeed's zero_to_fp32.py and
zero_to_torch.py do, MoE experts included.

DeepSpeed copies its zero_to_fp32.py and zero_to_torch.py into OUTPUT_DIR/checkpoints at every save. Their reader
takes every `*_model_states.pt` of a tag folder for a rank's model states, so it stops at the first of the files
that DeepSpeed's MoE layout writes per expert (`layer_<l>_expert_<e>_mp_rank_00_model_states.pt`); and it could not
tell the experts apart anyway, since each ep rank's optimizer partition numbers its experts from 0. After every save,
`install_scripts` replaces both with scripts that call this module, with DeepSpeed's command lines and output files:

    python OUTPUT_DIR/checkpoints/zero_to_fp32.py OUTPUT_DIR/checkpoints OUT [--tag TAG] [--safe_serialization]
        [--max_shard_size 5GB] [--exclude_frozen_parameters] [--debug]
    python OUTPUT_DIR/checkpoints/zero_to_torch.py OUTPUT_DIR/checkpoints OUT --dtype {bf16,fp16,fp32,...} [...]

OUT receives pytorch_model.bin (model.safetensors with --safe_serialization), or shards of at most --max_shard_size
with their index (pytorch_model.bin.index.json, model.safetensors.index.json): the fp32 master weights that ZeRO
keeps (cast to --dtype), under the model's own names with every expert under its global number, as final/ and
`python -m adaptive_ds.export` name them, so `AdaptiveDSForCausalLM(config).load_state_dict(sd, strict=True)` takes
them. TAG defaults to the one `latest` names.

Where the weights come from: a checkpoint without experts (dense, mod, and any ZeRO-3 checkpoint) is read by
DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`; an MoE or hybrid one (ZeRO stage 1 or 2: DeepSpeed MoE
does not run under ZeRO-3) from its optimizer partitions through `universal.ZeroShards`, each expert joined from the
ranks of its expert-data-parallel group. The MoE path joins each tensor when its output shard is written, so it
holds one shard in memory besides the memory-mapped partitions.

What the scripts import: a checkpoint written by adaptive_ds is consolidated where adaptive_ds is installed (its
pickles need deepspeed in any case), so each script is a few lines that call `main` here; where adaptive_ds cannot
be imported they stop with one line saying so. Bad input (not a checkpoint folder, an unknown tag, a corrupt file,
an output file that already exists) stops with one line and a non-zero exit; nothing that existed is overwritten
or removed (the files of a conversion that fails part-way are its own, and are removed).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import pickle
import stat
import sys
import zipfile

import torch
from deepspeed.checkpoint.constants import (
    BUFFER_NAMES,
    FP32_WEIGHT_KEY,
    FROZEN_PARAM_FRAGMENTS,
    FROZEN_PARAM_SHAPES,
    PARAM_SHAPES,
    SINGLE_PARTITION_OF_FP32_GROUPS,
)
from deepspeed.utils import zero_to_fp32
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from . import universal

logger = logging.getLogger(__name__)

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
LATEST = "latest"  # the file DeepSpeed and adaptive_ds write beside the tag folders
_ERRORS = (ValueError, OSError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile)


class _JoinedWeight:
    """A parameter's fp32 master weight, joined from its ZeRO partitions when `contiguous()` is called: the lazy
    tensor that `zero_to_fp32.to_torch_tensor` takes (as DeepSpeed's `GatheredTensor`)."""

    def __init__(self, shards: universal.ZeroShards, group: int, ranks, name: str, shape):
        self.shards, self.group, self.ranks, self.name = shards, group, ranks, name
        self.shape = torch.Size(shape)
        self.dtype = shards.states[0][SINGLE_PARTITION_OF_FP32_GROUPS][group].dtype

    def contiguous(self) -> torch.Tensor:
        return self.shards.whole(self.group, self.ranks, self.name, self.shape, weight_only=True)[FP32_WEIGHT_KEY]


def tag_folder(checkpoint_dir: str, tag: str | None) -> str:
    """The folder of checkpoint `tag` (None: the one `latest` names) in `checkpoint_dir`, the folder of the tags."""
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(f"{checkpoint_dir!r} is not a directory: pass the checkpoint folder, OUTPUT_DIR/checkpoints")
    if _is_tag_folder(checkpoint_dir):
        raise ValueError(f"{checkpoint_dir!r} is a checkpoint tag folder: pass the folder that holds it and name it "
                         f"with --tag {os.path.basename(os.path.normpath(checkpoint_dir))}")
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.isfile(latest):
            raise ValueError(f"{checkpoint_dir!r} has no '{LATEST}' file: pass the checkpoint folder "
                             "OUTPUT_DIR/checkpoints, or name a checkpoint with --tag")
        with open(latest) as f:
            tag = f.read().strip()
    where = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(where):
        tags = sorted(t for t in os.listdir(checkpoint_dir) if _is_tag_folder(os.path.join(checkpoint_dir, t)))
        raise ValueError(f"no checkpoint tag {tag!r} in {checkpoint_dir!r}; its tags: {', '.join(tags) or 'none'}")
    return where


def _is_tag_folder(path: str) -> bool:
    """Whether `path` holds a checkpoint's DeepSpeed files (mp_rank_00_model_states.pt; under ZeRO-3 one per rank)."""
    return bool(glob.glob(os.path.join(glob.escape(path), "*mp_rank_00_model_states.pt")))


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False, lazy_mode: bool = False) -> dict:
    """The fp32 master weights of checkpoint `tag` as one state dict under the model's names (experts by global
    number); DeepSpeed's function of this name, for every architecture. `lazy_mode`: values that become tensors
    on `.contiguous()`."""
    where = tag_folder(checkpoint_dir, tag)
    if universal.has_experts(where):
        state_dict = _moe_state_dict(where, exclude_frozen_parameters)
    else:
        try:
            state_dict = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                checkpoint_dir, os.path.basename(where), exclude_frozen_parameters, lazy_mode=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:  # a file it cannot read
            problem = f"{type(e).__name__}: {' '.join(str(e).split())}"
            raise ValueError(f"checkpoint {where!r} cannot be read ({problem})") from None
    return state_dict if lazy_mode else zero_to_fp32.to_torch_tensor(state_dict)


def _moe_state_dict(where: str, exclude_frozen_parameters: bool) -> dict:
    """An MoE ZeRO-1/2 checkpoint's state dict, as DeepSpeed's zero2 reader builds one (buffers, frozen and
    trainable parameters, shared ones), each expert joined from its own partition group under its global number."""
    states = universal.load(os.path.join(where, universal.MODEL_STATES))
    shards = universal.ZeroShards(where)
    data_before_expert = bool(states["ds_config"].get("use_data_before_expert_parallelism", False))
    shapes = {name: shape for group in states[PARAM_SHAPES] for name, shape in group.items()}
    state_dict = {name: tensor.float() if tensor.is_floating_point() else tensor
                  for name, tensor in states["module"].items() if name in states[BUFFER_NAMES]}
    if not exclude_frozen_parameters:
        for name in states.get(FROZEN_PARAM_SHAPES) or {}:
            if universal.EXPERT.fullmatch(name):
                raise ValueError(f"{name} is a frozen expert parameter, which the checkpoint's model states hold "
                                 "for rank 0's experts only; pass --exclude_frozen_parameters")
            state_dict[name] = states[FROZEN_PARAM_FRAGMENTS][name]
    for group in range(shards.num_groups):
        if not shards.is_expert_group(group):
            for name in shards.names(group):
                state_dict[name] = _JoinedWeight(shards, group, range(shards.world), name, shapes[name])
            continue
        for (prefix, suffix), num_local in shards.expert_slots(group).items():
            for number in range(num_local * shards.ep_size):
                ranks, local = shards.expert_source(number, num_local, data_before_expert)
                local_name = f"{prefix}{local}{suffix}"
                state_dict[f"{prefix}{number}{suffix}"] = _JoinedWeight(shards, group, ranks, local_name,
                                                                        shapes[local_name])
    for name, source in states["shared_params"].items():
        if source in state_dict:
            state_dict[name] = state_dict[source]
    missing = [name for name in shapes if name not in state_dict]  # local expert numbers are global ones too
    if missing:
        raise ValueError(f"{where!r}: the optimizer files hold no fp32 weights of {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}")
    logger.info("MoE checkpoint %s: %d processes with ep_size %d", where, shards.world, shards.ep_size)
    return state_dict


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str, output_dir: str, dtype=torch.float32,
                                          max_shard_size: str | int | None = "5GB", safe_serialization: bool = False,
                                          tag: str | None = None, exclude_frozen_parameters: bool = False) -> None:
    """Write checkpoint `tag` to `output_dir` as DeepSpeed's function of this name does (see the module doc for the
    files), for every architecture. Refuses (ValueError, nothing written) when a file it would write exists."""
    dtype = zero_to_fp32._resolve_output_dtype(dtype)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters,
                                                          lazy_mode=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    index = None
    if max_shard_size is None:
        files = {weights_name: list(state_dict)}
    else:
        pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
        empty = zero_to_fp32.to_torch_tensor(state_dict, return_empty_tensor=True, dtype=dtype)
        split = split_torch_state_dict_into_shards(empty, filename_pattern=pattern, max_shard_size=max_shard_size)
        files = split.filename_to_tensors
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    index_name = f"{weights_name}.index.json"
    present = [name for name in [*files, index_name] if os.path.lexists(os.path.join(output_dir, name))]
    if present:
        raise ValueError(f"{output_dir!r} already holds {', '.join(present)}: pass a new or empty output folder")
    os.makedirs(output_dir, exist_ok=True)
    written = []
    try:
        for filename, names in files.items():
            shard = zero_to_fp32.to_torch_tensor({name: state_dict.pop(name) for name in names}, dtype=dtype)
            path = os.path.join(output_dir, filename)
            written.append(path)
            if safe_serialization:
                save_file(shard, path, metadata={"format": "pt"})
            else:
                torch.save(shard, path)
        if index is not None:
            written.append(os.path.join(output_dir, index_name))
            with open(written[-1], "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    except BaseException:
        for path in written:  # this conversion's own files only: a partial output is not left to be mistaken
            if os.path.exists(path):
                os.remove(path)
        raise
    logger.info("wrote %d file(s) in %s (%s)", len(written), output_dir, str(dtype).removeprefix("torch."))


_SCRIPT = '''#!/usr/bin/env python
"""{description}

Installed by adaptive_ds in place of DeepSpeed's script of this name, with its command line and output files, for
every architecture (MoE experts included, under their global numbers). It needs adaptive_ds, which wrote the
checkpoint; see adaptive_ds/training/checkpoint/consolidate.py.

    python {name} OUTPUT_DIR/checkpoints OUT_DIR{dtype} [--tag TAG] [--safe_serialization]
"""

import sys

try:
    from adaptive_ds.training.checkpoint import consolidate
except ImportError as error:
    sys.exit(f"error: {name} needs adaptive_ds, which wrote this checkpoint ({{error}}); run it where "
             "adaptive_ds is installed")

if __name__ == "__main__":
    consolidate.main(dtype_option={with_dtype})
'''


def script_text(name: str) -> str:
    """The source of checkpoint-folder script `name` (one of SCRIPTS)."""
    with_dtype = name == "zero_to_torch.py"
    description = ("Convert a DeepSpeed ZeRO checkpoint to float32, float16 or bfloat16 PyTorch weights."
                   if with_dtype else "Consolidate a DeepSpeed ZeRO checkpoint into fp32 PyTorch weights.")
    return _SCRIPT.format(description=description, name=name, with_dtype=with_dtype,
                          dtype=" --dtype bf16" if with_dtype else "")


def install_scripts(checkpoint_root: str) -> None:
    """Replace DeepSpeed's zero_to_fp32.py and zero_to_torch.py in `checkpoint_root` with ours (each atomically,
    executable, as DeepSpeed's are)."""
    for name in SCRIPTS:
        path = os.path.join(checkpoint_root, name)
        partial = f"{path}.tmp"
        try:
            with open(partial, "w") as f:
                f.write(script_text(name))
            os.chmod(partial, os.stat(partial).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            os.replace(partial, path)
        except OSError:  # a full disk: no half-written script is left beside the checkpoints
            if os.path.exists(partial):
                os.remove(partial)
            raise


def check(args: argparse.Namespace) -> None:
    """What main checks before it reads a checkpoint: ValueError in one line."""
    if not os.path.isdir(args.checkpoint_dir):
        raise ValueError(f"{args.checkpoint_dir!r} is no folder; pass the folder of the checkpoint tags and `latest` "
                         "(OUTPUT_DIR/checkpoints)")


def main(argv: list[str] | None = None, dtype_option: bool = False) -> None:
    """The scripts' command line: DeepSpeed's zero_to_fp32.py (`dtype_option`: its zero_to_torch.py, --dtype)."""
    p = argparse.ArgumentParser(description="Consolidate an adaptive_ds (DeepSpeed) checkpoint into PyTorch weights "
                                            "under the model's names, every expert included.", allow_abbrev=False)
    p.add_argument("checkpoint_dir", help="the folder of the checkpoint tags and `latest`: OUTPUT_DIR/checkpoints")
    p.add_argument("output_dir", help="folder for the state dict files (pytorch_model.bin, or shards and an index)")
    if dtype_option:
        p.add_argument("--dtype", choices=sorted(zero_to_fp32.OUTPUT_DTYPE_NAMES), required=True,
                       help="output tensor dtype")
    p.add_argument("--max_shard_size", default="5GB", help="largest shard, such as 5GB or 500MB")
    p.add_argument("--safe_serialization", action="store_true", help="safetensors instead of pickle")
    p.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    p.add_argument("-d", "--debug", action="store_true", help="DeepSpeed's reader's debug output")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    zero_to_fp32.debug = args.debug
    try:
        check(args)
    except ValueError as error:
        sys.exit(f"error: {error}")
    try:
        convert_zero_checkpoint_to_state_dict(args.checkpoint_dir, args.output_dir,
                                              dtype=args.dtype if dtype_option else torch.float32,
                                              max_shard_size=args.max_shard_size,
                                              safe_serialization=args.safe_serialization, tag=args.tag,
                                              exclude_frozen_parameters=args.exclude_frozen_parameters)
    except _ERRORS as error:
        sys.exit(f"error: {type(error).__name__}: {' '.join(str(error).split())}")
