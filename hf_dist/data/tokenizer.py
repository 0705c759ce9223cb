"""The embedded tokenizer (character level, built in code) and the default chat template.

Nothing binary is committed: :func:`build_tokenizer` creates a ``PreTrainedTokenizerFast`` whose
vocabulary is the printable ASCII characters plus a few special tokens. It is saved next to every
exported model, so ``AutoTokenizer.from_pretrained(export_dir)`` works like for any hub model.
"""

from __future__ import annotations

import logging
import string
from typing import Any

logger = logging.getLogger(__name__)

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)
CHARACTERS = string.printable[:95] + "\n"  # printable ASCII (digits, letters, punctuation, space) and newline

# Zephyr-style template: role marker, newline, content, eos. Used for the embedded tokenizer and
# as the fallback for a tokenizer that ships none. Every assistant turn ends with eos, so a model
# trained with it learns when to stop.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer(model_max_length: int = 256) -> Any:
    """A character-level ``PreTrainedTokenizerFast`` with the default chat template (vocab ~103)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # every character is its own token; Fuse joins them back without inserting spaces
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def ensure_chat_template(tokenizer: Any) -> bool:
    """Give ``tokenizer`` the default chat template if it has none; return True when it did.

    Base models (e.g. ``meta-llama/Llama-3.1-8B``, not ``-Instruct``) ship no template; SFT still
    needs one to turn messages into text, so the documented default is used and the user is told.
    """
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    if tokenizer.bos_token is None or tokenizer.eos_token is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template and bos_token={tokenizer.bos_token!r}, "
            f"eos_token={tokenizer.eos_token!r}; the default template needs both: pass a tokenizer that "
            "defines them or set tokenizer.chat_template yourself"
        )
    logger.warning(
        "tokenizer has no chat template; using hf_dist's default (Zephyr-style '<|role|>\\ncontent<eos>', "
        "see hf_dist.data.DEFAULT_CHAT_TEMPLATE). Pass an -Instruct tokenizer to train on its own format."
    )
    return True


def ensure_pad_token(tokenizer: Any) -> None:
    """Llama tokenizers ship without a pad token; padding is masked, so eos is a safe stand-in."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
