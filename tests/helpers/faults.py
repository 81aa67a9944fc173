"""Real faults for tests, installed through the training loop's hooks (never in a production run).

Each fault changes what the model really computes or what the process really has: a NaN written into a weight,
a NaN gradient from a tensor hook in the middle of gradient accumulation, a weight scaled so the loss really
spikes, an out-of-memory error raised where a micro-batch would be allocated, a cap on torch's CPU allocator
under which large allocations really fail (capped_allocator.py), the process killed with SIGKILL before a step, or
sent a signal (SIGTERM, SIGINT) before one. Each fault fires once: the run that a rollback takes back over the same
step does not meet it again.
"""

from __future__ import annotations

import os
import signal

import torch
from helpers import capped_allocator

from adaptive_ds.training.loop import TrainerHooks


class Faults(TrainerHooks):
    def __init__(self, nan_weight_at_step: int | None = None, nan_grad_at: tuple[int, int] | None = None,
                 spike_at_step: int | None = None, spike_factor: float = 30.0,
                 oom_micro_batch_above: int | None = None, oom_from_step: int = 1, oom_at_micro_index: int = 0,
                 memory_cap_mb: float | None = None, kill_before_step: int | None = None,
                 signal_before_step: int | None = None, signal_number: int = signal.SIGTERM):
        self.nan_weight_at_step = nan_weight_at_step
        self.nan_grad_at = tuple(nan_grad_at) if nan_grad_at else None  # (step, micro-batch index)
        self.spike_at_step, self.spike_factor = spike_at_step, spike_factor
        self.oom_micro_batch_above, self.oom_from_step = oom_micro_batch_above, oom_from_step
        self.oom_at_micro_index = oom_at_micro_index
        self.memory_cap_mb, self.kill_before_step = memory_cap_mb, kill_before_step
        self.signal_before_step, self.signal_number = signal_before_step, signal_number
        self.fired: list[tuple[str, int]] = []
        self._grad_hook = None

    def before_step(self, trainer, step: int) -> None:
        if self.memory_cap_mb is not None and step == 2:
            # from step 2 (step 1 made DeepSpeed's lazily allocated buffers): the tensors of a step may hold at
            # most this much at once; a larger allocation really fails in torch's allocator
            capped_allocator.install(int(self.memory_cap_mb * 2**20))
        if step == self.kill_before_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.signal_before_step and ("signal", step) not in self.fired:
            self.fired.append(("signal", step))
            os.kill(os.getpid(), self.signal_number)  # a preemption notice, or Ctrl-C
        model = trainer.engine.module
        if step == self.nan_weight_at_step and ("nan_weight", step) not in self.fired:
            with torch.no_grad():
                model.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
            self.fired.append(("nan_weight", step))
        if step == self.spike_at_step and ("spike", step) not in self.fired:
            with torch.no_grad():
                model.lm_head.weight.mul_(self.spike_factor)
            self.fired.append(("spike", step))

    def before_micro_batch(self, trainer, step: int, index: int, micro_batch: int) -> None:
        if self._grad_hook is not None:
            self._grad_hook.remove()
            self._grad_hook = None
        if self.nan_grad_at == (step, index) and ("nan_grad", step) not in self.fired:
            weight = trainer.engine.module.lm_head.weight

            def poison(grad):
                grad = grad.clone()
                grad[0, 0] = float("nan")
                return grad

            self._grad_hook = weight.register_hook(poison)
            self.fired.append(("nan_grad", step))
        if (self.oom_micro_batch_above is not None and step >= self.oom_from_step
                and index >= self.oom_at_micro_index and micro_batch > self.oom_micro_batch_above):
            self.fired.append(("oom", step))
            raise torch.OutOfMemoryError(f"injected out-of-memory at micro-batch {micro_batch}")
