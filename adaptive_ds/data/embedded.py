"""The embedded corpus: documents from a small probabilistic grammar whose true entropy is known.

Every document is a sequence of word tokens produced by a generator in which each token is one explicit
choice, and the generator state after any prefix is a function of that prefix alone (every token sequence
has exactly one derivation). So the probability the generator assigned to each token *is* the true
conditional probability p(token | document prefix), and the mean negative log-probability over the
predicted tokens is the lowest cross-entropy any model can reach: the corpus's entropy floor.

Two tiers. The base tier (``--data embedded``) has four domains, which give experts something to specialise on
and MoD something to route:
  - ``[prose]``: sentences with number agreement between subject and verb (long-range, uncertain tokens);
  - ``[arith]``: single-digit sums and products whose answers are determined (tokens that need computation);
  - ``[recall]``: key-value pairs, then queries whose values must be copied from context (induction);
  - ``[count]``: counting modulo 10 (easy, almost deterministic tokens).

The hard tier (``--data embedded:hard``) adds a fixed table of facts that must be memorised, so that capacity
pays, and dependencies over tens of tokens:
  - ``[facts]``: lines ``NAME RELATION VALUE ;`` about entities drawn Zipf-distributed from the table;
  - ``[bio]``: one entity's name, then clauses in random order: its facts (``RELATION VALUE .``, the entity
    carried from the start of the document), prose sentences and sums, so that certain, memorised, computed and
    uncertain tokens alternate within one document;
  - ``[recall]``: the base tier's pairs and queries with prose sentences between them;
  - ``[arith]`` and ``[count]`` as in the base tier.
The table (`fact_table`) is generated from a fixed seed of its own, so every run, rank and split shares it.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from functools import lru_cache

from .disk_cache import cached_json, source_digest

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)

DOMAIN_WEIGHTS = {"[prose]": 0.4, "[arith]": 0.2, "[recall]": 0.2, "[count]": 0.2}
DIGITS = tuple(str(d) for d in range(10))

# Prose: (singular, plural) pairs, so subject number fixes the verb form.
DETERMINERS = {"sg": ("a", "the", "this", "every", "one"), "pl": ("some", "these", "many", "all", "two")}
NOUNS = (("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("child", "children"), ("farmer", "farmers"),
         ("teacher", "teachers"), ("river", "rivers"), ("tree", "trees"), ("house", "houses"),
         ("king", "kings"), ("ship", "ships"), ("garden", "gardens"))
ADJECTIVES = ("old", "young", "small", "big", "red", "green", "quiet", "happy")
INTRANSITIVE = (("sleeps", "sleep"), ("runs", "run"), ("waits", "wait"), ("sings", "sing"), ("falls", "fall"))
TRANSITIVE = (("sees", "see"), ("likes", "like"), ("follows", "follow"), ("finds", "find"),
              ("builds", "build"), ("watches", "watch"))
PREPOSITIONS = ("near", "under", "behind", "with")
KEYS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu")

MAX_PAIRS, MAX_QUERIES, MAX_COUNT = 6, 6, 30

# The hard tier. Entity names are NAME_LENGTH syllables: fixed length makes the names prefix-free, so a name's
# tokens are read back unambiguously and the state after any prefix is still a function of the prefix.
HARD_DOMAIN_WEIGHTS = {"[bio]": 0.4, "[facts]": 0.25, "[recall]": 0.15, "[arith]": 0.1, "[count]": 0.1}
SYLLABLES = ("ba", "de", "fi", "go", "hu", "ka", "lo", "mi", "nu", "pe", "ri", "so", "tu", "va", "we", "zo")
NAME_LENGTH, NUM_ENTITIES = 3, 2048
FACT_TABLE_SEED = "embedded-hard-facts-v1"  # not the run's seed: train and validation share one table
# Each relation's values: pet a singular noun, trait an adjective, home a key, born two digits, friend an entity.
RELATIONS = ("pet", "trait", "home", "born", "friend")
BIO_CLAUSES = {"fact": 0.4, "prose": 0.4, "arith": 0.2}  # renormalised once every fact is stated
P_BIO_END, P_FACTS_END, P_FILLER_END, MAX_FILLER = 0.15, 0.25, 0.4, 4

TIERS = ("base", "hard")


def vocabulary(tier: str = "base") -> list[str]:
    """Every token the tier's grammar can emit, in a fixed order (special tokens first). The hard tier's
    vocabulary extends the base tier's, which keeps its ids."""
    words = list(SPECIAL_TOKENS) + list(DOMAIN_WEIGHTS) + list(DIGITS)
    words += [w for pair in DETERMINERS.values() for w in pair]
    words += [w for pair in NOUNS for w in pair] + list(ADJECTIVES)
    words += [w for pair in INTRANSITIVE + TRANSITIVE for w in pair] + list(PREPOSITIONS)
    words += [".", "+", "*", "=", ";", "set", "get"] + list(KEYS)
    if tier == "hard":
        words += [tag for tag in HARD_DOMAIN_WEIGHTS if tag not in DOMAIN_WEIGHTS] + list(SYLLABLES) + list(RELATIONS)
    assert len(words) == len(set(words)), "grammar tokens must be unique for derivations to be unique"
    return words


