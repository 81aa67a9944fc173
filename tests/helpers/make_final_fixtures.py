"""Write the final/ folders of tests/fixtures/final: a tiny model of each architecture trained for a few steps
through the trainer, its final/ folder without the copied source files, and reference.safetensors with the logits
that model gives on fixed input ids (fp32, eval mode), and its greedy continuation of them.

    python tests/helpers/make_final_fixtures.py OUT_DIR

The MoE options are chosen so that every kind of tensor name an MoE layer saves is present: PR-MoE's residual MLP
and coefficient (moe), shared experts and the routing bias (hybrid).
"""

import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import save_file

from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.training import train

TINY = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
OPTIONS = {"dense": {}, "mod": {}, "moe": {"num_local_experts": 4, "moe_use_residual": True},
           "hybrid": {"num_local_experts": 4, "moe_shared_experts": 1, "moe_balancing": "bias",
                      "moe_bias_update_rate": 0.01}}
KEPT = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def ds_config(directory: str, arch: str) -> str:
    config = {
        "adaptive_ds": {"preset": "debug", "arch": arch, "data": "embedded", "max_steps": 4, "warmup_steps": 1,
                        "log_steps": 2, "eval_batches": 1, "model": {**TINY, **OPTIONS[arch]}},
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
    }
    path = os.path.join(directory, f"{arch}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def reference(folder: str) -> dict[str, torch.Tensor]:
    model = AdaptiveDSForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        generated = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    return {"input_ids": ids, "logits": logits, "generated": generated}


def main(out_dir: str) -> None:
    with tempfile.TemporaryDirectory() as work:
        for arch in OPTIONS:
            run = os.path.join(work, arch)
            train(["--ds_config", ds_config(work, arch), "--output_dir", run])
            target = os.path.join(out_dir, arch)
            os.makedirs(target, exist_ok=True)
            for name in KEPT:
                shutil.copyfile(os.path.join(run, "final", name), os.path.join(target, name))
            save_file(reference(os.path.join(run, "final")), os.path.join(target, "reference.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
