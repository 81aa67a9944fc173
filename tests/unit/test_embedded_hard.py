"""The embedded corpus's hard tier: its probabilities checked against hand-worked and brute-force references, its
--data name validated; and the base tier pinned (the hard tier shares its code)."""

import hashlib
import math
import random
from collections import defaultdict

import pytest

from adaptive_ds.data import build_training_data, embedded
from adaptive_ds.data.embedded import (
    DETERMINERS,
    EOS,
    HARD_DOMAIN_WEIGHTS,
    NUM_ENTITIES,
    RELATIONS,
    SYLLABLES,
    block,
    corpus_statistics,
    fact_table,
    generate_document,
    vocabulary,
)
from adaptive_ds.training.arguments import ConfigError, parse


def _hard_docs(n, seed=0):
    rng = random.Random(seed)
    return [generate_document(rng, "hard") for _ in range(n)]


def _name_probabilities(name) -> list[float]:
    """p(syllable | previous syllables) straight from the definition: entity rank r drawn with weight 1 / (r + 1)."""
    names, weight = fact_table().names, [1.0 / (r + 1) for r in range(NUM_ENTITIES)]
    probs = []
    for k in range(len(name)):
        shared = sum(w for n, w in zip(names, weight, strict=True) if n[:k] == name[:k])
        probs.append(sum(w for n, w in zip(names, weight, strict=True) if n[:k + 1] == name[:k + 1]) / shared)
    return probs


def _claim(seen: dict, state: str, token: str, probability: float) -> None:
    """Record the probability claimed for `token` in `state`; a state must claim the same one every time."""
    assert seen[state].setdefault(token, probability) == pytest.approx(probability, abs=1e-12), (state, token)


def test_a_hand_worked_document_has_the_generators_probabilities():
    # [bio] NAME REL VALUE . a OP b = ANSWER ; <eos>: one fact, then one sum, then the end
    table = fact_table()
    for doc in _hard_docs(4000, seed=2):
        t = doc.tokens
        if t[0] == "[bio]" and t[4] in RELATIONS and t[-2] == ";" and t.count(".") == 1 and t.count("=") == 1:
            break
    else:
        pytest.fail("no [bio] document with exactly one fact and one sum in 4000")
    name, relation = tuple(t[1:4]), t[4]
    value = table.facts[table.names.index(name)][relation]
    stop = t.index(".")
    assert tuple(t[5:stop]) == value  # the table's value for that entity
    a, op, b = t[stop + 1:stop + 4]
    answer = list(str(int(a) + int(b) if op == "+" else int(a) * int(b)))
    assert t[stop + 4:] == ["=", *answer, ";", EOS]
    expected = [0.4, *_name_probabilities(name), 0.4 * 1 / 5, *[1.0] * len(value), 1.0,
                # not the end, a sum (fact 0.4, prose 0.4, sum 0.2 with facts left), the first digit
                0.85 * 0.2 * 0.1, 0.5, 0.1, 1.0, *[1.0] * len(answer), 1.0, 0.15]
    assert [math.exp(lp) for lp in doc.logprobs] == pytest.approx(expected, rel=1e-9)


def test_next_token_probabilities_sum_to_one_at_sampled_states():
    # Group the next tokens by a state read from the prefix: every alternative that occurs must always get the
    # same probability (the state is a function of the prefix) and together they must sum to one (no hidden
    # choice is left out). 6000 documents show every alternative of these states.
    seen = defaultdict(dict)  # state -> token -> claimed probability
    for doc in _hard_docs(6000, seed=3):
        t, p = doc.tokens, [math.exp(lp) for lp in doc.logprobs]
        _claim(seen, "start", t[0], p[0])
        if t[0] == "[bio]":
            _claim(seen, "after the bio name", t[4], p[4])
        if t[0] == "[facts]":
            _claim(seen, "first syllable", t[1], p[1])
            for i in range(5, len(t)):
                if t[i - 1] == ";":  # the next line's first syllable (with 0.75 of going on) or the end
                    _claim(seen, "after a facts line", t[i], p[i])
    for state, claimed in seen.items():
        assert math.fsum(claimed.values()) == pytest.approx(1.0, abs=1e-9), state
    assert len(seen["after the bio name"]) == len(RELATIONS) + 10 + 10  # relations, determiners, digits
    assert seen["after the bio name"][DETERMINERS["pl"][0]] == pytest.approx(0.4 * 0.4 * 0.2)
    assert seen["after a facts line"][EOS] == pytest.approx(0.25)
    # and every name prefix in the table: its continuations' probabilities sum to one
    table = fact_table()
    for prefix in {name[:k] for name in table.names for k in range(3)}:
        total = math.fsum(table.name_probability(prefix + (s,), len(prefix)) for s in SYLLABLES
                          if prefix + (s,) in table.prefix_weight)
        assert total == pytest.approx(1.0, abs=1e-12)


def test_documents_use_the_table_and_tier_vocabulary():
    table, vocab = fact_table(), set(vocabulary("hard"))
    index = {name: i for i, name in enumerate(table.names)}
    assert len(index) == NUM_ENTITIES and len(vocab) <= 128  # one padded embedding block, as the base tier
    lines = 0
    for doc in _hard_docs(500, seed=4):
        assert set(doc.tokens) <= vocab and doc.tokens[0] in HARD_DOMAIN_WEIGHTS and doc.tokens[-1] == EOS
        if doc.tokens[0] == "[facts]":
            for line in " ".join(doc.tokens[1:-1]).split(" ;")[:-1]:
                words = line.split()
                value = table.facts[index[tuple(words[:3])]][words[3]]
                assert tuple(words[4:]) == value
                lines += 1
    assert lines > 100


def test_the_base_tier_is_unchanged():
    digest = hashlib.sha256()
    for i in range(30):
        b = block("train-7", i, 256)
        digest.update(" ".join(b.tokens).encode() + f"{sum(b.logprobs):.9f}".encode())
    assert digest.hexdigest()[:16] == "8f6017b7a7ccf83d"  # as before the hard tier was added
    assert len(vocabulary()) == 104 and vocabulary("hard")[:104] == vocabulary()


def test_hard_floor_is_below_unigram_and_stable():
    a, b = corpus_statistics(256, "s1", 300, tier="hard"), corpus_statistics(256, "s2", 300, tier="hard")
    assert 1.0 < a.entropy_floor < a.unigram_entropy
    assert abs(a.entropy_floor - b.entropy_floor) < 0.06
    assert a.entropy_floor != corpus_statistics(256, "s1", 300).entropy_floor


def test_embedded_hard_is_a_data_source_and_a_bad_tier_is_named(tiny_ds_config):
    data = build_training_data("embedded:hard", 64, seed=5, workers=0)
    assert len(data.tokenizer) == len(vocabulary("hard")) and data.statistics.entropy_floor > 1.0
    row = next(data.step_batches(0, 2))["input_ids"][0]
    assert data.tokenizer.convert_ids_to_tokens(row[: len(block("train-5", 0, 64, "hard").tokens)].tolist()) \
        == block("train-5", 0, 64, "hard").tokens
    settings, _ = parse(["--ds_config", tiny_ds_config(), "--data", "embedded:hard"], 1)
    assert settings.data == "embedded:hard"
    with pytest.raises(ConfigError) as error:
        parse(["--ds_config", tiny_ds_config(), "--data", "embedded:hardest"], 1)
    assert "unknown embedded corpus tier 'embedded:hardest'; valid choices: 'embedded', 'embedded:hard'" \
        in str(error.value)
    assert embedded.TIERS == ("base", "hard")
