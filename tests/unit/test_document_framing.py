"""Text data follows its tokenizer's family: a BOS before each document only where the family's tokenizer adds one,
the EOS after each, never a None id; padding (the EOS where a tokenizer has no pad token, as Llama 3's) is in no
loss. Each family's tokenizer is a small one built offline with its published conventions
(helpers/family_tokenizers.py); the expected framing is the family's, written out there (CONVENTIONS), not the
code's probe."""

import itertools
import json
from collections import Counter

import pytest
import torch
from helpers.common import tiny_config
from helpers.family_tokenizers import CONVENTIONS, CORPUS, framed, tokenizer_folder
from tokenizers import processors
from transformers import AutoTokenizer

from adaptive_ds.data import build_training_data
from adaptive_ds.data.loader import TrainingData
from adaptive_ds.data.streaming import _Windows
from adaptive_ds.data.text import Framing, is_validation
from adaptive_ds.models import AdaptiveDSForCausalLM

SEED, SHARE = 3, 0.2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in CORPUS))
    return str(path)


def _segments(stream: list[int], eos: int) -> Counter:
    """The stream cut after each EOS: one segment per document (the texts hold no special token)."""
    segments, current = [], []
    for token in stream:
        assert token is not None
        current.append(token)
        if token == eos:
            segments.append(tuple(current))
            current = []
    assert not current, "the stream ends with a document's EOS"
    return Counter(segments)


def _expected(tokenizer, family: str, held_out: bool) -> Counter:
    return Counter(tuple(framed(tokenizer, family, d)) for d in CORPUS if is_validation(d, SEED, SHARE) == held_out)


@pytest.mark.parametrize("family", CONVENTIONS)
def test_streamed_documents_are_framed_as_their_family_frames_them(tmp_path, corpus, family):
    folder = tokenizer_folder(tmp_path / family, family)
    data = build_training_data(corpus, 64, SEED, tokenizer=str(folder), validation_share=SHARE, workers=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = tokenizer.convert_tokens_to_ids(CONVENTIONS[family][1])
    start = {"epoch": 0, "window": 0, "stream_state": None}
    windows = itertools.takewhile(lambda item: item["epoch"] == 0, iter(_Windows(data, 0, 1, start)))
    train = [int(t) for item in windows for block in item["blocks"] for t in block]
    assert _segments(train, eos) == _expected(tokenizer, family, held_out=False)
    validation = [int(t) for block in data.validation_blocks() for t in block]
    assert _segments(validation, eos) == _expected(tokenizer, family, held_out=True)
    bos = CONVENTIONS[family][0]
    if bos is not None:  # once per document, never twice
        assert train.count(tokenizer.convert_tokens_to_ids(bos)) == sum(_expected(tokenizer, family, False).values())


def test_a_tokenizer_that_appends_its_own_eos_still_ends_a_document_with_one(tmp_path):
    # a Llama tokenizer with add_eos_token: its encoding is <s> ... </s>
    template = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> <s> $B </s>",
                                             special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(tmp_path, "tinyllama", post_processor=template))
    assert tokenizer("the cat").input_ids[-1] == 2
    framing = Framing.of(tokenizer)
    (document,) = framing.documents(tokenizer, ["the cat"])
    assert document == [1, *tokenizer("the cat", add_special_tokens=False).input_ids, 2]
    assert document.count(1) == 1 and document.count(2) == 1


def test_a_tokenizer_without_an_eos_is_refused_in_one_line(tmp_path):
    folder = tokenizer_folder(tmp_path, "qwen2.5")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None, "pad_token": None}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token_id is None
    with pytest.raises(ValueError, match="no EOS token") as error:
        Framing.of(tokenizer)
    assert "\n" not in str(error.value)


def test_without_a_pad_token_the_eos_pads_and_padding_is_in_no_loss(tmp_path):
    folder = tokenizer_folder(tmp_path, "llama3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.pad_token_id is None
    eos = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    row = [tokenizer.convert_tokens_to_ids("<|begin_of_text|>"), *tokenizer("the cat sleeps").input_ids[1:], eos, 7]
    batch = TrainingData(tokenizer, seq_len=16, seed=0)._batch([row])
    assert batch["input_ids"][0, len(row):].tolist() == [eos] * (16 - len(row))
    assert batch["labels"][0, len(row):].tolist() == [-100] * (16 - len(row))
    # whatever pads, the loss is the row's own: the padding follows every real token and is labelled -100
    model = AdaptiveDSForCausalLM(tiny_config("dense", vocab_size=len(tokenizer) + 64 - len(tokenizer) % 64)).eval()
    other = batch["input_ids"].clone()
    other[0, len(row):] = 5
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([row]), labels=torch.tensor([row])).loss
        assert model(**batch).loss == pytest.approx(alone.item(), abs=1e-6)
        assert model(input_ids=other, labels=batch["labels"]).loss == pytest.approx(alone.item(), abs=1e-6)
