"""`python tests/helpers/train_held.py GATE STEP --ds_config ...`: the training command, held before step STEP until
the test opens the gate, so that a test can change the world between two steps (cut a network link) at a known point.

Before STEP each rank writes GATE/held.RANK and waits for the file GATE/open; once GATE/open exists nothing is held,
so the same command run again (a resume) trains straight through.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, as under pytest

from adaptive_ds import distributed  # noqa: E402
from adaptive_ds.training.__main__ import main  # noqa: E402
from adaptive_ds.training.loop import TrainerHooks  # noqa: E402


class Gate(TrainerHooks):
    def __init__(self, gate: str, step: int):
        self.gate, self.step = gate, step

    def before_step(self, trainer, step: int) -> None:
        opened = os.path.join(self.gate, "open")
        if step != self.step or os.path.exists(opened):
            return
        with open(os.path.join(self.gate, f"held.{distributed.rank()}"), "w"):
            pass
        deadline = time.monotonic() + 300  # a test that died never opens it
        while not os.path.exists(opened) and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    # DeepSpeed's launcher puts --local_rank=N before every other argument
    local_rank = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    gate, step, *flags = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main([*local_rank, *flags], hooks=Gate(gate, int(step)))
