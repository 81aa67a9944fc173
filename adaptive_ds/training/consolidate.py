"""What the zero_to_fp32.py / zero_to_torch.py of checkpoints written before the checkpoint package import: the same
module as `adaptive_ds.training.checkpoint.consolidate`, which the scripts of newer checkpoints import. Deprecated in
0.2, removed in 0.3."""

import sys
import warnings

from .checkpoint import consolidate

# stacklevel 2: the code that imports this module (warnings skips importlib's frames), so that an older checkpoint's
# script, run as __main__, shows it (Python shows a DeprecationWarning by default only where __main__ triggers it).
warnings.warn("adaptive_ds.training.consolidate is deprecated and goes in 0.3: import "
              "adaptive_ds.training.checkpoint.consolidate (the zero_to_fp32.py of a newer checkpoint does)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = consolidate
