"""Tiny stock Llama and Mixtral folders (transformers' own classes, saved by save_pretrained) with the embedded
corpus's tokenizer: the sources --init_from imports in the tests."""

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.presets import pad_vocab

# the debug preset's shape, so that a run of the ds_configs' preset takes the folder as it is; TINY for the tests that
# build models without a run, in milliseconds
DEBUG = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight moved off its initialisation (the norms too), so that a tensor taken from the wrong place shows."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model.eval()


def llama_folder(path: Path, vocab_size: int | None = None, shape: dict = TINY, **overrides) -> Path:
    """A tiny stock LlamaForCausalLM of `shape` saved with the embedded corpus's tokenizer."""
    tokenizer = embedded_tokenizer()
    config = LlamaConfig(**{**shape, "vocab_size": vocab_size or pad_vocab(len(tokenizer)),
                            "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
                            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                            **overrides})
    torch.manual_seed(1)
    perturbed(LlamaForCausalLM(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def stock_folder(path: Path, stock_class: type, config_class: type, shape: dict = TINY, **overrides) -> Path:
    """A tiny stock model of any Llama-style family (Qwen2ForCausalLM, Qwen3ForCausalLM, ...) of `shape`, saved with
    the embedded corpus's tokenizer."""
    tokenizer = embedded_tokenizer()
    config = config_class(**{**shape, "vocab_size": pad_vocab(len(tokenizer)), "max_position_embeddings": 64,
                             "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                             **overrides})
    torch.manual_seed(1)
    perturbed(stock_class(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def mixtral_folder(path: Path, shape: dict = TINY, **overrides) -> Path:
    """A tiny stock MixtralForCausalLM of `shape`, 4 experts top-2, saved with the embedded corpus's tokenizer."""
    tokenizer = embedded_tokenizer()
    config = MixtralConfig(**{**shape, "vocab_size": pad_vocab(len(tokenizer)),
                              "max_position_embeddings": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **overrides})
    torch.manual_seed(1)
    perturbed(MixtralForCausalLM(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


