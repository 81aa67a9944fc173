"""`python tests/helpers/train_with_faults.py FAULTS_JSON --ds_config ...`: the training command with real faults
installed (tests/helpers/faults.py), for tests that need a separate process (a kill, a memory limit)."""

import json
import sys

from faults import Faults

from adaptive_ds.training.__main__ import main

if __name__ == "__main__":
    main(sys.argv[2:], hooks=Faults(**json.loads(sys.argv[1])))
