"""`python tests/helpers/train_with_faults.py FAULTS_JSON --ds_config ...`: the training command with real faults
installed (tests/helpers/faults.py), for tests that need a separate process (a kill, a memory limit)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, as under pytest

from helpers.faults import Faults  # noqa: E402

from adaptive_ds.training.__main__ import main  # noqa: E402

if __name__ == "__main__":
    with Faults(**json.loads(sys.argv[1])) as faults:
        main(sys.argv[2:], hooks=faults)
