"""Stop requests on the stand-in engine (helpers/fake_engine.py): a tiny model's run whose faults also send this
process a signal before chosen steps, and the train losses a run logged."""

import json
import signal

import pytest
from helpers.common import write_ds_config
from helpers.fake_engine import FakeEngine, FakeFaults

from adaptive_ds.training import loop, train

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 64}


def train_losses(out) -> dict[int, float]:
    """Step -> train loss of the run in `out`, from its metrics.jsonl (records without one, such as a validation's,
    left out; common.logged_losses wants each record a step's)."""
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


class Signal(FakeFaults):
    """The stand-in engine's faults, and a signal sent to this process before some steps."""

    def __init__(self, log, signals: dict[int, int], **faults):
        super().__init__(log, **faults)
        self.signals = dict(signals)

    def before_step(self, trainer, step):
        super().before_step(trainer, step)
        if step in self.signals:
            signal.raise_signal(self.signals.pop(step))


def fake_run(tmp_path, hooks, *args, **block):
    """A run of the TINY model on the stand-in engine (4 rows a micro-batch, 2 micro-batches a step, 10 steps),
    `block` over its ds_config's adaptive_ds block, `hooks` its faults."""
    config = write_ds_config(tmp_path, 4, 2, **{"max_steps": 10, "warmup_steps": 1, "log_steps": 5,
                                               "data_workers": 0, "model": TINY, **block})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "build_engine", lambda *a, **k: FakeEngine(*a, **k, log=hooks.log))
        return train(["--ds_config", config, "--output_dir", str(tmp_path / "run"), *args], hooks=hooks)
