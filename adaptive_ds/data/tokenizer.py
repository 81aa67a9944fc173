"""The embedded corpus's tokenizer: a word-level `PreTrainedTokenizerFast`, one id per grammar token of a tier."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .embedded import EOS, PAD, UNK, vocabulary


def embedded_tokenizer(tier: str = "base") -> PreTrainedTokenizerFast:
    """Whitespace-split words to ids in `vocabulary(tier)` order; `<eos>` separates documents, `<pad>` fills
    blocks."""
    vocab = {token: i for i, token in enumerate(vocabulary(tier))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        model_max_length=1 << 30, clean_up_tokenization_spaces=False,
    )
