"""Under a launcher: join the run's process group as the training command does, then print, as one JSON line, this
rank's view of DeepSpeed's shared-memory allreduce segments: whether its backend made them, and each one this
process maps, with whether its name is still in /dev/shm."""

import json
import os

import deepspeed
import torch.distributed as dist

from adaptive_ds import distributed

if __name__ == "__main__":
    distributed.init_distributed()
    dist.barrier()  # every rank has set up (and released its segment's name) before any looks
    with open("/proc/self/maps") as maps:
        segments = {line.split(maxsplit=5)[5].strip() for line in maps if "deepspeed_allreduce_buffer" in line}
    dist.barrier()  # no rank ends (unmapping its segment) before every rank has looked
    line = json.dumps({"rank": dist.get_rank(), "made": deepspeed.comm.comm.cdb.shm_comm_op is not None,
                       "mapped": sorted(segments)})
    # one write of the whole line: the launcher runs its processes unbuffered (python -u), where print writes the text
    # and its newline apart and the other rank's line can land between them; a pipe keeps a write this small whole
    os.write(1, (line + "\n").encode())
