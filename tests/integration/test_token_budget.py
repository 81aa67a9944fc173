"""--tokens chinchilla: 20 tokens per parameter (Hoffmann et al. 2022) set max_steps to the steps that cover them at
the run's global batch, on one process and on two (a global batch twice as large: half the steps). The expected
count is computed here from the model's own parameters; the run is stopped after its first step, whose log line
shows the max_steps it trains to."""

import json
import math
import re
import sys

import pytest
from helpers.common import ROOT, write_ds_config

from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.presets import PRESETS, model_config

FAULTS_SCRIPT = str(ROOT / "tests" / "helpers" / "train_with_faults.py")
MICRO_BATCH = 3  # rows per process and step: 20 x the parameters is then no whole number of steps on 1 or 2


@pytest.mark.parametrize("processes", [1, 2])
def test_chinchilla_trains_the_steps_that_20_tokens_per_parameter_take(tmp_path, run_command, processes):
    tokenizer = embedded_tokenizer()  # the embedded corpus's: the model's vocabulary
    model = AdaptiveDSForCausalLM(model_config("debug", "dense", len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id))
    budget = 20 * sum(p.numel() for p in model.parameters())
    tokens_per_step = MICRO_BATCH * processes * PRESETS["debug"].seq_len  # the global batch's rows x seq_len
    assert budget % tokens_per_step  # ceil and floor differ
    expected = math.ceil(budget / tokens_per_step)  # docs/data.md: the steps that cover the budget

    config = write_ds_config(tmp_path, MICRO_BATCH, 1, tokens="chinchilla", warmup_steps=1, log_steps=1)
    launcher = ["torchrun", "--nproc_per_node", "2"] if processes == 2 else [sys.executable]
    done = run_command([*launcher, FAULTS_SCRIPT, json.dumps({"kill_before_step": 2}), "--ds_config", config,
                        "--output_dir", str(tmp_path / "run")])
    assert done.returncode != 0  # killed after its first step
    assert re.findall(r"step 1/(\d+) loss", done.stderr) == [str(expected)], done.stderr[-3000:]
