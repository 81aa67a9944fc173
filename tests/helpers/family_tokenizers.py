"""Small tokenizers with the conventions of the families --init_from imports, built offline with `tokenizers` and
saved as their published folders are: the family's tokenizer class, special tokens, tokenizer_config.json fields,
the post-processor of tokenizer.json that adds (or not) a BOS, and a chat template in the family's style.

The conventions, as the published tokenizer folders have them (nothing is downloaded in the tests: these are
written from the files as published, and where a detail is uncertain the comment says so):

- Llama 3.x (Llama-3.2-1B): `PreTrainedTokenizerFast`, a byte-level BPE; tokenizer.json's post-processor puts
  `<|begin_of_text|>` first; EOS `<|end_of_text|>` (the Instruct models' tokenizer_config names `<|eot_id|>`); no
  pad token; the chat template lives in tokenizer_config.json.
- Qwen2.5 and Qwen3 (base models): `Qwen2Tokenizer`, byte-level; no BOS at all (`bos_token` null,
  `add_bos_token` false); EOS and pad `<|endoftext|>` (the post-trained models name `<|im_end|>` their EOS);
  ChatML.
- SmolLM2: `GPT2Tokenizer`, byte-level; BOS, EOS and unk all `<|endoftext|>`, which GPT-2's tokenizer does not add;
  no pad token (assumed from SmolLM's tokenizer_config: the Instruct models name `<|im_start|>` and `<|im_end|>`);
  ChatML.
- Llama 2 / TinyLlama and Mistral 7B: `LlamaTokenizer` (SentencePiece-style BPE with "▁" word starts), `<s>` added
  first (`add_bos_token` true), `</s>` not added (`add_eos_token` false), no pad token; TinyLlama's chat template is
  Zephyr's, Mistral's is `[INST] ... [/INST]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>"
               "\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
ZEPHYR_CHAT = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
               "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MISTRAL_CHAT = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
                "{{ message['content'] }} [/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}"
                "{% endfor %}")

WORDS = ("the river runs a cat sleeps seven plus two under bright green hills while old men sing quietly of "
         "rain and stone").split()
CORPUS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(i % 9 + 3)) for i in range(200)]


@dataclass(frozen=True)
class TokenizerFamily:
    """A family's tokenizer conventions: its class, its special tokens (None: it has none), other special tokens
    (chat markers), its model (byte-level BPE or SentencePiece-style), whether its encoding puts the BOS first, the
    tokenizer_config.json fields the published folders add, and a chat template in its style."""

    tokenizer_class: str
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None = None
    extra: tuple[str, ...] = ()
    byte_level: bool = True
    adds_bos: bool = False
    config: dict = field(default_factory=dict)
    chat_template: str = CHATML
    template_in_config: bool = False  # as older folders keep it; transformers 5 writes chat_template.jinja


FAMILIES = {
    "llama3": TokenizerFamily("PreTrainedTokenizerFast", "<|begin_of_text|>", "<|end_of_text|>", None,
                              extra=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), adds_bos=True,
                              config={"clean_up_tokenization_spaces": True}, chat_template=LLAMA3_CHAT,
                              template_in_config=True),
    "qwen2.5": TokenizerFamily("Qwen2Tokenizer", None, "<|endoftext|>", "<|endoftext|>",
                               extra=("<|im_start|>", "<|im_end|>"),
                               config={"add_bos_token": False, "add_prefix_space": False, "errors": "replace",
                                       "split_special_tokens": False}),
    "qwen3": TokenizerFamily("Qwen2Tokenizer", None, "<|endoftext|>", "<|endoftext|>",
                             extra=("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
                             config={"add_bos_token": False, "add_prefix_space": False, "errors": "replace",
                                     "split_special_tokens": False}),
    "smollm2": TokenizerFamily("GPT2Tokenizer", "<|endoftext|>", "<|endoftext|>", None, unk="<|endoftext|>",
                               extra=("<|im_start|>", "<|im_end|>"), config={"add_prefix_space": False}),
    "tinyllama": TokenizerFamily("LlamaTokenizer", "<s>", "</s>", None, unk="<unk>", byte_level=False, adds_bos=True,
                                 config={"add_bos_token": True, "add_eos_token": False, "legacy": False},
                                 chat_template=ZEPHYR_CHAT),
    "mistral": TokenizerFamily("LlamaTokenizer", "<s>", "</s>", None, unk="<unk>", byte_level=False, adds_bos=True,
                               config={"add_bos_token": True, "add_eos_token": False, "legacy": True},
                               chat_template=MISTRAL_CHAT, template_in_config=True),
}

# What a document looks like in each family's token stream: (the token it starts with, or None; the token it ends with)
CONVENTIONS = {
    "llama3": ("<|begin_of_text|>", "<|end_of_text|>"),
    "qwen2.5": (None, "<|endoftext|>"),
    "qwen3": (None, "<|endoftext|>"),
    "smollm2": (None, "<|endoftext|>"),
    "tinyllama": ("<s>", "</s>"),
    "mistral": ("<s>", "</s>"),
}


def framed(tokenizer, name: str, text: str) -> list[int]:
    """`text`'s ids as family `name` frames a document (CONVENTIONS)."""
    bos, eos = CONVENTIONS[name]
    head = [] if bos is None else [tokenizer.convert_tokens_to_ids(bos)]
    return head + tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.convert_tokens_to_ids(eos)]


def _backend(family: TokenizerFamily, post_processor=None) -> Tokenizer:
    specials = list(dict.fromkeys(t for t in (family.unk, family.bos, family.eos, family.pad, *family.extra) if t))
    if family.byte_level:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        backend = Tokenizer(models.BPE(unk_token=family.unk, byte_fallback=True, fuse_unk=True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials)
    backend.train_from_iterator(CORPUS, trainer=trainer)
    if post_processor is not None:
        backend.post_processor = post_processor
    elif family.adds_bos:
        bos = (family.bos, backend.token_to_id(family.bos))
        template = processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B:1",
                                                 special_tokens=[bos])
        backend.post_processor = (processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
                                  if family.byte_level else template)
    elif family.byte_level:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def tokenizer_folder(path: Path, name: str, post_processor=None, **changes) -> Path:
    """The tokenizer of family `name` (a key of FAMILIES; `changes` replace its fields) saved in `path` as its
    published folder is; `post_processor` replaces the one the family's convention gives."""
    family = FAMILIES[name]
    family = TokenizerFamily(**{**family.__dict__, **changes})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_backend(family, post_processor),
                                        chat_template=family.chat_template, model_max_length=131072,
                                        **{f"{k}_token": v for k, v in (("bos", family.bos), ("eos", family.eos),
                                                                        ("pad", family.pad), ("unk", family.unk)) if v})
    tokenizer.save_pretrained(path)
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update({"tokenizer_class": family.tokenizer_class, "bos_token": family.bos, "eos_token": family.eos,
                   "pad_token": family.pad, **family.config})
    if family.unk:
        config["unk_token"] = family.unk
    if family.template_in_config:
        config["chat_template"] = (Path(path) / "chat_template.jinja").read_text()
        (Path(path) / "chat_template.jinja").unlink()
    config_file.write_text(json.dumps(config, indent=2))
    return Path(path)
