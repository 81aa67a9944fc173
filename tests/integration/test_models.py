"""The models build, train and generate where deepspeed is not installed."""

import pytest
from helpers.hidden_packages import without

# Every architecture, with every MoE option, built and trained a step and generating where deepspeed is not installed.
WITHOUT_DEEPSPEED = """
import torch

from adaptive_ds.models import ARCHITECTURES, AdaptiveDSConfig, AdaptiveDSForCausalLM

MOE = dict(num_local_experts=4, moe_use_residual=True, moe_jitter=True, moe_shared_experts=1, moe_balancing="bias")
for arch in ARCHITECTURES:
    torch.manual_seed(0)
    config = AdaptiveDSConfig(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, **MOE)
    model = AdaptiveDSForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(2, 64, (2, 16))
    losses = []
    for _ in range(3):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if out.expert_counts is not None:
            model.update_routing_bias([out.expert_counts])
        losses.append(out.loss.item())
    assert losses[-1] < losses[0], (arch, losses)
    generated = model.eval().generate(ids[:, :4], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 8), arch
print("built", ",".join(ARCHITECTURES), "imported", loaded_hidden())
"""


@pytest.mark.slow  # a second interpreter
def test_the_models_build_train_and_generate_where_deepspeed_is_not_installed(run_command):
    result = run_command(["python", "-I", "-c", without(("deepspeed",), WITHOUT_DEEPSPEED)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "built dense,moe,mod,hybrid imported []"
