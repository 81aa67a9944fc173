"""An MoE model's state_dict and initial weights are what they were before the MoE layer was split into router,
token dispatcher and experts: old checkpoints, final/ folders and the golden losses depend on the names, their order
and the random numbers drawn for them (tests/fixtures/moe_state_dict.json, recorded before the split by
tests/helpers/moe_state_snapshot.py)."""

import json

import pytest
from helpers.common import ROOT
from helpers.moe_state_snapshot import CASES, snapshot

RECORDED = json.loads((ROOT / "tests" / "fixtures" / "moe_state_dict.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_a_seed_builds_the_recorded_state_dict_names_in_order_and_values(case):
    now, recorded = snapshot(case), RECORDED[case]
    assert [t[0] for t in now["tensors"]] == [t[0] for t in recorded["tensors"]]  # names, in order
    assert now["tensors"] == recorded["tensors"]  # shapes, dtypes and the bytes of every tensor
    assert now["rng_after"] == recorded["rng_after"]  # and no random number more or fewer drawn
