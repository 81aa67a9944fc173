"""The embedded corpus: seeded documents over its vocabulary, the generator's probabilities against observed
frequencies, its entropy floor, whole documents per block, its tokenizer, and the disk cache of its figures."""

import json
import math
import random
from collections import Counter

import pytest

from adaptive_ds.data import build_training_data
from adaptive_ds.data.embedded import (
    DOMAIN_WEIGHTS,
    EOS,
    block,
    corpus_statistics,
    generate_document,
    vocabulary,
)
from adaptive_ds.data.tokenizer import embedded_tokenizer


def _docs(n, seed=0):
    rng = random.Random(seed)
    return [generate_document(rng) for _ in range(n)]


def test_documents_are_seeded_and_use_only_the_vocabulary():
    a, b = _docs(50, seed=3), _docs(50, seed=3)
    assert [d.tokens for d in a] == [d.tokens for d in b]
    vocab = set(vocabulary())
    for doc in a:
        assert set(doc.tokens) <= vocab
        assert doc.tokens[0] in DOMAIN_WEIGHTS and doc.tokens[-1] == EOS
        assert len(doc.logprobs) == len(doc.tokens) and all(lp <= 0 for lp in doc.logprobs)


def test_determined_tokens_are_correct_and_certain():
    for doc in _docs(400):
        t, lp = doc.tokens, doc.logprobs
        if t[0] == "[arith]":
            i = 1
            while t[i] != EOS:
                a, op, b, eq = t[i:i + 4]
                answer = str(int(a) + int(b) if op == "+" else int(a) * int(b))
                assert eq == "=" and "".join(t[i + 4:i + 4 + len(answer)]) == answer
                assert all(x == 0.0 for x in lp[i + 3:i + 4 + len(answer)])  # '=' and the answer are certain
                i += 5 + len(answer)
        if t[0] == "[recall]":
            memory = {}
            for i, tok in enumerate(t):
                if tok == "set":
                    memory[t[i + 1]] = t[i + 2]
                if tok == "get":
                    assert t[i + 2] == memory[t[i + 1]] and lp[i + 2] == 0.0


def test_generator_probabilities_match_observed_frequencies():
    # The first token is the domain tag: its probability is the domain weight, and the observed
    # frequencies must agree (a check that the logged probabilities are the sampling probabilities).
    docs = _docs(4000, seed=1)
    freq = Counter(d.tokens[0] for d in docs)
    for tag, weight in DOMAIN_WEIGHTS.items():
        assert abs(freq[tag] / len(docs) - weight) < 0.025
        assert all(math.isclose(math.exp(d.logprobs[0]), weight) for d in docs if d.tokens[0] == tag)
    # counting stops with probability 0.1 before every next number (documents shorter than the cap)
    counts = [d for d in docs if d.tokens[0] == "[count]"]
    stops = sum(1 for d in counts if len(d.tokens) < 32)
    steps = sum(len(d.tokens) - 3 + (1 if len(d.tokens) < 32 else 0) for d in counts)
    assert abs(stops / steps - 0.1) < 0.02


def test_floor_is_below_unigram_and_stable_across_samples():
    a, b = corpus_statistics(256, "s1", 800), corpus_statistics(256, "s2", 800)
    assert 1.0 < a.entropy_floor < a.unigram_entropy
    assert abs(a.entropy_floor - b.entropy_floor) < 0.05
    assert a.captured(a.entropy_floor) == pytest.approx(1.0)
    assert a.captured(a.unigram_entropy) == pytest.approx(0.0)


def test_a_block_holds_whole_documents_from_its_own_seed():
    first = block("train-1", 7, 64)
    assert first == block("train-1", 7, 64) and first != block("train-1", 8, 64) != block("train-2", 7, 64)
    assert len(first.tokens) <= 64 and first.tokens[0] in DOMAIN_WEIGHTS and first.tokens[-1] == EOS
    # the same documents the generator makes from that seed, cut where the next one would not fit
    rng = random.Random("train-1-7")
    tokens = []
    while len(tokens) < len(first.tokens):
        tokens += generate_document(rng).tokens
    assert tokens[: len(first.tokens)] == first.tokens and len(tokens) == len(first.tokens)
    assert len(first.logprobs) == len(first.tokens)


def test_tokenizer_round_trips_documents():
    tok = embedded_tokenizer()
    vocab = tok.get_vocab()
    for doc in _docs(20):
        text = " ".join(doc.tokens)
        assert tok(text).input_ids == [vocab[t] for t in doc.tokens]
        assert tok.decode(tok(text).input_ids) == text
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == EOS


def test_missing_data_path_is_named():
    with pytest.raises(ValueError, match="does not exist.*embedded"):
        build_training_data("/no/such/file.jsonl", 64, 0)


def test_corpus_statistics_come_from_a_disk_cache_that_survives_damage(tmp_path, monkeypatch):
    from adaptive_ds.data import embedded

    monkeypatch.setenv("ADAPTIVE_DS_CACHE", str(tmp_path))
    embedded._statistics.cache_clear()  # the in-process cache would hide the disk
    # Reference: the statistics counted by hand from the blocks themselves, not by the estimator.
    blocks = [block("cache-test", i, 64) for i in range(30)]
    predicted = [t for b in blocks for t in b.tokens[1:]]
    floor = -sum(lp for b in blocks for lp in b.logprobs[1:]) / len(predicted)
    first = corpus_statistics(64, "cache-test", 30)
    assert first.entropy_floor == pytest.approx(floor) and first.tokens == len(predicted)
    [entry] = tmp_path.glob("embedded-statistics-*.json")

    entry.write_text('{"key": {"seq_len": 64}, "value": {"entropy_floor": 0.0')  # truncated and wrong
    embedded._statistics.cache_clear()
    assert corpus_statistics(64, "cache-test", 30) == first  # recomputed, not read from the damaged entry
    assert '"entropy_floor": 0.0' not in entry.read_text()  # and repaired

    planted = json.loads(entry.read_text())
    planted["value"]["entropy_floor"] = 123.0  # a valid entry is trusted as it stands: that is the cache
    entry.write_text(json.dumps(planted))
    embedded._statistics.cache_clear()
    assert corpus_statistics(64, "cache-test", 30).entropy_floor == 123.0
    planted["key"]["source"] = "another generator"  # an entry of another generator's code is not used
    entry.write_text(json.dumps(planted))
    embedded._statistics.cache_clear()
    assert corpus_statistics(64, "cache-test", 30) == first
    embedded._statistics.cache_clear()
