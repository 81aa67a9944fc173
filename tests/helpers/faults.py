"""Real faults for tests, installed through the training loop's hooks (never in a production run).

Each fault changes what the model really computes or what the process really has: a NaN written into a weight,
a NaN gradient from a tensor hook in the middle of gradient accumulation, an infinite gradient (what an fp16
overflow makes) in chosen steps, a weight scaled so the loss really spikes, an out-of-memory error raised where a
micro-batch would be allocated, a cap on torch's CPU allocator under which large allocations really fail
(capped_allocator.py), the process killed with SIGKILL before a step, or sent a signal (SIGTERM, SIGINT) before one.
Each fault fires once: the run that a rollback takes back over the same step does not meet it again.

Faults in a checkpoint's writes are installed for the run inside `with Faults(...) as faults:` and removed after it:
a full disk at the saves of chosen steps (`full_disk_at_saves`: the checkpoint's first tensor file is written half
and fails with ENOSPC, as DeepSpeed's `torch.save` fails on a full filesystem), and a failed write of the manifest,
run.json or `latest` at the save of one step (`write_fault`: the write raises ENOSPC, or the process is killed with
SIGKILL while the file's temporary copy is half written).
"""

from __future__ import annotations

import errno
import io
import os
import signal

import torch
from helpers import capped_allocator

from adaptive_ds.training.checkpoint import storage
from adaptive_ds.training.loop import TrainerHooks

WRITES = (storage.MANIFEST, storage.RUN_STATE, storage.LATEST)  # what `storage.publish` writes, in its order


class Faults(TrainerHooks):
    def __init__(self, nan_weight_at_step: int | None = None, nan_grad_at: tuple[int, int] | None = None,
                 inf_grad_at_steps: tuple[int, ...] = (), spike_at_step: int | None = None, spike_factor: float = 30.0,
                 oom_micro_batch_above: int | None = None, oom_from_step: int = 1, oom_at_micro_index: int = 0,
                 memory_cap_mb: float | None = None, kill_before_step: int | None = None,
                 signal_before_step: int | None = None, signal_number: int = signal.SIGTERM,
                 full_disk_at_saves: list[int] = (), write_fault: tuple[str, int, str] | None = None):
        self.nan_weight_at_step = nan_weight_at_step
        self.nan_grad_at = tuple(nan_grad_at) if nan_grad_at else None  # (step, micro-batch index)
        self.inf_grad_at_steps = set(inf_grad_at_steps)  # in each step's first micro-batch
        self.spike_at_step, self.spike_factor = spike_at_step, spike_factor
        self.oom_micro_batch_above, self.oom_from_step = oom_micro_batch_above, oom_from_step
        self.oom_at_micro_index = oom_at_micro_index
        self.memory_cap_mb, self.kill_before_step = memory_cap_mb, kill_before_step
        self.signal_before_step, self.signal_number = signal_before_step, signal_number
        self.full_disk_at_saves = set(full_disk_at_saves)
        self.write_fault = tuple(write_fault) if write_fault else None  # (one of WRITES, step, "raise" or "kill")
        assert self.write_fault is None or (self.write_fault[0] in WRITES and self.write_fault[2] in ("raise", "kill"))
        self.fired: list[tuple[str, int]] = []
        self._grad_hook = None
        self._installed: list[tuple[object, str, object]] | None = None  # (module, name, the original) while in `with`

    def __enter__(self) -> Faults:
        self._installed = []
        if self.full_disk_at_saves:
            self._install(torch, "save", self._full_disk(torch.save))
        if self.write_fault:
            self._install(storage, "write_atomic", self._failing_write(storage.write_atomic))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._installed):
            setattr(module, name, original)
        self._installed = None

    def _install(self, module, name: str, replacement) -> None:
        self._installed.append((module, name, getattr(module, name)))
        setattr(module, name, replacement)

    def _full_disk(self, real_save):
        """torch.save, failing with ENOSPC half-way through the first file of each checkpoint in full_disk_at_saves."""
        def save(obj, f, *args, **kwargs):
            tag = os.path.basename(os.path.dirname(str(f)))
            step = int(tag[4:]) if storage.TAG.fullmatch(tag) else None
            if step not in self.full_disk_at_saves or ("full_disk", step) in self.fired:
                return real_save(obj, f, *args, **kwargs)
            self.fired.append(("full_disk", step))
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(f, "wb") as out:
                out.write(data[:len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return save

    def _failing_write(self, real_write):
        """storage.write_atomic, failing the write of `write_fault`'s file at the save of its step."""
        name, at_step, how = self.write_fault

        def write_atomic(path: str, text: str) -> None:
            # `latest` holds the tag it names; the manifest and run.json are in the tag's directory
            tag = text if os.path.basename(path) == storage.LATEST else os.path.basename(os.path.dirname(path))
            if os.path.basename(path) != name or tag != storage.tag_of(at_step) or ("write", at_step) in self.fired:
                return real_write(path, text)
            self.fired.append(("write", at_step))
            if how == "kill":  # the process dies while the temporary copy is half written
                with open(f"{path}.tmp", "w") as f:
                    f.write(text[:len(text) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{path}.tmp")
        return write_atomic

    def before_step(self, trainer, step: int) -> None:
        assert self._installed is not None or not (self.full_disk_at_saves or self.write_fault), \
            "faults in checkpoint writes are installed by `with Faults(...) as faults:`"
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
            self._poison_gradient(trainer, float("nan"))
            self.fired.append(("nan_grad", step))
        if step in self.inf_grad_at_steps and index == 0 and ("inf_grad", step) not in self.fired:
            self._poison_gradient(trainer, float("inf"))
            self.fired.append(("inf_grad", step))
        if (self.oom_micro_batch_above is not None and step >= self.oom_from_step
                and index >= self.oom_at_micro_index and micro_batch > self.oom_micro_batch_above):
            self.fired.append(("oom", step))
            raise torch.OutOfMemoryError(f"injected out-of-memory at micro-batch {micro_batch}")

    def _poison_gradient(self, trainer, value: float) -> None:
        """The next backward's gradient of the LM head holds `value` in one element (a tensor hook, removed before
        the next micro-batch)."""
        def poison(grad):
            grad = grad.clone()
            grad[0, 0] = value
            return grad

        self._grad_hook = trainer.engine.module.lm_head.weight.register_hook(poison)
