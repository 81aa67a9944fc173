"""What the zero_to_fp32.py / zero_to_torch.py of checkpoints written before the checkpoint package import: the same
module as `adaptive_ds.training.checkpoint.consolidate`."""

import sys

from .checkpoint import consolidate

sys.modules[__name__] = consolidate
