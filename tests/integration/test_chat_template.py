"""A run --init_from a folder writes the folder's tokenizer (its chat template, its special tokens) and its
generation_config.json into final/, its checkpoints and every export, so the trained model chats as the base did;
prepared text is framed as each family's tokenizer frames documents. The tokenizers are small ones built offline
with each family's published conventions (helpers/family_tokenizers.py)."""

import json
import os

import numpy as np
import pytest
from helpers.common import write_ds_config
from helpers.family_tokenizers import CHATML, CONVENTIONS, CORPUS, framed, tokenizer_folder
from helpers.pretrained_folders import llama_folder, stock_folder
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from adaptive_ds.data.prepare import PrepareArguments, prepare
from adaptive_ds.data.text import is_validation
from adaptive_ds.export.convert import main as export
from adaptive_ds.presets import pad_vocab
from adaptive_ds.training import train

MESSAGES = [{"role": "system", "content": "the river runs"}, {"role": "user", "content": "a cat sleeps"},
            {"role": "assistant", "content": "seven plus two"}, {"role": "user", "content": "under green hills"}]


def _corpus(directory) -> str:
    path = directory / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in CORPUS))
    return str(path)


# family: the stock class and config, their fields, and a generation_config.json as the family's Instruct models
# publish it (several EOS ids, sampling defaults; Qwen's names a BOS its tokenizer does not have)
STOCK = {
    "llama3": (LlamaForCausalLM, LlamaConfig, {}, lambda ids: dict(
        bos_token_id=ids["<|begin_of_text|>"], eos_token_id=[ids["<|end_of_text|>"], ids["<|eot_id|>"]],
        do_sample=True, temperature=0.6, top_p=0.9)),
    "qwen2.5": (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": True}, lambda ids: dict(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"], do_sample=True, repetition_penalty=1.05, temperature=0.7, top_p=0.8,
        top_k=20)),
}


def family_folder(path, family: str):
    """A tiny stock model of `family` with that family's tokenizer (helpers/family_tokenizers.py) and generation
    config, its config's token ids the tokenizer's."""
    stock_class, config_class, fields, generation = STOCK[family]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(path / "tokenizer", family))
    ids = tokenizer.get_vocab()
    folder = stock_folder(path / "model", stock_class, config_class, vocab_size=pad_vocab(len(tokenizer)),
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, **fields)
    for name in os.listdir(folder):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.remove(folder / name)
    tokenizer_folder(folder, family)
    GenerationConfig(**generation(ids)).save_pretrained(folder)
    return folder


def _generation(folder) -> dict:
    config = json.loads((folder / "generation_config.json").read_text())
    config.pop("transformers_version")
    return config


def _train_and_export(source, tmp_path, zero_stage: int = 1, **block) -> list:
    """A run of one step --init_from `source`, resumed for a second (a resume keeps what it carries too), then
    exported from its final/ (as itself and, with --to auto, as the stock class it came from) and from its checkpoint:
    the four folders."""
    config = write_ds_config(tmp_path, micro=2, max_steps=1, zero_stage=zero_stage, init_from=str(source), **block)
    settings = json.loads(open(config).read())
    del settings["adaptive_ds"]["preset"]  # the tiny folder has no preset's shape
    open(config, "w").write(json.dumps(settings))
    out, exports = tmp_path / "run", tmp_path / "exports"
    train(["--ds_config", config, "--output_dir", str(out)])
    train(["--ds_config", config, "--output_dir", str(out), "--max_steps", "2"])
    export([str(out / "final"), str(exports / "adaptive_ds")])
    export(["--to", "auto", str(out / "final"), str(exports / "stock")])
    export([str(out), str(exports / "from_checkpoint")])
    return [out / "final", exports / "adaptive_ds", exports / "stock", exports / "from_checkpoint"]


@pytest.mark.parametrize("family", STOCK)
def test_final_its_checkpoint_and_exports_chat_as_the_base_did(tmp_path, family):
    source = family_folder(tmp_path / "source", family)
    # ZeRO-3: final/ is a model gathered from the shards, which must take the generation config along
    folders = _train_and_export(source, tmp_path, zero_stage=3, data=_corpus(tmp_path), validation_share=0.1)
    base = AutoTokenizer.from_pretrained(source)
    text = base.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.count("the river runs") == 1 and text.endswith(("assistant\n", "assistant<|end_header_id|>\n\n"))
    ids = base(text, add_special_tokens=False).input_ids
    source_config = json.loads((source / "config.json").read_text())
    for folder in folders:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == text, folder
        assert tokenizer(text, add_special_tokens=False).input_ids == ids
        # as the folder has them: Llama 3's names no pad token, though the data's pads with its EOS
        assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == \
               (base.bos_token, base.eos_token, base.pad_token)
        assert _generation(folder) == _generation(source), folder
        model_config = json.loads((folder / "config.json").read_text())
        assert [model_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == \
               [source_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    stock_class = STOCK[family][0]
    stock = stock_class.from_pretrained(folders[2])
    assert type(stock) is stock_class
    assert stock.generation_config.to_diff_dict() == GenerationConfig.from_pretrained(source).to_diff_dict()


def test_a_run_on_the_embedded_corpus_keeps_its_folders_chat_template(tmp_path):
    # the data's tokenizer is the embedded corpus's own, which has no chat template: final/ takes the folder's
    folder = llama_folder(tmp_path / "llama")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHATML
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    GenerationConfig(eos_token_id=1, pad_token_id=0, do_sample=True, top_k=20).save_pretrained(folder)
    messages = [{"role": "user", "content": "set a 4"}]
    text = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False)
    for saved in _train_and_export(folder, tmp_path):
        assert AutoTokenizer.from_pretrained(saved).apply_chat_template(messages, tokenize=False) == text, saved
        assert _generation(saved) == _generation(folder), saved


@pytest.mark.parametrize("family", CONVENTIONS)
def test_prepared_documents_are_framed_as_their_family_frames_them(tmp_path, family):
    folder = tokenizer_folder(tmp_path / "tokenizer", family)
    out = tmp_path / "prepared"
    manifest = prepare(PrepareArguments(_corpus(tmp_path), tokenizer=str(folder), validation_share=0.2), str(out),
                       workers=1, batch_docs=16)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for split, held_out in (("train", False), ("validation", True)):
        written = np.concatenate([np.fromfile(out / s["file"], dtype=np.dtype(manifest["dtype"]))
                                  for s in manifest[split]["shards"]]).tolist()
        assert written == [t for d in CORPUS if is_validation(d, 1234, 0.2) == held_out
                           for t in framed(tokenizer, family, d)], split
    bos, eos = CONVENTIONS[family]
    assert manifest["bos_token_id"] == (None if bos is None else tokenizer.convert_tokens_to_ids(bos))
    assert manifest["eos_token_id"] == tokenizer.convert_tokens_to_ids(eos)
