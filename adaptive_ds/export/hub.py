"""Pushing exported models to the Hugging Face Hub with a generated model card.

The token comes from the standard places (HF_TOKEN, or `huggingface-cli login`'s cache) through
`huggingface_hub.HfApi`; it is never read, logged or written here. A failed push is logged and leaves the
local files as they were. Pushes at save time run in a background thread, one at a time, so training does not
wait; the final push is waited for.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading

from huggingface_hub import HfApi

logger = logging.getLogger(__name__)


def _base_model(summary: dict) -> tuple[str, str]:
    """The card's `base_model` metadata line (a Hub id only: the Hub links it) and its table row, for a run started
    from pretrained weights (--init_from); empty for one started from random weights. A local folder is named by
    its last component and its content hash, never by its path on the machine that trained."""
    source = summary.get("base_model")
    if not source:
        return "", ""
    digest = summary.get("base_model_sha256", "")
    if os.path.isdir(source) or source.startswith((os.path.sep, ".", "~")):
        name = f"{os.path.basename(os.path.normpath(source))} (a local folder, {digest})"
        return "", f"| base model | {name} |\n"
    return f"base_model: {source}\n", f"| base model | {source} ({digest}) |\n"


def model_card(summary: dict, command: str) -> str:
    """README.md for the Hub: architecture, preset, base model, parameter counts, tokens, losses and the command."""
    def fmt(key, spec="{:.4f}"):
        return spec.format(summary[key]) if key in summary else "n/a"

    base_meta, base_row = _base_model(summary)
    preset = summary.get("preset")  # None: a run --init_from a folder of no preset's shape claims none
    title = " ".join(word for word in ("adaptive_ds", preset, summary.get("arch", "?")) if word)
    return f"""---
library_name: transformers
tags: [adaptive_ds, {summary.get('arch', 'unknown')}, deepspeed]
{base_meta}---

# {title}

Trained with adaptive_ds through the DeepSpeed engine.

| | |
|---|---|
| architecture | {summary.get('arch', '?')} |
| preset | {preset or "none (the shape of the weights it started from)"} |
{base_row}| total parameters | {summary.get('total_parameters', 0):,} |
| active parameters | {summary.get('active_parameters', 0):,} |
| tokens seen | {summary.get('tokens_seen', 0):,} |
| final train loss | {fmt('train_loss')} |
| validation loss | {fmt('validation_loss')} |
| step | {summary.get('steps', '?')} |

The repo carries the model code, which needs torch and transformers only (no deepspeed, no adaptive_ds):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "OWNER/NAME"  # this repo's id, or a folder holding its files
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
```

Where the `adaptive_ds` package is installed, `import adaptive_ds.models` registers the classes and
`trust_remote_code` is not needed. To fine-tune, transformers' `Trainer` works as for any causal LM, with or without
its DeepSpeed integration (`TrainingArguments(deepspeed=...)`): the experts of an MoE model are plain modules
there, which DeepSpeed trains as a dense model's.

Command:

```
{command}
```
"""


class HubPusher:
    """Uploads folders to one Hub repo. `api` defaults to `HfApi()`; tests pass a local stand-in."""

    def __init__(self, repo_id: str, api=None):
        self.repo_id = repo_id
        self.api = api if api is not None else HfApi()
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []
        self.pushed: list[str] = []

    def push(self, folder: str, card: str, message: str) -> bool:
        """Upload `folder` with `card` as README.md; True on success. Errors are logged, never raised."""
        staging = tempfile.mkdtemp(prefix="adaptive_ds_push_")
        try:
            shutil.copytree(folder, staging, dirs_exist_ok=True)
            with open(os.path.join(staging, "README.md"), "w") as f:
                f.write(card)
            self.api.create_repo(self.repo_id, exist_ok=True)
            self.api.upload_folder(repo_id=self.repo_id, folder_path=staging, commit_message=message)
        except Exception as error:  # noqa: BLE001 - any upload failure is reported and training goes on
            self.failures.append(f"{message}: {type(error).__name__}: {error}")
            logger.error("push to %s failed (%s: %s); the local files are unchanged", self.repo_id,
                         type(error).__name__, error)
            return False
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.pushed.append(message)
        logger.info("pushed %s to %s", message, self.repo_id)
        return True

    def push_in_background(self, folder: str, card: str, message: str) -> None:
        """Push a snapshot of `folder` without blocking; a push still running is waited for first."""
        snapshot = tempfile.mkdtemp(prefix="adaptive_ds_snapshot_")
        shutil.copytree(folder, snapshot, dirs_exist_ok=True)
        self.wait()

        def run():
            try:
                self.push(snapshot, card, message)
            finally:
                shutil.rmtree(snapshot, ignore_errors=True)

        self._thread = threading.Thread(target=run, name="hub-push", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
