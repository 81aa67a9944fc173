"""A process that builds a ZeRO-1 engine through adaptive_ds (training/engine.py) and steps it never imports inductor's
compiler (`torch._inductor.compile_fx`, which `torch.compile` imports; the `torch._inductor` package itself comes
with torch._dynamo): DeepSpeed imports its Muon module there, which would torch.compile at import, and adaptive_ds
imports it first with the compile deferred (adaptive_ds/training/deepspeed_muon.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.common import ROOT

_PROBE = """
import json, sys
import torch
from adaptive_ds import distributed
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.presets import model_config
from adaptive_ds.training.engine import build_engine
distributed.init_distributed()
config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 1}}
model = AdaptiveDSForCausalLM(model_config("debug", "dense", vocab_size=64, num_hidden_layers=1))
engine = build_engine(model, config, 1, 2, 0.1)
ids = torch.randint(0, 64, (1, 8))
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
print(json.dumps({"muon imported": "deepspeed.runtime.zero.muon.original_muon" in sys.modules,
                  "inductor's compiler imported": "torch._inductor.compile_fx" in sys.modules}))
"""


def test_a_zero1_engine_built_through_adaptive_ds_does_not_import_inductors_compiler():
    """DeepSpeed did import its Muon module (else this would check nothing), and inductor's compiler stayed out."""
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"muon imported": True, "inductor's compiler imported": False}