def _zipf(n: int) -> list[float]:
    weights = [1.0 / (rank + 1) for rank in range(n)]
    total = sum(weights)
    return [w / total for w in weights]


# What a token is, where the grammar knows (`Document.kinds`), for breaking a model's loss down by what it must
# do there (`adaptive_ds.tools.loss_breakdown`). Every other token is "" (prose, tags, punctuation, relations, counts).
NAME, FACT, COMPUTED, COPIED = "name", "fact", "computed", "copied"


@dataclass
class Document:
    tokens: list[str]
    logprobs: list[float]  # natural-log p(token | prefix) under the generator, one per token
    # per token: NAME (an entity's syllables), FACT (a fact's value, memorised: "fact" + the entity's Zipf rank
    # from 0, e.g. "fact:17"), COMPUTED (a sum's or product's digits), COPIED (a recall value read back), or ""
    kinds: list[str]


class _Emitter:
    """Collects tokens, each with the log-probability of every choice made since the previous token.

    Hidden choices (`branch`) are folded into the next emitted token: the grammar is built so the next token
    always reveals them, which makes the product the true conditional probability of that token.
    """

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.tokens: list[str] = []
        self.logprobs: list[float] = []
        self.kinds: list[str] = []
        self._pending = 0.0

    def emit(self, token: str, prob: float = 1.0, kind: str = "") -> None:
        self.tokens.append(token)
        self.logprobs.append(self._pending + math.log(prob))
        self.kinds.append(kind)
        self._pending = 0.0

    def branch(self, p_true: float) -> bool:
        taken = self.rng.random() < p_true
        self._pending += math.log(p_true if taken else 1.0 - p_true)
        return taken

    def choose(self, probs: list[float]) -> int:
        """A hidden choice among len(probs) alternatives, folded into the next token like `branch`."""
        i = self.rng.choices(range(len(probs)), weights=probs)[0]
        self._pending += math.log(probs[i])
        return i

    def pick(self, options, probs=None) -> int:
        """Emit one of `options`, uniformly unless `probs` is given; returns the index."""
        probs = probs or [1.0 / len(options)] * len(options)
        i = self.rng.choices(range(len(options)), weights=probs)[0]
        self.emit(options[i], probs[i])
        return i


_NOUN_P, _ADJ_P = _zipf(len(NOUNS)), _zipf(len(ADJECTIVES))
_INTRANS_P, _TRANS_P = _zipf(len(INTRANSITIVE)), _zipf(len(TRANSITIVE))


def _noun_phrase(e: _Emitter, form: int) -> None:
    """DET (ADJ)? NOUN, singular (form 0) or plural (form 1)."""
    e.pick(DETERMINERS["sg" if form == 0 else "pl"])
    if e.branch(0.3):
        e.pick(ADJECTIVES, _ADJ_P)
    e.pick([pair[form] for pair in NOUNS], _NOUN_P)


