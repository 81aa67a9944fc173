"""`--init_from`: a run that starts from pretrained weights instead of random ones.

The source is a folder of a Hugging Face model (a local folder, or a Hub id resolved through the HF cache) holding
a model of a registered family (`models.families`: a stock Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE, or one
of adaptive_ds's own `final/` folders), its weights as safetensors (one file or an index of shards), with its
tokenizer. The family, found by the config's `model_type`, says which architecture the folder holds, which config
fields it fixes, which of its features the model lacks and how its weights map to ours; this module asks it and
knows no family or architecture by name.

What comes from where:

- The model's shape (hidden, layers, heads, kv heads, ffn, vocabulary), `rms_norm_eps`, `rope_theta` and
  `max_position_embeddings` come from the folder's config. A preset named on the command line or in the ds_config's
  block must agree with it on hidden, layers, heads, kv heads and ffn, else the run is refused in one line that lists
  the fields that differ. Without a named preset, the preset whose shape is the folder's is taken (TinyLlama's shape
  is b1's), else none: the run claims no preset (its identity and summary.json record `preset` null, the model card
  "none"). `seq_len` is the preset's, up to the folder's `max_position_embeddings`; without a preset it is
  `max_position_embeddings` up to `NO_PRESET_SEQ_LEN` (2048, the longest preset's). `--model` may not set a shape
  field.
- The architecture is `--arch`: a Llama or our dense folder starts any architecture (upcycled, see
  `models.upcycling`: MoE experts copied from the dense MLP, MoD routers added with the straight-through update
  scale); a Mixtral folder imports as `moe` with Mixtral's routing (its experts and top-k, renormalised, and dropless
  in training too, as Mixtral trains, unless `--model` asks for `moe_drop_tokens`); our MoE, MoD or hybrid folder as
  its own architecture with its own settings. An upcycled MoE takes its expert count and top-k from the preset (or,
  without one, the model's defaults) and the architecture's defaults, as a model trained from scratch would.
- The tokenizer comes with the weights: data prepared or streamed with another vocabulary is refused in one line;
  streamed text is tokenized with the folder's tokenizer unless `--tokenizer` on the command line names one (a
  ds_config's tokenizer, written for runs from scratch, does not); the embedded corpus needs a
  folder whose tokenizer is the embedded corpus's. Checkpoints and final/ carry the folder's own tokenizer (its
  special tokens and chat template as the folder has them) and its generation_config.json (`CHAT_FILES`), so the
  trained model chats as the base did; the model's bos, eos and pad ids are that tokenizer's.
- The families' features come with the folder (tied embeddings, RoPE scaling, attention biases, q/k norm, an
  explicit head_dim: `models.families`); a sliding window is accepted where it is no shorter than the run's
  `seq_len`, when it changes nothing. A feature the model does not have is refused in one line each (the family
  says which: an activation other than SiLU, MLP biases, partial rotary embeddings, a RoPE scaling of another type).

Starting from weights is not resuming: the run gets a fresh optimizer, schedule and data position, and counts its own
steps and tokens. Its identity records the source, a content hash of the files it reads (config, tokenizer, the
weights the index names) and their names, sizes and mtimes, so a resume of the run checks that the folder is still
the one it started from: where the names, sizes and mtimes are the recorded ones it takes the recorded hash without
reading the weights again, otherwise it hashes them. A resume loads the run's own checkpoint, never these weights.
summary.json and the model card record the source as `base_model`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from functools import cached_property

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, GenerationConfig, PreTrainedConfig
from transformers.utils import GENERATION_CONFIG_NAME

from .models import ARCH_SPECS, AdaptiveDSConfig, architecture_spec
from .models.families import FAMILIES, Family, family_of, supported
from .models.upcycling import SHAPE_FIELDS, fixed_fields, initial_tensors, starts, upcycled_settings, upcycling_problems
from .presets import NO_PRESET_SEQ_LEN, PRESETS, VARIANTS, pad_vocab

logger = logging.getLogger(__name__)

# The files a run reads from the folder besides its weights (config, the weights' index, tokenizer); the weights are
# the shards the index names, or model.safetensors (`source_files`)
SOURCE_FILES = ("config.json", "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
                "added_tokens.json", "vocab.*", "merges.txt", "*.model")
# What final/ takes from the folder besides the tokenizer: read, not hashed (they change no token the run trains on)
CHAT_FILES = ("generation_config.json", "chat_template.jinja", "additional_chat_templates/*")
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_name(name: str) -> None:
    """What can be told of an --init_from without the Hub: a local folder that exists, or a Hub model id (whether the
    Hub holds it is the run's to find). ValueError in one line otherwise."""
    if os.path.isdir(name):
        return
    if os.path.exists(name) or name.startswith((os.path.sep, ".", "~")) or not _HUB_ID.fullmatch(name):
        raise ValueError(f"init_from {name!r}: no such folder; pass a folder holding a model's config.json, "
                         "safetensors weights and tokenizer, or a Hub model id")


def resolve(name: str, weights: bool = True) -> str:
    """The local folder of `name`: itself, or a Hub id's snapshot in the HF cache (fetched into it where it is not
    there yet and the Hub can be reached). ValueError in one line when it is neither. `weights` False: a Hub id's
    config, tokenizer and index only (what the planner reads), not gigabytes of weights."""
    check_name(name)
    if os.path.isdir(name):
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:  # the config, tokenizer and index first, then only the weights they name (a repository may hold others)
        folder = snapshot_download(name, allow_patterns=[*SOURCE_FILES, *CHAT_FILES])
        return snapshot_download(name, allow_patterns=_weight_names(folder)) if weights else folder
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as error:
        raise ValueError(f"init_from {name!r} is no local folder, and no Hub model in the HF cache or reachable "
                         f"({type(error).__name__}); pass a folder or a Hub model id") from None


def _weight_names(folder: str) -> list[str]:
    """The weight files a run reads: the shards the safetensors index names, else model.safetensors."""
    index = os.path.join(folder, INDEX)
    if not os.path.isfile(index):
        return [SINGLE]
    with open(index) as f:
        try:
            return sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{INDEX} in {folder!r} has no weight_map of tensor names to files") from None


def source_files(folder: str) -> list[str]:
    """The names of the files a run reads from the folder, sorted: config, tokenizer, the weights' index and the
    weights it names (or model.safetensors); never another *.safetensors the folder happens to hold."""
    names = {name for name in os.listdir(folder) if any(fnmatch.fnmatch(name, p) for p in SOURCE_FILES)}
    names.update(_weight_names(folder))
    return sorted(name for name in names if os.path.isfile(os.path.join(folder, name)))


def file_stats(folder: str) -> list[list]:
    """[name, size, mtime_ns] of each of the folder's `source_files`: what a resume compares to see that the folder
    is unchanged without reading it."""
    stats = [(name, os.stat(os.path.join(folder, name))) for name in source_files(folder)]
    return [[name, stat.st_size, stat.st_mtime_ns] for name, stat in stats]


def content_hash(folder: str) -> str:
    """sha256 over the names and contents of the files a run reads from the folder (`source_files`)."""
    digest = hashlib.sha256()
    for name in source_files(folder):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
    return f"sha256:{digest.hexdigest()}"


@dataclass
class Source:
    """A pretrained model's folder: its config, checked, and what a run builds from it."""

    name: str  # as given: a folder or a Hub id
    folder: str
    config: PreTrainedConfig
    model_type: str  # its config's model_type: a key of models.families.FAMILIES

    @classmethod
    def open(cls, name: str, weights: bool = True) -> Source:
        """The source `name`, its config read; ValueError in one line for a missing folder, a folder without a
        config, or a model of no registered family. `weights` False: see `resolve`."""
        folder = resolve(name, weights)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"init_from {name!r} holds no config.json; pass a Hugging Face model folder")
        with open(os.path.join(folder, "config.json")) as f:
            try:
                model_type = json.load(f).get("model_type")
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"init_from {name!r}: config.json is not a JSON object") from None
        if model_type not in FAMILIES:
            raise ValueError(f"init_from {name!r} is a {model_type!r} model; supported model types: {supported()}")
        try:
            config = FAMILIES[model_type].config_class.from_pretrained(folder)
        except (ValueError, TypeError, OSError) as error:
            raise ValueError(f"init_from {name!r}: its config.json does not load ({type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''})") from None
        return cls(name, folder, config, model_type)

    # what the folder holds
    @property
    def family(self) -> Family:
        return family_of(self.model_type)

    @property
    def arch(self) -> str:
        """The folder's own architecture."""
        return self.family.architecture(self.config)

    @property
    def fields(self) -> dict:
        """The AdaptiveDSConfig fields the folder fixes for every architecture it starts: shape, norm, RoPE,
        context."""
        return self.family.fields(self.config)

    def shape(self) -> dict[str, int]:
        fields = self.fields
        return {name: fields[name] for name in SHAPE_FIELDS}

    def feature_problems(self) -> list[str]:
        """The features of the folder's family that the model does not have, one line each."""
        c, name = self.config, self.name
        found = [f"init_from {name!r} {problem}" for problem in self.family.feature_problems(c)]
        if not self.weight_files():
            bins = [f for f in os.listdir(self.folder) if f.endswith(".bin")]
            what = f"holds {', '.join(bins[:3])} but no safetensors" if bins else "holds no model.safetensors"
            found.append(f"init_from {name!r} {what}; save the model with safe_serialization=True")
        return found

    def arch_problems(self, arch: str, overrides: dict) -> list[str]:
        """Whether the folder can start `arch` with the `--model` overrides, one line each."""
        found = []
        if not starts(self.arch, arch):
            started = [name for name in ARCH_SPECS if starts(self.arch, name)]
            own_mlp = (f"; --arch {arch} has an MLP of its own, which a {self.arch} model has no weights for"
                       if arch in ARCH_SPECS and architecture_spec(arch).mlp is not None else "")
            found.append(f"init_from {self.name!r} is a {self.arch} model ({self.family.class_name}); it starts "
                         f"--arch {', '.join(started)}{' only' if len(started) == 1 else ''}{own_mlp}")
        named = [k for k in fixed_fields(self.arch) if k in overrides]
        if named:
            found.append(f"--model sets {', '.join(named)}, which init_from {self.name!r} fixes (the model's shape "
                         "comes from the folder)")
        return found + upcycling_problems(self.arch, arch, overrides)

    def preset_conflicts(self, preset: str) -> list[str]:
        """The shape fields on which `preset` disagrees with the folder: 'hidden_size 2048 (preset: 4096)'."""
        p = PRESETS[preset]
        return [f"{k} {v} (preset {preset}: {getattr(p, k)})" for k, v in self.shape().items() if getattr(p, k) != v]

    def matching_preset(self) -> str | None:
        return next((name for name in PRESETS if not self.preset_conflicts(name)), None)

    def seq_len(self, preset: str | None) -> int:
        """The preset's seq_len (None: `NO_PRESET_SEQ_LEN`), up to the folder's max_position_embeddings."""
        wanted = PRESETS[preset].seq_len if preset is not None else NO_PRESET_SEQ_LEN
        return min(wanted, self.fields["max_position_embeddings"])

    # what a run builds from it
    def model_config(self, arch: str, preset: str | None, vocab_size: int, **overrides) -> AdaptiveDSConfig:
        """The configuration of the model `arch` started from the folder, for a tokenizer of `vocab_size` tokens
        (`preset`: the run's, None when it has none); `overrides` (AdaptiveDSConfig fields, checked by
        `arch_problems`) win over what the folder does not fix."""
        c = self.config
        vocab = pad_vocab(max(c.vocab_size, vocab_size))
        own = self.family.own_settings(c)
        if own is not None and arch == self.arch:  # our own model: its own settings
            return AdaptiveDSConfig(**{**own, "vocab_size": vocab, **overrides})
        experts = PRESETS[preset] if preset is not None else AdaptiveDSConfig()  # no preset: the model's defaults
        fields = dict(arch=arch, vocab_size=vocab, **self.fields, num_local_experts=experts.num_local_experts,
                      num_experts_per_tok=experts.num_experts_per_tok, source_model_type=self.source_model_type)
        fields.update(VARIANTS[arch].model)
        fields.update(self.family.routing(c))  # the family's own routing (Mixtral's), over the variant's defaults
        fields.update(overrides)
        # upcycled: the first forward pass is the dense model's, where the overrides leave it so
        upcycled = upcycled_settings(self.arch, arch, fields)
        fields.update({k: v for k, v in upcycled.items() if k not in overrides})
        return AdaptiveDSConfig(**fields)

    @property
    def source_model_type(self) -> str | None:
        """The stock family the weights come from: the folder's own, or the one our folder recorded (None: ours
        from scratch)."""
        own = self.family.own_settings(self.config)
        return self.model_type if own is None else own.get("source_model_type")

    def tokenizer(self):
        try:
            return AutoTokenizer.from_pretrained(self.folder)
        except (OSError, ValueError) as error:
            raise ValueError(f"init_from {self.name!r} has no tokenizer that loads ({type(error).__name__}); the "
                             "tokenizer comes with the weights") from None

    def generation_config(self) -> GenerationConfig | None:
        """The folder's generation_config.json (its eos, bos and pad ids, its sampling defaults), or None."""
        if not os.path.isfile(os.path.join(self.folder, GENERATION_CONFIG_NAME)):
            return None
        try:
            return GenerationConfig.from_pretrained(self.folder)
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"init_from {self.name!r}: its {GENERATION_CONFIG_NAME} does not load "
                             f"({type(error).__name__}); fix or remove it") from None

    def check_tokenizer(self, tokenizer, data: str) -> None:
        """The run's data must be tokenized with the folder's vocabulary; ValueError in one line otherwise."""
        from .data import EMBEDDED_SOURCES  # the data package imports torch: not for the planner's reads

        own = self.tokenizer()
        if own.get_vocab() != tokenizer.get_vocab():
            # the built-in corpus has one tokenizer: only a folder of that tokenizer (a run's final/ on it) trains on it
            fix = (f"{data} has its own tokenizer: start from a folder that has it (the final/ of a run on {data}), "
                   "or pass text data prepared with --tokenizer set to that folder"
                   if data in EMBEDDED_SOURCES else "prepare the data with --tokenizer set to that folder")
            raise ValueError(f"--data {data!r} is tokenized with a vocabulary of {len(tokenizer)} tokens that is not "
                             f"the tokenizer of init_from {self.name!r} ({len(own)} tokens); the tokenizer comes with "
                             f"the weights: {fix}")
        if len(own) > pad_vocab(self.config.vocab_size):
            raise ValueError(f"init_from {self.name!r}'s tokenizer has {len(own)} tokens, more than its model's "
                             f"vocab_size {self.config.vocab_size}")

    def weight_files(self) -> dict[str, str]:
        """Tensor name -> the safetensors file that holds it (empty: none)."""
        index = os.path.join(self.folder, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                return {k: os.path.join(self.folder, v) for k, v in json.load(f)["weight_map"].items()}
        single = os.path.join(self.folder, SINGLE)
        if not os.path.isfile(single):
            return {}
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)

    @cached_property
    def content_hash(self) -> str:
        return content_hash(self.folder)

    def identity(self, recorded: dict | None) -> dict:
        """The run identity's record of the source: {"source", "sha256", "files": `file_stats`}. `recorded`: the
        record of the run being continued (its run_identity.json), or None. Where the folder, by the same name,
        shows the recorded files (names, sizes and mtimes), the recorded hash is taken without reading the weights
        again; otherwise the files are hashed. The resume's identity check compares the hash only: the same weights
        under another path (moved, copied, named relatively) or touched continue the run, and the new record keeps
        the next resume from reading them again; other weights are refused."""
        files = file_stats(self.folder)
        if recorded is not None and recorded.get("source") == self.name and recorded.get("files") == files:
            return recorded
        return {"source": self.name, "sha256": self.content_hash, "files": files}

    def load_into(self, model, ep_rank: int = 0, noise: float = 0.0, seed: int = 0) -> None:
        """Set `model`'s weights from the folder (this expert-parallel rank's experts only), reading tensor by tensor
        from the safetensors files, so that no rank holds more than its own model and one tensor of the source."""
        files = self.weight_files()

        def read(name: str, index: int | None = None) -> torch.Tensor:
            if name not in files:
                raise ValueError(f"init_from {self.name!r} has no tensor {name!r} that a {self.arch} model "
                                 f"({self.family.class_name}) holds; its weights do not match its config")
            with safe_open(files[name], framework="pt") as f:
                return (f.get_tensor(name) if index is None else f.get_slice(name)[index]).float()

        ours = self.family.reader(read, set(files))  # the folder's tensors by our names
        own = model.state_dict()  # the parameters' and buffers' storage: each is written in place, one by one
        with torch.no_grad():
            for name, tensor in initial_tensors(model, self.arch, ours, ep_rank, noise, seed):
                if tensor.shape != own[name].shape:
                    raise ValueError(f"init_from {self.name!r}: tensor {name} is {tuple(tensor.shape)}, the model's "
                                     f"{tuple(own[name].shape)}; its weights do not match its config")
                own[name].copy_(tensor)
        # (not its content hash: every rank loads, and only rank 0 reads every file again to hash them)
        logger.info("weights from %s (%s) as %s", self.name, self.family.class_name, model.config.arch)


    def problems(self, arch: str, overrides: dict, preset: str | None) -> list[str]:
        """What is wrong with starting `arch` from the folder (`preset`: the preset named on the command line or in
        the ds_config, None when none is), for the settings check: one line per problem."""
        found = self.feature_problems() + self.arch_problems(arch, overrides)
        window, seq_len = self.fields.get("sliding_window"), self.seq_len(preset or self.matching_preset())
        if window is not None and window < seq_len:
            found.append(f"init_from {self.name!r} attends within a sliding window of {window} tokens, shorter than "
                         f"the run's seq_len {seq_len}; adaptive_ds's attention is full causal attention, the same "
                         f"only within the window: name a preset of seq_len <= {window}")
        conflicts = self.preset_conflicts(preset) if preset in PRESETS else []
        if conflicts:
            shaped = self.matching_preset() or "none matches"
            found.append(f"preset {preset} contradicts init_from {self.name!r} on {', '.join(conflicts)}; the shape "
                         f"comes from the folder: name the preset of its shape ({shaped}) or none")
        return found


def problems(name: str, arch: str, overrides: dict, preset: str | None) -> list[str]:
    """`Source.problems` of the folder `name`, or the one line of why it does not open."""
    try:
        source = Source.open(name)
    except ValueError as error:
        return [str(error)]
    return source.problems(arch, overrides, preset)
