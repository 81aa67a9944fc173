"""The loss breakdown command: the model's per-token losses against the model's own HF loss, exposure counts on the
blocks training reads, a report published only when told, and bad input refused in one line."""

import json
import os
from collections import defaultdict

import pytest
import torch
from helpers.common import ROOT
from helpers.token_kinds import expected_kinds

from adaptive_ds.data import build_training_data, validation_namespace
from adaptive_ds.data.embedded import COMPUTED, COPIED, NAME, RELATIONS, block
from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.presets import model_config
from adaptive_ds.tools.loss_breakdown import CATEGORIES, breakdown


# the categories by hand, from the generator's labels of each predicted token (kinds[1:], aligned with targets)
def _hand_category(kind: str, logprob: float) -> str:
    if kind.startswith("fact:"):
        rank = int(kind[5:]) + 1
        return ("fact value, entity rank 1-16" if rank <= 16 else "fact value, entity rank 17-256" if rank <= 256
                else "fact value, entity rank 257-2048")
    return {NAME: "entity name (Zipf draw)", COMPUTED: "computed digit (sum, product)",
            COPIED: "copied value (recall)"}.get(kind, "other, determined (p = 1)" if logprob == 0
                                                  else "other, uncertain")


@pytest.mark.parametrize("arch", ["dense", "moe", "mod", "hybrid"])
def test_breakdown_losses_are_the_models_own_per_token_losses(tmp_path, arch):
    """Each category's tokens, floor and model loss equal those grouped by hand from the model's per-token losses,
    each block run alone and unpadded (the breakdown pads short blocks in batches, which must not change a real
    token's loss: causal attention, causal MoD routing, dropless MoE in eval)."""
    torch.manual_seed(0)
    tokenizer = embedded_tokenizer("hard")
    model = AdaptiveDSForCausalLM(model_config("debug", arch, len(tokenizer), moe_drop_tokens=False))
    folder = tmp_path / arch
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    blocks = [block(validation_namespace(5), i, 256, "hard") for i in range(20)]
    assert len({len(b.tokens) for b in blocks}) > 1  # some are short: padding is exercised
    model = AdaptiveDSForCausalLM.from_pretrained(folder).eval()
    expected = defaultdict(lambda: [0, 0.0, 0.0])  # category -> tokens, floor, model
    total, count = 0.0, 0
    with torch.no_grad():
        for b in blocks:
            ids = torch.tensor([tokenizer.convert_tokens_to_ids(b.tokens)])
            out = model(input_ids=ids, labels=ids)
            nll = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:], reduction="none")
            for kind, logprob, loss in zip(b.kinds[1:], b.logprobs[1:], nll.tolist(), strict=True):
                e = expected[_hand_category(kind, logprob)]
                e[0], e[1], e[2] = e[0] + 1, e[1] - logprob, e[2] + loss
            if arch in ("dense", "mod"):  # the MoE archs' HF loss adds the router's aux loss
                assert out.loss.item() == pytest.approx(nll.mean().item(), rel=1e-6)
            total += nll.sum().item()
            count += len(b.tokens) - 1
    report = breakdown({"m": str(folder)}, seed=5, num_blocks=20, train_tokens=2560)
    assert report["tokens"] == count
    assert report["totals"]["m"]["loss"] == pytest.approx(total / count, rel=1e-5)
    assert set(expected) <= set(report["categories"]) and list(report["categories"]) == list(CATEGORIES)
    for name, entry in report["categories"].items():
        tokens, floor, loss = expected.get(name, (0, 0.0, 0.0))
        assert entry["tokens"] == tokens, name
        if tokens:
            assert entry["floor"] == pytest.approx(floor / tokens, abs=1e-12), name
            assert entry["models"]["m"]["loss"] == pytest.approx(loss / tokens, rel=1e-5), name
    contributions = sum(c["models"]["m"]["contribution"] for c in report["categories"].values())
    assert contributions == pytest.approx(report["totals"]["m"]["loss"] - report["totals"]["m"]["floor"], rel=1e-9)


