"""Push a finished run's model to the Hugging Face Hub, with a model card made from its summary.

    hf auth login        # or export HF_TOKEN=...
    python examples/push_to_hub.py runs/my-run your-name/my-model

RUN_DIR is a training run's output directory: its final/ folder (safetensors, tokenizer, the model's code) is
uploaded with a README.md holding the architecture, preset, parameter counts, tokens and losses (and --command). A
training run can also push by itself: --push_to_hub REPO_ID (and --push_every_save). The token is read by
huggingface_hub from its usual places and never printed. A failed push ends with one line; the local files are
left as they are.
"""

import argparse
import json
import logging
import os

from adaptive_ds.export.hub import HubPusher, model_card


def main(argv: list[str] | None = None, api=None) -> None:
    """`api` replaces huggingface_hub.HfApi (a local stand-in, offline)."""
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="Push a run's final/ model with its model card to the Hub.")
    p.add_argument("run_dir", help="a training run's output directory, holding final/ and summary.json")
    p.add_argument("repo_id", help="the Hub repository, e.g. your-name/my-model")
    p.add_argument("--command", default="n/a", help="the training command, shown in the card")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    final, summary_path = os.path.join(args.run_dir, "final"), os.path.join(args.run_dir, "summary.json")
    for path in (final, summary_path):
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} not found; pass the output directory of a finished training run")
    with open(summary_path) as f:
        summary = json.load(f)
    pusher = HubPusher(args.repo_id, api=api)
    if not pusher.push(final, model_card(summary, args.command), "final model"):
        raise SystemExit(f"error: the push to {args.repo_id} failed ({pusher.failures[-1]}); nothing local changed")
    print(f"pushed {final} to {args.repo_id}")


if __name__ == "__main__":
    main()
