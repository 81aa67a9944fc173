"""Sample text from a trained model.

    python -m adaptive_ds.generate MODEL "[arith] 7 * 8 =" --max_new_tokens 8 --temperature 0.8 --top_p 0.95

MODEL is a save_pretrained folder (e.g. OUTPUT_DIR/final) or a checkpoint (see adaptive_ds.ds_checkpoint).
Generation uses the KV cache; temperature 0 is greedy.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .ds_checkpoint import CheckpointError
from .export.convert import load_any


def check(args: argparse.Namespace) -> None:
    """What main checks before it loads anything: ValueError in one line."""
    if not os.path.exists(args.model):
        raise ValueError(f"MODEL {args.model!r} does not exist; pass a save_pretrained folder (OUTPUT_DIR/final) or a "
                         "checkpoint (OUTPUT_DIR, its checkpoints/ or a tag in it)")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Sample from a trained adaptive_ds model.")
    p.add_argument("model")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        check(args)
        model, tokenizer = load_any(args.model)
    except (CheckpointError, OSError, ValueError) as error:
        sys.exit(f"error: {error}")
    model.eval()
    torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p) \
        if args.temperature > 0 else dict(do_sample=False)
    for prompt in args.prompt:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id, **sampling)
        print(tokenizer.decode(out[0], skip_special_tokens=False))


if __name__ == "__main__":
    main()
