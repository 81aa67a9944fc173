"""Run under `torchrun --nproc_per_node 2 tests/helpers/moe_expert_parallel.py CASE...`, each CASE a
`moe_grouped_gemm` mode ("always" or "never"), optionally followed by "+fine" or "+deepspeed": an ep_size-2 MoE model
on half the batch per rank must give the loss and gradients of the same model (ep_size 1, the indexed dispatch) on
the whole batch in one process. "+deepspeed": the ep_size-2 model dispatches through DeepSpeed's dispatcher
(`moe_dispatch` "deepspeed", dropless: its capacity is the busiest expert's over both ranks).

Gradient convention checked: non-expert gradients are averaged over data-parallel ranks; an expert's gradient
(it lives on one rank, fed by both ranks' tokens through the all-to-all) is divided by the world size, which is
what DeepSpeed's engine applies to expert parameters when the expert-data-parallel group has size 1.
The routing losses are switched off: like DeepSpeed's, they are computed on each rank's own tokens, so with
them the two runs differ by design (a mean of per-rank products is not the product of global means).

"+fine" runs fine-grained experts (granularity 2, top-4 of 8), a shared expert and bias
balancing with a nonzero bias; then the routing-bias update, all-reduced over the ranks, must also equal the
update the one-process run's loads give.
"""

import re
import sys

import torch
import torch.distributed as dist

from adaptive_ds.distributed import init_distributed
from adaptive_ds.models import AdaptiveDSConfig, AdaptiveDSForCausalLM
from adaptive_ds.training import moe_adapter

EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")


def config(ep_size: int, grouped: str, fine: bool, dispatch: str = "indexed") -> AdaptiveDSConfig:
    options = dict(moe_expert_granularity=2, moe_shared_experts=1, moe_balancing="bias") if fine else {}
    return AdaptiveDSConfig(arch="moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                            moe_drop_tokens=False, moe_ep_size=ep_size, router_aux_loss_coef=0.0,
                            router_z_loss_coef=0.0, moe_grouped_gemm=grouped, moe_dispatch=dispatch, **options)


def main() -> None:
    """Every case in one launch: a process start-up costs more than the check itself."""
    init_distributed()
    for case in sys.argv[1:]:
        grouped, _, option = case.partition("+")
        check(case, grouped, option == "fine", "deepspeed" if option == "deepspeed" else "indexed")
    dist.destroy_process_group()


def check(case: str, grouped: str, fine: bool, dispatch: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = AdaptiveDSForCausalLM(config(1, grouped, fine))
    biases = [name for name, _ in reference.named_buffers() if name.endswith("routing_bias_steps")]
    for name in biases:  # a bias of up to +-0.05 on the gate probabilities
        reference.get_buffer(name).copy_(torch.randint(-50, 50, reference.get_buffer(name).shape))
    ids = torch.randint(0, 64, (4, 16))
    ref_out = reference(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    model = AdaptiveDSForCausalLM(config(world, grouped, fine, dispatch))
    moe_adapter.prepare(model)  # DeepSpeed's MoE layers as the trainer builds them, given groups as the engine does
    for module in model.modules():
        if hasattr(module, "set_deepspeed_parallelism"):
            module.set_deepspeed_parallelism()
    num_local = reference.config.num_routed_experts // world
    local_to_global = {}
    for name, _ in model.named_parameters():
        match = EXPERT.match(name)
        local_to_global[name] = (f"{match.group(1)}{rank * num_local + int(match.group(2))}{match.group(3)}"
                                 if match else name)
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(ref_params[local_to_global[name]])
        for name in biases:
            model.get_buffer(name).copy_(reference.get_buffer(name))

    half = ids[rank * 2:(rank + 1) * 2]
    out = model(input_ids=half, labels=half)
    out.loss.backward()
    lm_loss = out.lm_loss.detach().clone()
    dist.all_reduce(lm_loss)
    torch.testing.assert_close(lm_loss / world, ref_out.lm_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if EXPERT.match(name):
            grad /= world
        else:
            dist.all_reduce(grad)
            grad /= world
        torch.testing.assert_close(grad, ref_grads[local_to_global[name]], rtol=1e-4, atol=1e-6, msg=name)
    if biases:  # each rank's loads, summed over both: the bias moves as the whole batch's loads say
        model.update_routing_bias([out.expert_counts])
        for name, load in zip(biases, ref_out.expert_counts, strict=True):
            expected = reference.get_buffer(name) + torch.sign(load.float().mean() - load.float()).long()
            assert torch.equal(model.get_buffer(name), expected), name
    print(f"rank {rank}, {case}: loss and gradients match the one-process run", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