def test_exposures_are_counted_on_the_blocks_training_reads(tmp_path):
    """Statements per fact in a run's first N tokens, from the ids the training data really serves (its samples,
    read in order), parsed independently; the token budget read from the run's summary.json."""
    seq_len, seed, tokens = 256, 5, 40 * 256
    data = build_training_data("embedded:hard", seq_len, seed)
    statements = defaultdict(int)
    for index in range(tokens // seq_len):
        stream = data.tokenizer.convert_ids_to_tokens(list(data.sample(index)))
        assert stream[-1] == "<eos>"  # whole documents: the parser needs them
        start = 0
        for i, t in enumerate(stream):
            if t == "<eos>":
                doc = stream[start:i + 1]
                kinds = expected_kinds(doc)
                for j, kind in enumerate(kinds):
                    if kind.startswith("fact:") and doc[j - 1] in RELATIONS:  # a value's first token
                        statements[_hand_category(kind, 0.0)] += 1
                start = i + 1
    assert sum(statements.values()) > 20
    tokenizer = embedded_tokenizer("hard")
    run = tmp_path / "run"
    AdaptiveDSForCausalLM(model_config("debug", "dense", len(tokenizer))).save_pretrained(run / "final")
    tokenizer.save_pretrained(run / "final")
    (run / "summary.json").write_text(json.dumps({"tokens_seen": tokens}))
    report = breakdown({"m": str(run / "final")}, seed=seed, num_blocks=2)
    assert report["train_tokens"] == tokens
    sizes = {"fact value, entity rank 1-16": 16, "fact value, entity rank 17-256": 240,
             "fact value, entity rank 257-2048": 1792}
    for name, size in sizes.items():
        assert report["statements_per_fact"][name] == pytest.approx(statements[name] / (size * len(RELATIONS)))


def test_bad_input_is_one_line(tmp_path, capsys):
    """Each refused in one line before anything loads (the command's main, run in this process: the same exits
    `python -m adaptive_ds.tools.loss_breakdown` ends with)."""
    from adaptive_ds.tools.loss_breakdown import main

    def refused(*argv) -> tuple[object, str]:
        with pytest.raises(SystemExit) as exit_:
            main(list(argv))
        return exit_.value.code, capsys.readouterr().err

    code, _ = refused("--models", f"dense={tmp_path / 'nowhere'}", "--seed", "1")
    assert code == (f"loss_breakdown: --models dense={tmp_path / 'nowhere'}: no such folder (give a trained run's "
                    "final/ folder)")
    code, err = refused("--models", "dense", "--seed", "1")
    assert code == 2 and "expected NAME=FOLDER" in err
    code, _ = refused("--models", f"a={tmp_path}", f"a={tmp_path}", "--seed", "1")
    assert code == "loss_breakdown: each --models NAME must be unique, got a, a"
    code, _ = refused("--models", f"a={tmp_path}", "--seed", "1", "--blocks", "0")
    assert code == "loss_breakdown: --blocks must be at least 1, got 0"


def test_the_breakdown_is_published_only_when_told(tmp_path, monkeypatch):
    """A JSON report under the runs directory by default, BENCHMARKS.md and benchmarks/ untouched; --out and
    --benchmarks_md publish it, the section (keyed by --name) rendered from the report alone."""
    import re

    from adaptive_ds.tools.loss_breakdown import main, markdown

    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    name = "throughput_debug_cpu.json"
    (tmp_path / "benchmarks" / name).write_bytes((ROOT / "benchmarks" / name).read_bytes())
    (tmp_path / "BENCHMARKS.md").write_bytes((ROOT / "BENCHMARKS.md").read_bytes())
    before = (tmp_path / "BENCHMARKS.md").read_bytes(), (tmp_path / "benchmarks" / name).read_bytes()
    tokenizer = embedded_tokenizer("hard")
    AdaptiveDSForCausalLM(model_config("debug", "dense", len(tokenizer))).save_pretrained("model")
    tokenizer.save_pretrained("model")
    argv = ["--models", "dense=model", "--seed", "5", "--blocks", "2", "--train_tokens", "512"]
    main(argv)
    assert ((tmp_path / "BENCHMARKS.md").read_bytes(), (tmp_path / "benchmarks" / name).read_bytes()) == before
    assert os.listdir(tmp_path / "benchmarks") == [name]
    report = json.loads((tmp_path / "runs" / "loss_breakdown" / "loss-breakdown_256_hard.json").read_text())
    assert report["command"] == "python -m adaptive_ds.tools.loss_breakdown " + " ".join(argv)
    assert report["models"] == {"dense": "model"} and report["blocks"] == 2

    main([*argv, "--name", "mine", "--out", "benchmarks", "--benchmarks_md", "BENCHMARKS.md"])
    published = json.loads((tmp_path / "benchmarks" / "loss-breakdown_256_hard_mine.json").read_text())
    text = (tmp_path / "BENCHMARKS.md").read_text()
    section = re.search(r"<!-- loss-breakdown:256:hard:mine -->\n(.*)\n<!-- /loss-breakdown:256:hard:mine -->",
                        text, flags=re.S).group(1)
    assert section == markdown(published) and "--name mine" in section
    total = published["totals"]["dense"]
    assert f"| {total['loss'] - total['floor']:.4f} (loss {total['loss']:.4f}) |" in section
    assert (tmp_path / "benchmarks" / name).read_bytes() == before[1]
