"""Files as the package writes them, made by hand for the unit tests (which start no process, so cannot prepare a
corpus or train): a prepared directory (manifest, token shards, tokenizer/) and a finished pilot run's directory
(summary.json, run_identity.json, metrics.jsonl)."""

import json
from pathlib import Path

import numpy as np

from adaptive_ds.data.prepared import tokenizer_hash
from adaptive_ds.tools.grid_runs import PROVENANCE


def prepared_dir(path, train=tuple(range(40)), validation=(7, 8, 9), tokenizer_text="bpe v1") -> str:
    """A complete prepared directory at `path`: `train` in two uint16 shards, `validation` in one, a tokenizer.json
    holding `tokenizer_text`, and the manifest that names them."""
    path = Path(path)
    (path / "tokenizer").mkdir(parents=True)
    (path / "tokenizer" / "tokenizer.json").write_text(json.dumps({"model": tokenizer_text}))
    half = len(train) // 2
    shards = {"train": [("train_00000.bin", train[:half]), ("train_00001.bin", train[half:])],
              "validation": [("validation_00000.bin", validation)]}
    manifest = {"format": 1, "arguments": {"data": "docs.json.gz"}, "tokenizer_sha256": tokenizer_hash(str(path)),
                "vocab_size": 320, "dtype": "uint16"}
    for split, files in shards.items():
        for name, tokens in files:
            np.array(tokens, dtype=np.uint16).tofile(path / name)
        manifest[split] = {"shards": [{"file": name, "tokens": len(tokens)} for name, tokens in files],
                           "tokens": sum(len(tokens) for _, tokens in files), "documents": len(files)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return str(path)


def pilot_dir(path, curve, corpus: str, tokens_per_step=1000, arch="dense", vocab_size=8192,
              wall_time_s=1800.0, trained: dict | None = None) -> str:
    """A finished dense run at `path` whose validations are `curve` [(tokens, loss)] (each a multiple of
    `tokens_per_step`), with train-loss records between them, on the prepared directory `corpus`, as the training
    writes them: rows_per_step x seq_len tokens per step; `trained`: the provenance a grid or the text budget records
    beside a run it trained (commit, machine, date), none by default."""
    path = Path(path)
    path.mkdir(parents=True)
    seq_len = 250
    manifest = json.loads((Path(corpus) / "manifest.json").read_text())
    identity = {"preset": "debug", "arch": arch, "data": corpus, "seed": 1,
                "tokenizer": f"sha256:{manifest['tokenizer_sha256']}", "world_size": 1,
                "rows_per_step": tokens_per_step // seq_len, "model": {"vocab_size": vocab_size}}
    (path / "run_identity.json").write_text(json.dumps(identity))
    records = []
    for tokens, loss in curve:
        step = tokens // tokens_per_step
        records += [{"step": step - 1, "loss": loss + 0.3, "tokens_seen": tokens - tokens_per_step},
                    {"step": step, "validation_loss": loss, "validation_loss_se": 0.01}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    last_tokens, last_loss = curve[-1]
    summary = {"validation_loss": last_loss, "tokens_seen": last_tokens, "steps": last_tokens // tokens_per_step,
               "seq_len": seq_len, "wall_time_s": wall_time_s, "arch": arch}
    (path / "summary.json").write_text(json.dumps(summary))
    if trained is not None:
        (path / PROVENANCE).write_text(json.dumps(trained))
    return str(path)
