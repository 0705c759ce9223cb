"""Data for the recipes: the character tokenizer, chat tokenization, packing, local loading.

The embedded toy task lives in :mod:`hf_dist.embedded.task`.

Importing this package is cheap; torch, tokenizers and datasets are imported by the functions
that need them.
"""

from hf_dist.data.chat import IGNORE_INDEX, generation_prompt, tokenize_chat, validate_messages
from hf_dist.data.loading import EXPECTED_COLUMNS, load_local_dataset, matching_columns, split_eval, to_messages
from hf_dist.data.packing import (
    PackedCollator,
    Truncation,
    check_packing,
    fill,
    pack,
    pack_batch,
    pack_sequences,
    real_tokens,
    truncate,
)
from hf_dist.data.tokenizer import DEFAULT_CHAT_TEMPLATE, build_tokenizer, ensure_chat_template, ensure_pad_token

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "EXPECTED_COLUMNS",
    "IGNORE_INDEX",
    "PackedCollator",
    "Truncation",
    "build_tokenizer",
    "check_packing",
    "ensure_chat_template",
    "ensure_pad_token",
    "fill",
    "generation_prompt",
    "load_local_dataset",
    "matching_columns",
    "pack",
    "pack_batch",
    "pack_sequences",
    "real_tokens",
    "split_eval",
    "to_messages",
    "tokenize_chat",
    "truncate",
    "validate_messages",
]
