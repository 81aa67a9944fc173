"""`python tests/helpers/train_recording_steps.py OUT_JSON --ds_config ...`: the training command, recording before
each step what the GPU tests check (DeepSpeed's skipped-step count and loss scale, the controller's overflow count,
the process group's backend, the knobs) into OUT_JSON."""

import json
import sys

import torch.distributed as dist

from adaptive_ds.training.__main__ import main
from adaptive_ds.training.loop import TrainerHooks


class RecordSteps(TrainerHooks):
    def __init__(self, path: str):
        self.path, self.steps = path, []

    def before_step(self, trainer, step: int) -> None:
        engine = trainer.engine
        self.steps.append({"step": step, "skipped_steps": engine.skipped_steps,
                           "overflow_run": trainer.controller.overflow_run,
                           "loss_scale": engine.optimizer.loss_scale if engine.fp16_enabled() else None,
                           "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
                           "zero_stage": engine.zero_optimization_stage(), "offload": engine.zero_cpu_offload(),
                           "backend": dist.get_backend(), "micro_batch": trainer.applied.micro_batch,
                           "device": str(engine.device)})
        with open(self.path, "w") as f:
            json.dump(self.steps, f)


if __name__ == "__main__":
    main(sys.argv[2:], hooks=RecordSteps(sys.argv[1]))
