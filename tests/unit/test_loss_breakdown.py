"""The loss breakdown: the generator's token kinds checked by parsing documents independently, and the categories
and statements per fact on hand-worked cases."""

import random

import pytest
from helpers.token_kinds import expected_kinds

from adaptive_ds.data.embedded import COMPUTED, COPIED, NAME, RELATIONS, Document, block
from adaptive_ds.data.embedded import generate_document as generate
from adaptive_ds.tools.loss_breakdown import category, statements_per_fact


@pytest.mark.parametrize("tier", ["base", "hard"])
def test_token_kinds_match_an_independent_parse_of_the_documents(tier):
    rng = random.Random(7)
    seen = set()
    for _ in range(400):
        doc = generate(rng, tier)
        assert len(doc.kinds) == len(doc.tokens)
        assert doc.kinds == expected_kinds(doc.tokens), " ".join(doc.tokens)
        seen.update(k.split(":")[0] for k in doc.kinds)
    assert seen == ({"", NAME, "fact", COMPUTED, COPIED} if tier == "hard" else {"", COMPUTED, COPIED})


def test_blocks_carry_their_documents_kinds():
    checked = 0
    for index in range(20):
        b = block("validation-1", index, 256, "hard")
        assert len(b.kinds) == len(b.tokens) == len(b.logprobs)
        if b.tokens[-1] != "<eos>":
            continue  # a first document longer than the block, cut
        start = 0
        for i, t in enumerate(b.tokens):
            if t == "<eos>":
                assert b.kinds[start:i + 1] == expected_kinds(b.tokens[start:i + 1])
                start, checked = i + 1, checked + 1
    assert checked > 20


def test_categories_hand_worked():
    assert category("fact:0", 0.0) == "fact value, entity rank 1-16"
    assert category("fact:15", 0.0) == "fact value, entity rank 1-16"
    assert category("fact:16", 0.0) == "fact value, entity rank 17-256"
    assert category("fact:2047", 0.0) == "fact value, entity rank 257-2048"
    assert category(NAME, -2.0) == "entity name (Zipf draw)"
    assert category(COMPUTED, 0.0) == "computed digit (sum, product)"
    assert category(COPIED, 0.0) == "copied value (recall)"
    assert category("", 0.0) == "other, determined (p = 1)"
    assert category("", -0.1) == "other, uncertain"
    with pytest.raises(ValueError, match="outside the table"):
        category("fact:2048", 0.0)
    with pytest.raises(ValueError, match="unknown token kind"):
        category("spam", 0.0)


def test_statements_per_fact_hand_worked():
    # entity 3 stated three times (two runs of its kind split by a relation token, then a 2-token value right after
    # entity 20's in a second block), entity 20 twice (once in each block)
    docs = [Document(list("abcdefg"), [0.0] * 7, ["", "fact:3", "fact:3", "", "fact:3", "fact:20", ""]),
            Document(list("abc"), [0.0] * 3, ["fact:20", "fact:3", "fact:3"])]
    got = statements_per_fact(docs)
    assert got["fact value, entity rank 1-16"] == pytest.approx(3 / (16 * len(RELATIONS)))
    assert got["fact value, entity rank 17-256"] == pytest.approx(2 / (240 * len(RELATIONS)))
    assert got["fact value, entity rank 257-2048"] == 0.0
