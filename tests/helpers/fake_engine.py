"""A stand-in for the DeepSpeed engine at the one place the trainer builds it (`loop.build_engine`), so that the
training loop's cadences can be exercised over thousands of settings in seconds.

It has the engine's interface as the loop uses it and nothing of DeepSpeed: the "weights" are one number `w` that
each applied optimizer step moves by the learning rate; a step's loss is a function of `w` and of the tokens it
trains on (per target token, so it does not depend on how a step is split into micro-batches); the schedule is
the real one (`optim.scheduler_factory`) on a one-parameter torch optimizer; a checkpoint is one small file. The
real model rides along as `module` (its config and the knobs the loop sets on it), but never computes.

`EngineLog` is shared by every engine of a test (a run and its resumption): the schedule lengths built, and the
loss of every optimizer step executed, by step (a step executed again after a rollback or a resume overwrites
it, so the log ends as the run's final trajectory). `FakeFaults` injects a spike, a non-finite loss and an
out-of-memory error, each once, and can stop the process as a kill would (`Killed`, a BaseException).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from adaptive_ds.training.loop import TrainerHooks
from adaptive_ds.training.optim import scheduler_factory

STATE_FILE = "fake_engine.pt"


@dataclass
class EngineLog:
    schedule_lengths: list[int] = field(default_factory=list)  # max_steps of every schedule built
    losses: dict[int, float] = field(default_factory=dict)  # step -> the loss of its latest execution
    executions: Counter = field(default_factory=Counter)  # step -> optimizer steps taken at it


class CountingTensor(torch.Tensor):
    """A tensor that counts the reads that bring its values to the host (`item`, `float`, `bool`, `tolist`): the
    stand-in engine's step losses, and every tensor computed from them, are of this class."""

    reads = 0

    def item(self):
        CountingTensor.reads += 1
        return super().item()

    def tolist(self):
        CountingTensor.reads += 1
        return super().tolist()

    def __float__(self):
        CountingTensor.reads += 1
        return super().__float__()

    def __bool__(self):
        CountingTensor.reads += 1
        return super().__bool__()


class Killed(BaseException):
    """The process died here (nothing after it runs, no file is closed cleanly)."""


class FakeEngine:
    def __init__(self, model, ds_config: dict, warmup_steps: int, max_steps: int, min_lr_ratio: float,
                 compile: bool = False, log: EngineLog | None = None):
        self.module = model
        self.log = log or EngineLog()
        self.log.schedule_lengths.append(max_steps)
        self.device = torch.device("cpu")
        self.dp_world_size = 1
        self.is_compiled = False
        self.has_moe_layers = False
        self.skipped_steps = 0
        self.micro_steps = 0
        self.global_steps = 0
        self._config = SimpleNamespace(load_universal_checkpoint=False)
        self._micro, self._accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config.get(
            "gradient_accumulation_steps", 1)
        self._boundary = True
        self.w = 0.0
        self.loss_factor = 1.0  # the next step's loss is multiplied by this once (a spike, or NaN)
        self._step_loss = 0.0
        lr = ds_config["optimizer"]["params"]["lr"]
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        self.lr_scheduler = scheduler_factory(warmup_steps, max_steps, min_lr_ratio)(self.optimizer)

    # the batch geometry the loop sets and reads
    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation

    def set_train_micro_batch_size(self, micro: int) -> None:
        self._micro = micro

    def set_train_batch_size(self, rows: int) -> None:
        self._accumulation = rows // self._micro

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self._boundary = boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._boundary

    def was_step_applied(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:  # fp32: no loss scale in the records
        return False

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    # compute
    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def __call__(self, input_ids, labels=None, num_items_in_batch=None, **kwargs):
        if not self.module.training:  # validation: logits whose loss depends on the weights
            logits = torch.zeros(*input_ids.shape, self.module.config.vocab_size)
            logits[..., 0] = self.w
            return SimpleNamespace(logits=logits, mod_routing=None)
        targets = labels[:, 1:]
        valid = targets != -100
        token_loss = (2.0 + 1.0 / (1.0 + self.w)) + 1e-4 * (targets % 7).float()  # (rows, seq - 1)
        loss = ((token_loss * valid).sum() / num_items_in_batch * self.loss_factor).as_subclass(CountingTensor)
        self._step_loss += torch.Tensor.item(loss)  # the stand-in's own bookkeeping: not a read of the loop's
        return SimpleNamespace(loss=loss, lm_loss=loss, expert_counts=None, expert_dropped=None, aux_loss=None,
                               z_loss=None, mod_routing=None, mod_predictor_loss=None)

    def backward(self, loss) -> None:
        pass

    def step(self) -> None:
        self.micro_steps += 1
        if not self._boundary:
            return
        self.w += self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()  # a no-op (no gradients), in the order torch's schedulers expect
        self.lr_scheduler.step()
        self.global_steps += 1  # a checkpoint restores it: it is the step being trained
        self.log.losses[self.global_steps] = self._step_loss
        self.log.executions[self.global_steps] += 1
        self.loss_factor = 1.0
        self._step_loss = 0.0

    # checkpoints
    def zero_optimization_stage(self) -> int:
        return 1

    def save_checkpoint(self, root: str, tag: str, client_state: dict, save_latest: bool = False) -> None:
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        torch.save({"w": self.w, "scheduler": self.lr_scheduler.state_dict(), "global_steps": self.global_steps,
                    "client_state": client_state}, os.path.join(root, tag, STATE_FILE))

    def load_checkpoint(self, root: str, tag: str):
        path = os.path.join(root, tag, STATE_FILE)
        state = torch.load(path, weights_only=False)
        self.w, self.global_steps = state["w"], state["global_steps"]
        self.lr_scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        return path, state["client_state"]


class FakeFaults(TrainerHooks):
    """Each fault fires once, at the first execution of its step: `kill_before_step` stops the run as a kill
    would, `spike_at_step` multiplies that step's loss by 100, `nan_at_step` makes it NaN, `oom_at_step` fails its
    first micro-batch with an out-of-memory error (while the micro-batch is above 1)."""

    def __init__(self, log: EngineLog, kill_before_step: int | None = None, spike_at_step: int | None = None,
                 nan_at_step: int | None = None, oom_at_step: int | None = None):
        self.log = log
        self.pending = {"kill": kill_before_step, "spike": spike_at_step, "nan": nan_at_step, "oom": oom_at_step}
        self.fired: list[tuple[str, int]] = []

    def _fire(self, name: str, step: int) -> bool:
        if self.pending[name] == step:
            self.pending[name] = None
            self.fired.append((name, step))
            return True
        return False

    def before_step(self, trainer, step: int) -> None:
        engine = trainer.engine
        if self._fire("kill", step):
            raise Killed(f"killed before step {step}")
        if self._fire("spike", step):
            engine.loss_factor = 100.0
        if self._fire("nan", step):
            engine.loss_factor = math.nan

    def before_micro_batch(self, trainer, step: int, index: int, micro_batch: int) -> None:
        if index == 0 and micro_batch > 1 and self.pending["oom"] == step and self._fire("oom", step):
            raise torch.OutOfMemoryError(f"injected out-of-memory at micro-batch {micro_batch}")
