"""The grouped GEMM's stacked expert weights under DeepSpeed's engine: MoE param groups hold whole layers, a weight
alone in its param group still trains, the experts are viewed where the engine keeps them, and a packed engine
writes DeepSpeed's per-expert checkpoint files and resumes from them."""

import json
from pathlib import Path

import deepspeed
import pytest
import torch
from helpers.common import tiny_config, write_ds_config
from helpers.expert_weights import PROJECTIONS, expert_modules, projection_weights, weight_storages

from adaptive_ds import distributed
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models.expert_layout import stacked_weights
from adaptive_ds.models.moe import MoEFeedForward
from adaptive_ds.training import moe_adapter
from adaptive_ds.training.optim import parameter_groups


def _engine_losses(tmp_path: Path, grouped_gemm: str, zero_stage: int) -> tuple[list[float], bool]:
    """Losses of 3 steps through DeepSpeed's engine; and whether the grouped GEMM viewed the experts' weights where
    the engine keeps them after each forward and backward: ZeRO's flat bit16 buffers (its step points the
    parameters back into them, so a repack would show only before it), or without ZeRO, where fp32 parameters
    are the torch optimizer's own, the buffer they were packed into (one per projection)."""
    distributed.init_distributed()
    torch.manual_seed(0)
    model = AdaptiveDSForCausalLM(tiny_config("moe", moe_grouped_gemm=grouped_gemm))
    config = json.loads(Path(write_ds_config(tmp_path, zero_stage=zero_stage)).read_text())
    del config["adaptive_ds"]
    moe_adapter.prepare(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.1), config=config)
    flat = {t.untyped_storage().data_ptr() for t in getattr(engine.optimizer, "bit16_groups_flat", [])}
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]

    def viewed_in_place(layer, weights):
        where = set(weight_storages(layer))
        return ((where <= flat if zero_stage else len(where) == 3)
                and stacked_weights(weights).data_ptr() == weights[0].data_ptr())

    viewed, losses = [], []
    ids = torch.randint(2, 64, (2, 16))  # the same batch each step: its loss falls only if the weights train
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        viewed.append(all(viewed_in_place(layer, projection_weights(layer, name))
                          for layer in layers for name in PROJECTIONS))
        engine.step()
        losses.append(loss.item())
    return losses, all(viewed)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_under_deepspeeds_engine_the_experts_are_viewed_where_it_keeps_them_and_train_as_per_expert_matmuls(
        tmp_path, zero_stage):
    grouped, viewed = _engine_losses(tmp_path, "always", zero_stage)
    per_expert, _ = _engine_losses(tmp_path, "never", zero_stage)
    assert viewed
    assert grouped == pytest.approx(per_expert, rel=1e-5)
    assert grouped[-1] < grouped[0]


