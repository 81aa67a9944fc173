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
from helpers.pretrained_folders import llama_folder
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

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


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A tiny stock Llama with a Llama 3 style tokenizer (no pad token, its chat template in tokenizer_config.json)
    and an Instruct model's generation_config.json: two EOS ids, sampling defaults."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(tmp_path_factory.mktemp("tokenizer"), "llama3"))
    bos, eos, eot = tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    folder = llama_folder(tmp_path_factory.mktemp("llama3"), vocab_size=pad_vocab(len(tokenizer)), bos_token_id=bos,
                          eos_token_id=eos, pad_token_id=None)
    for name in os.listdir(folder):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.remove(folder / name)
    tokenizer_folder(folder, "llama3")
    GenerationConfig(bos_token_id=bos, eos_token_id=[eos, eot], do_sample=True, temperature=0.6,
                     top_p=0.9).save_pretrained(folder)
    return folder


def _generation(folder) -> dict:
    config = json.loads((folder / "generation_config.json").read_text())
    config.pop("transformers_version")
    return config


def _train_and_export(source, tmp_path, zero_stage: int = 1, **block) -> list:
    """A run of one step --init_from `source`, resumed for a second (a resume keeps what it carries too), then
    exported from its final/ (as itself and as a stock Llama) and from its checkpoint: the four folders."""
    config = write_ds_config(tmp_path, micro=2, max_steps=1, zero_stage=zero_stage, init_from=str(source), **block)
    settings = json.loads(open(config).read())
    del settings["adaptive_ds"]["preset"]  # the tiny folder has no preset's shape
    open(config, "w").write(json.dumps(settings))
    out, exports = tmp_path / "run", tmp_path / "exports"
    train(["--ds_config", config, "--output_dir", str(out)])
    train(["--ds_config", config, "--output_dir", str(out), "--max_steps", "2"])
    export([str(out / "final"), str(exports / "adaptive_ds")])
    export(["--to", "llama", str(out / "final"), str(exports / "llama")])
    export([str(out), str(exports / "from_checkpoint")])
    return [out / "final", exports / "adaptive_ds", exports / "llama", exports / "from_checkpoint"]


def test_final_its_checkpoint_and_exports_chat_as_the_base_did(llama3, tmp_path):
    # ZeRO-3: final/ is a model gathered from the shards, which must take the generation config along
    folders = _train_and_export(llama3, tmp_path, zero_stage=3, data=_corpus(tmp_path), validation_share=0.1)
    base = AutoTokenizer.from_pretrained(llama3)
    text = base.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    ids = base(text, add_special_tokens=False).input_ids
    source_config = json.loads((llama3 / "config.json").read_text())
    for folder in folders:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == text, folder
        assert tokenizer(text, add_special_tokens=False).input_ids == ids
        # as the folder has them: the data's tokenizer pads with the EOS, the saved one names no pad token
        assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|begin_of_text|>",
                                                                                 "<|end_of_text|>", None)
        assert _generation(folder) == _generation(llama3), folder
        model_config = json.loads((folder / "config.json").read_text())
        assert [model_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == \
               [source_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    stock = LlamaForCausalLM.from_pretrained(folders[2])
    assert stock.generation_config.eos_token_id == GenerationConfig.from_pretrained(llama3).eos_token_id
    assert stock.generation_config.temperature == 0.6 and stock.generation_config.do_sample


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