def _prose(e: _Emitter) -> None:
    while True:
        _sentence(e)
        if e.branch(0.25):
            return


def _sentence(e: _Emitter) -> None:
    """One sentence, from its determiner to its full stop."""
    subject = 0 if e.branch(0.6) else 1
    _noun_phrase(e, subject)
    if e.branch(0.4):
        e.pick([pair[subject] for pair in INTRANSITIVE], _INTRANS_P)  # verb agrees with the subject
        p_prep = 0.3
    else:
        e.pick([pair[subject] for pair in TRANSITIVE], _TRANS_P)
        _noun_phrase(e, 0 if e.branch(0.5) else 1)
        p_prep = 0.4
    if e.branch(p_prep):
        e.pick(PREPOSITIONS)
        _noun_phrase(e, 0 if e.branch(0.5) else 1)
    e.emit(".")


def _arith(e: _Emitter) -> None:
    while True:
        _equation(e)
        if e.branch(0.3):
            return


def _equation(e: _Emitter) -> None:
    a = e.pick(DIGITS)
    op = e.pick(("+", "*"))
    b = e.pick(DIGITS)
    e.emit("=")
    for digit in str(a + b if op == 0 else a * b):
        e.emit(digit, kind=COMPUTED)  # determined by the operands: a token that needs computation
    e.emit(";")


def _recall(e: _Emitter) -> None:
    _queries(e, _pairs(e))


def _pairs(e: _Emitter) -> dict[str, str]:
    memory: dict[str, str] = {}
    while True:
        e.emit("set")
        unused = [k for k in KEYS if k not in memory]
        key = unused[e.pick(unused)]
        memory[key] = DIGITS[e.pick(DIGITS)]
        if len(memory) >= MAX_PAIRS or (len(memory) >= 2 and not e.branch(0.55)):
            return memory


def _queries(e: _Emitter, memory: dict[str, str]) -> None:
    keys = list(memory)
    for query in range(MAX_QUERIES):
        e.emit("get")
        key = keys[e.pick(keys)]
        e.emit(memory[key], kind=COPIED)  # copied from context
        if query + 1 == MAX_QUERIES or e.branch(0.4):
            return


def _count(e: _Emitter) -> None:
    value = e.pick(DIGITS)
    for _ in range(MAX_COUNT - 1):
        if e.branch(0.1):
            return
        value = (value + 1) % 10
        e.emit(DIGITS[value])


@dataclass(frozen=True)
class FactTable:
    """The hard tier's facts: entity i (its Zipf rank) has the name `names[i]` and `facts[i][relation]`."""

    names: tuple[tuple[str, ...], ...]  # NAME_LENGTH syllables each, all distinct
    facts: tuple[dict[str, tuple[str, ...]], ...]  # relation -> the value's tokens
    cum_weights: tuple[float, ...]  # cumulative Zipf probabilities by rank, for drawing an entity
    prefix_weight: dict[tuple[str, ...], float]  # name prefix -> probability that a drawn name starts with it

    def name_probability(self, name: tuple[str, ...], position: int) -> float:
        """p(name[position] | name[:position]) when the entity is drawn by Zipf rank: the weight of the names
        that continue the prefix that way over the weight of those that share the prefix."""
        return self.prefix_weight[name[: position + 1]] / self.prefix_weight[name[:position]]


