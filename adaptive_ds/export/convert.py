"""Export a training checkpoint as a Hugging Face folder, or convert a model to stock transformers classes.

    python -m adaptive_ds.export CHECKPOINT OUT_DIR                 # adaptive_ds model (safetensors)
    python -m adaptive_ds.export --to llama SRC OUT_DIR             # dense (or retrofitted MoD, capacity 1) -> Llama
    python -m adaptive_ds.export --to mixtral SRC OUT_DIR           # dropless top-2 MoE -> MixtralForCausalLM
    python -m adaptive_ds.export --to auto SRC OUT_DIR              # the stock class its weights came from

CHECKPOINT is a run's OUTPUT_DIR (its latest checkpoint), OUTPUT_DIR/checkpoints, or one checkpoint tag
directory. DeepSpeed's files are consolidated: the module states (full under ZeRO-1/2; under ZeRO-3 the fp32
partitions of every rank, through DeepSpeed's zero_to_fp32) and the one file per expert that DeepSpeed's MoE
checkpoint layout writes from every expert-parallel rank. Weights are exported in the precision the module
trained in (fp32 from ZeRO-3). SRC for a conversion is a checkpoint or a `save_pretrained` folder.

The conversions are the model families' (`adaptive_ds.models.families`: each family with a `to_stock` is a `--to`
choice, with the reason a model cannot be one of its stock models). `--to auto` is the family of the --init_from
folder the model started from (`AdaptiveDSConfig.source_model_type`, kept through upcycling): a Qwen2.5 trained
dense exports as a Qwen2ForCausalLM again. Checkpoints are read by
`adaptive_ds.ds_checkpoint` (no training code; DeepSpeed only for ZeRO-3's partitions).
The adaptive_ds folder also carries the model's source files and an `auto_map` (`export.final.save_standalone`,
as `final/` does), so users with torch and transformers alone (no deepspeed, no adaptive_ds) load it with
`trust_remote_code=True`.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys

from transformers import AutoTokenizer

from ..ds_checkpoint import CheckpointError, load_checkpoint
from ..models import AdaptiveDSConfig, AdaptiveDSForCausalLM
from ..models.families import FAMILIES, auto_export_model_type, exportable
from .final import save_standalone

__all__ = ["convert", "load_any", "main"]

logger = logging.getLogger(__name__)


def load_any(path: str):
    """A checkpoint (`ds_checkpoint.load_checkpoint`) or a save_pretrained folder of an adaptive_ds model."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return AdaptiveDSForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    return load_checkpoint(path)


AUTO = "auto"


def target(model: AdaptiveDSForCausalLM, model_type: str) -> str:
    """The family `--to model_type` names: itself, or for `auto` the family the model's weights came from (for an MoE
    model upcycled from a dense family, that family's MoE sibling, `Family.upcycled_model_type`); ValueError in one
    line where there is none."""
    if model_type != AUTO:
        return model_type
    source = auto_export_model_type(model.config)
    if source not in exportable():
        started = (f"started from a {source!r} model, which no stock class is exported to" if source else
                   "started from no stock model (trained from scratch, or from an adaptive_ds folder that did)")
        raise ValueError(f"--to auto: the model {started}; name the class: --to {' | '.join(exportable())}")
    return source


def convert(model: AdaptiveDSForCausalLM, model_type: str):
    """The stock model of the family `model_type` (one of `models.families.exportable()`, or `auto`: `target`) with
    `model`'s logits and generation config (a base model's eos ids and sampling defaults); ValueError in one line
    where `model` cannot be one (the family's `export_problem`)."""
    stock = FAMILIES[target(model, model_type)].to_stock(model)
    stock.generation_config = copy.deepcopy(model.generation_config)
    return stock


def check(args: argparse.Namespace) -> None:
    """What main checks before it loads anything: ValueError in one line."""
    if not os.path.exists(args.src):
        raise ValueError(f"{args.src!r} does not exist; pass OUTPUT_DIR, a checkpoint directory, or a save_pretrained "
                         "folder")
    if os.path.isdir(args.dst) and os.listdir(args.dst):
        raise ValueError(f"{args.dst!r} already holds files; pass a new or empty output folder")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="Export a checkpoint, or convert to stock transformers classes.")
    p.add_argument("src", help="OUTPUT_DIR, a checkpoint directory, or a save_pretrained folder")
    p.add_argument("dst", help="new or empty output folder")
    own = AdaptiveDSConfig.model_type
    p.add_argument("--to", choices=[own, *exportable(), AUTO], default=own,
                   help=f"{own}: the model with its source files; another: that family's stock transformers class; "
                        f"{AUTO}: the stock class of the folder the model started from (--init_from)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check(args)
        model, tokenizer = load_any(args.src)
        save_standalone(model if args.to == own else convert(model, args.to), tokenizer, args.dst)
    except (CheckpointError, ValueError) as error:
        sys.exit(f"error: {error}")
    logger.info("wrote %s (%s)", args.dst, args.to if args.to != AUTO else target(model, AUTO))


if __name__ == "__main__":
    main()
