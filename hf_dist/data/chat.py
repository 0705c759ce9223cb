"""Chat examples → token ids with labels on assistant tokens only.

The mask is computed from character spans of the rendered template, not from a ``{% generation %}``
block, so it works with any tokenizer's own chat template (Llama 3, Mistral, Qwen ...) as long as
rendering a conversation prefix gives a string prefix of the full conversation, which is checked.
"""

from __future__ import annotations

from typing import Any

IGNORE_INDEX = -100  # label value the loss ignores (torch.nn.CrossEntropyLoss default)
ROLES = ("system", "user", "assistant")


def validate_messages(messages: Any, index: int = 0) -> list[dict[str, str]]:
    """Check one conversation's shape; the error names the example index and what is expected."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"example {index}: 'messages' must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}"
        )
    for turn in messages:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise ValueError(
                f"example {index}: each message needs 'role' in {list(ROLES)} and a string 'content', got {turn!r:.200}"
            )
    if not any(turn["role"] == "assistant" for turn in messages):
        raise ValueError(
            f"example {index}: no 'assistant' message, so there is nothing to train on: {messages!r:.200}"
        )
    return messages


def assistant_char_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of every assistant turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template renders a conversation prefix differently from the full conversation "
                f"(turn {i}), so assistant tokens cannot be located; use a template without "
                "history-dependent rendering, e.g. hf_dist.data.DEFAULT_CHAT_TEMPLATE"
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_chat(tokenizer: Any, messages: list[dict[str, str]], max_length: int | None) -> dict[str, list[int]]:
    """``input_ids``/``attention_mask``/``labels`` for one conversation, truncated to ``max_length`` (None: whole;
    :func:`hf_dist.data.truncate` then cuts and counts).

    Labels are ``IGNORE_INDEX`` except on tokens that start inside an assistant turn (including the
    end-of-turn token the template appends, so the model learns to stop).
    """
    text, spans = assistant_char_spans(tokenizer, messages)
    # the template already inserted bos/eos, so the tokenizer must not add them again
    enc = tokenizer(
        text,
        add_special_tokens=False,
        return_offsets_mapping=True,
        truncation=max_length is not None,
        max_length=max_length,
    )
    labels = [
        tok if any(start <= s < end for start, end in spans) else IGNORE_INDEX
        for tok, (s, _) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
    ]
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def generation_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The rendered prompt for everything before the last assistant turn, ready for generation."""
    last = max(i for i, turn in enumerate(messages) if turn["role"] == "assistant")
    return tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
