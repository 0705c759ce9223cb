"""Data for the recipes: the character tokenizer, chat tokenization, packing, local loading.

The embedded toy task lives in :mod:`hf_dist.embedded.task`.

Importing this package is cheap; torch, tokenizers and datasets are imported by the functions
that need them.
"""

from hf_dist.data.chat import IGNORE_INDEX, generation_prompt, tokenize_chat, validate_messages
from hf_dist.data.loading import EXPECTED_COLUMNS, load_local_dataset, matching_columns, split_eval, to_messages
from hf_dist.data.packing import pack_batch, pack_sequences
from hf_dist.data.tokenizer import DEFAULT_CHAT_TEMPLATE, build_tokenizer, ensure_chat_template, ensure_pad_token

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "EXPECTED_COLUMNS",
    "IGNORE_INDEX",
    "build_tokenizer",
    "ensure_chat_template",
    "ensure_pad_token",
    "generation_prompt",
    "load_local_dataset",
    "matching_columns",
    "pack_batch",
    "pack_sequences",
    "split_eval",
    "to_messages",
    "tokenize_chat",
    "validate_messages",
]