@pytest.mark.slow
def test_a_packed_engine_writes_deepspeeds_per_expert_files_and_resumes_from_them(tmp_path, tiny_config,
                                                                                  tiny_ds_config):
    distributed.init_distributed()
    config = json.loads(Path(tiny_ds_config(zero_stage=0)).read_text())
    del config["adaptive_ds"]
    engines = []
    for _ in range(2):
        model = AdaptiveDSForCausalLM(tiny_config("moe", moe_grouped_gemm="always"))
        moe_adapter.prepare(model)
        engines.append(deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.1),
                                            config=config)[0])
    trained, resumed = engines
    ids = torch.randint(2, 64, (2, 16))
    for _ in range(2):  # the first forward packs the experts' weights
        trained.backward(trained(input_ids=ids, labels=ids).loss)
        trained.step()
    trained.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    files = sorted(p.name for p in (tmp_path / "ckpt" / "t").glob("layer_*_expert_*_mp_rank_00_model_states.pt"))
    assert len(files) == 2 * 4  # one file per layer and global expert
    expert = torch.load(tmp_path / "ckpt" / "t" / files[0], weights_only=False)
    assert all(k.split("deepspeed_experts.")[1].startswith("0.") for k in expert)
    assert sum(v.untyped_storage().nbytes() for v in expert.values()) == sum(v.nbytes for v in expert.values())
    resumed.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    for a, b in zip(trained.module.state_dict().values(), resumed.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    losses = []
    for engine in engines:  # the optimizer state resumed too: the next step is the same
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(engine(input_ids=ids, labels=ids).loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


@pytest.mark.parametrize("layers_per_cap", [2.5, 0.5])
def test_moe_param_groups_hold_whole_layers_so_zero_keeps_each_layers_experts_at_one_stride(layers_per_cap, tiny_config,
                                                                                           tiny_ds_config):
    """DeepSpeed's own cap on an MoE param group cuts a layer's experts wherever it falls, and ZeRO's flat buffers
    then leave the cut layer's weights at two strides (a copy on every forward); `parameter_groups` closes groups
    at layer boundaries instead, unless one layer's experts alone exceed the cap (DeepSpeed's cut is kept)."""
    distributed.init_distributed()
    model = AdaptiveDSForCausalLM(tiny_config("moe", num_hidden_layers=4, moe_grouped_gemm="always"))
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    per_layer = sum(p.numel() for p in expert_modules(layers[0]).parameters())
    cap = int(per_layer * layers_per_cap)
    config = json.loads(Path(tiny_ds_config(zero_stage=1)).read_text())
    del config["adaptive_ds"]
    moe_adapter.prepare(model)
    groups = parameter_groups(model, 0.1, moe_group_cap=cap)
    moe_groups = [sum(p.numel() for p in g["params"]) for g in groups if g.get("moe")]
    if layers_per_cap > 1:  # 2 layers a group (DeepSpeed's cut at 2.5 layers would split the third)
        assert moe_groups == [2 * per_layer, 2 * per_layer]
    else:  # a layer is larger than the cap: DeepSpeed's own split, at most the cap each
        assert max(moe_groups) <= cap and sum(moe_groups) == 4 * per_layer
    deepspeed.initialize(model=model, model_parameters=groups, config=config)
    viewed = [stacked_weights(w).data_ptr() == w[0].data_ptr()
              for layer in layers for w in (projection_weights(layer, name) for name in PROJECTIONS)]
    assert all(viewed) if layers_per_cap > 1 else not all(viewed)


def test_a_weight_alone_in_its_param_group_stays_in_the_bf16_optimizers_buffer_and_trains(tiny_config, tiny_ds_config):
    """DeepSpeed's BF16_Optimizer (ZeRO-1) flattens each param group into a buffer of exactly its size and never
    points parameters back into it: a weight alone in its group then looks as if it owned its storage. Packing
    it in the forward would leave the optimizer updating a buffer the model no longer reads."""
    distributed.init_distributed()
    config = json.loads(Path(tiny_ds_config(zero_stage=1)).read_text())
    del config["adaptive_ds"]
    config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    torch.manual_seed(0)
    model = AdaptiveDSForCausalLM(tiny_config("moe", moe_grouped_gemm="always"))
    moe_adapter.prepare(model)
    groups = parameter_groups(model, 0.1, moe_group_cap=32 * 64)  # one expert weight a group
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    flat = {t.untyped_storage().data_ptr() for t in engine.optimizer.bf16_groups_flat}
    layer = next(m for m in model.modules() if isinstance(m, MoEFeedForward))
    weights = projection_weights(layer, "gate_proj")
    before = weights[0].detach().clone()
    stacked_weights(weights, layer.experts.may_pack)  # what the grouped GEMM's forward calls
    assert all(w.untyped_storage().data_ptr() in flat for w in weights)
    ids = torch.randint(2, 64, (2, 16))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    assert not torch.equal(before, weights[0].detach())  # the weights the forward reads are the ones trained