@lru_cache(maxsize=1)
def fact_table() -> FactTable:
    """The fixed table, from `FACT_TABLE_SEED` alone: the same in every run, rank, split and process."""
    rng = random.Random(FACT_TABLE_SEED)
    codes = rng.sample(range(len(SYLLABLES) ** NAME_LENGTH), NUM_ENTITIES)
    names = tuple(tuple(SYLLABLES[code // len(SYLLABLES) ** k % len(SYLLABLES)] for k in range(NAME_LENGTH))
                  for code in codes)
    facts = []
    for i in range(NUM_ENTITIES):
        friend = rng.randrange(NUM_ENTITIES - 1)
        born = rng.randrange(100)
        facts.append({"pet": (NOUNS[rng.randrange(len(NOUNS))][0],), "trait": (rng.choice(ADJECTIVES),),
                      "home": (rng.choice(KEYS),), "born": (DIGITS[born // 10], DIGITS[born % 10]),
                      "friend": names[friend + (friend >= i)]})  # anyone but oneself
    probs = _zipf(NUM_ENTITIES)
    prefix_weight: dict[tuple[str, ...], list[float]] = {}
    for name, p in zip(names, probs, strict=True):
        for k in range(NAME_LENGTH + 1):
            prefix_weight.setdefault(name[:k], []).append(p)
    return FactTable(names, tuple(facts), tuple(itertools.accumulate(probs)),
                     {prefix: math.fsum(ps) for prefix, ps in prefix_weight.items()})


def _entity(e: _Emitter, table: FactTable) -> int:
    """Draw an entity by Zipf rank and emit its name, one syllable at a time with its conditional probability."""
    entity = e.rng.choices(range(NUM_ENTITIES), cum_weights=table.cum_weights)[0]
    name = table.names[entity]
    for position, syllable in enumerate(name):
        e.emit(syllable, table.name_probability(name, position), NAME)
    return entity


def _fact(e: _Emitter, table: FactTable, entity: int, relations: list[str]) -> str:
    """RELATION VALUE: the relation drawn uniformly from `relations`, the value the table's (certain)."""
    relation = relations[e.pick(relations)]
    for token in table.facts[entity][relation]:
        e.emit(token, kind=f"{FACT}:{entity}")
    return relation


def _facts(e: _Emitter) -> None:
    table = fact_table()
    while True:
        _fact(e, table, _entity(e, table), list(RELATIONS))
        e.emit(";")
        if e.branch(P_FACTS_END):
            return


def _bio(e: _Emitter) -> None:
    """An entity, then clauses until the end: each of its facts at most once (its value needs the entity, stated
    tens of tokens before, and the table), prose sentences and sums. Every clause kind begins with tokens of its
    own (a relation, a determiner, a digit), so the next token reveals the hidden choice of clause."""
    table = fact_table()
    entity = _entity(e, table)
    unstated = list(RELATIONS)
    while True:
        kinds = [kind for kind in BIO_CLAUSES if kind != "fact" or unstated]
        weights = [BIO_CLAUSES[kind] for kind in kinds]
        kind = kinds[e.choose([w / sum(weights) for w in weights])]
        if kind == "fact":
            unstated.remove(_fact(e, table, entity, unstated))
            e.emit(".")
        elif kind == "prose":
            _sentence(e)
        else:
            _equation(e)
        if e.branch(P_BIO_END):
            return


def _recall_far(e: _Emitter) -> None:
    """The base tier's recall with 1 to MAX_FILLER prose sentences between the pairs and the queries."""
    memory = _pairs(e)
    for filler in range(MAX_FILLER):
        _sentence(e)
        if filler + 1 == MAX_FILLER or e.branch(P_FILLER_END):
            break
    _queries(e, memory)


_DOMAINS = {
    "base": ({"[prose]": _prose, "[arith]": _arith, "[recall]": _recall, "[count]": _count}, DOMAIN_WEIGHTS),
    "hard": ({"[bio]": _bio, "[facts]": _facts, "[recall]": _recall_far, "[arith]": _arith, "[count]": _count},
             HARD_DOMAIN_WEIGHTS),
}


def generate_document(rng: random.Random, tier: str = "base") -> Document:
    """One document: a domain tag, the domain's tokens, then EOS (whose probability closes the last choice)."""
    domains, weights = _DOMAINS[tier]
    e = _Emitter(rng)
    tags = list(weights)
    domain = tags[e.pick(tags, list(weights.values()))]
    domains[domain](e)
    e.emit(EOS)
    return Document(e.tokens, e.logprobs, e.kinds)


def block(namespace: str, index: int, seq_len: int, tier: str = "base") -> Document:
    """Block `index` of the stream `namespace`: whole documents from a generator seeded by (namespace, index)
    until the next one would not fit (that one is discarded; a first document longer than the block is cut).

    Each block depends on its index alone, so any block is generated in constant time: a data position is a
    number, resuming is a seek, and a global batch can be defined by sample indices whatever the number of
    ranks. The tokens and log-probabilities of the kept documents are exactly the generator's.
    """
    rng = random.Random(f"{namespace}-{index}")
    out = Document([], [], [])
    while True:
        doc = generate_document(rng, tier)
        if out.tokens and len(out.tokens) + len(doc.tokens) > seq_len:
            return out
        room = seq_len - len(out.tokens)
        out.tokens += doc.tokens[:room]
        out.logprobs += doc.logprobs[:room]
        out.kinds += doc.kinds[:room]
        if len(out.tokens) == seq_len:
            return out


@dataclass(frozen=True)
class CorpusStatistics:
    """What the corpus allows on blocks packed to `seq_len`, estimated on `tokens` predicted tokens."""

    entropy_floor: float  # nats/token: the true conditional entropy, the lowest reachable loss
    unigram_entropy: float  # nats/token: the loss of a model that knows only token frequencies
    tokens: int

    def captured(self, loss: float) -> float:
        """Share of the learnable structure captured at `loss`: (unigram - loss) / (unigram - floor)."""
        return (self.unigram_entropy - loss) / (self.unigram_entropy - self.entropy_floor)


def describe_captured(captured: float, short: bool = False) -> str:
    """A captured share as the logs write it: below 0 (a loss still above the unigram entropy, early in a run or in
    a short one) it says what that means rather than leave a negative share of structure to be puzzled over."""
    if captured >= 0:
        return f"captured {100 * captured:.1f}%" + ("" if short else " of the learnable structure")
    if short:
        return f"captured {100 * captured:.1f}%: loss above the unigram entropy"
    return (f"captured {100 * captured:.1f}% of the learnable structure (below 0: the loss is still above the "
            "unigram entropy, what knowing only the token frequencies reaches)")


def corpus_statistics(seq_len: int, namespace: str, num_blocks: int = 2000, tier: str = "base") -> CorpusStatistics:
    """Entropy floor and unigram entropy over the tokens a model predicts in the blocks of `namespace`.

    Blocks hold whole documents (`block`), so each predicted token has its whole document prefix in context
    and the generator's probabilities are exactly what a perfect model assigns. The first token of a block is
    never predicted and is left out of both figures.
    """
    return _statistics(seq_len, namespace, num_blocks, tier)


@lru_cache(maxsize=8)
def _statistics(seq_len: int, namespace: str, num_blocks: int, tier: str) -> CorpusStatistics:
    # Seconds of generation per process: kept on disk, keyed by this generator's source (see disk_cache).
    # the Python version too: the generator draws from `random`, whose algorithms a new Python may change
    key = {"seq_len": seq_len, "namespace": namespace, "num_blocks": num_blocks, "tier": tier,
           "source": source_digest(__file__), "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}
    return CorpusStatistics(**cached_json("embedded-statistics", key,
                                          lambda: asdict(_estimate(seq_len, namespace, num_blocks, tier))))


def _estimate(seq_len: int, namespace: str, num_blocks: int, tier: str) -> CorpusStatistics:
    nll, counts = 0.0, Counter()
    for index in range(num_blocks):
        b = block(namespace, index, seq_len, tier)
        nll -= sum(b.logprobs[1:])
        counts.update(b.tokens[1:])
    total = sum(counts.values())
    unigram = -sum(c / total * math.log(c / total) for c in counts.values())
    return CorpusStatistics(entropy_floor=nll / total, unigram_entropy=unigram, tokens=total)
