"""The Hub model card, and a failed push reported instead of raised."""


from helpers.local_hub import LocalHub

from adaptive_ds.export.hub import HubPusher, model_card


def test_model_card_without_optional_figures():
    card = model_card({"arch": "dense", "preset": "b1"}, "train.py --preset b1")
    assert "| validation loss | n/a |" in card and "train.py --preset b1" in card


def test_model_card_says_torch_and_transformers_suffice_to_load():
    """Its loading code is run where neither deepspeed nor adaptive_ds is installed by
    tests/integration/test_final.py."""
    card = model_card({"arch": "moe", "preset": "debug"}, "train.py")
    assert "needs torch and transformers only (no deepspeed, no adaptive_ds)" in card
    assert "AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)" in card
    assert "deepspeed must" not in card


def test_pusher_reports_instead_of_raising(tmp_path):
    pusher = HubPusher("me/y", LocalHub(tmp_path, fail=True))
    (tmp_path / "folder").mkdir()
    assert pusher.push(str(tmp_path / "folder"), "card", "msg") is False
    assert pusher.failures == ["msg: ConnectionError: hub unreachable"] and pusher.pushed == []
