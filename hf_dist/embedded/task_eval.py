"""Exact-match accuracy on the embedded task and short greedy samples, for any causal LM."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from hf_dist.embedded.task import TaskExample

MODES = ("chat", "text")


def task_prompt(tokenizer: Any, example: TaskExample, mode: str) -> str:
    """The prompt whose greedy continuation should be ``example.answer`` (chat template or raw text)."""
    if mode == "chat":
        return tokenizer.apply_chat_template(example.messages()[:1], tokenize=False, add_generation_prompt=True)
    if mode == "text":
        return example.text_prompt()
    raise ValueError(f"mode={mode!r} is not one of {MODES}")


@contextmanager
def _left_padding(tokenizer: Any):
    # decoder-only generation needs the prompts right-aligned so new tokens follow real tokens
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        yield
    finally:
        tokenizer.padding_side = side


def generate(
    model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int = 32, batch_size: int = 64
) -> list[str]:
    """Greedy continuations of ``prompts`` (special tokens removed), batched with left padding."""
    import torch

    device = next(model.parameters()).device
    outputs: list[str] = []
    was_training = model.training
    model.eval()
    with _left_padding(tokenizer), torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            # prompts rendered by a chat template already hold bos; do not add another
            batch = tokenizer(
                prompts[start : start + batch_size], add_special_tokens=False, padding=True, return_tensors="pt"
            ).to(device)
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                # one process generates alone (baseline / exported model): under ZeRO-3 transformers
                # would otherwise wait for the other ranks' forward passes and hang
                synced_gpus=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            outputs += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    return outputs


def answer_all(model: Any, tokenizer: Any, examples: list[TaskExample], *, mode: str) -> list[str]:
    """The greedy continuation of each example's prompt (long enough for the longest answer, and a few more)."""
    if not examples:
        raise ValueError("the embedded task needs at least one example to answer; got an empty list")
    prompts = [task_prompt(tokenizer, ex, mode) for ex in examples]
    longest = max(len(ex.answer) for ex in examples)
    return generate(model, tokenizer, prompts, max_new_tokens=longest + 4)


def is_right(output: str, example: TaskExample) -> bool:
    """Whether a continuation answers ``example``: its first line, stripped, is the expected answer."""
    return _first_line(output) == example.answer


def exact_match(model: Any, tokenizer: Any, examples: list[TaskExample], *, mode: str) -> float:
    """Share of ``examples`` whose greedy answer (first line, stripped) equals the expected answer."""
    answers = answer_all(model, tokenizer, examples, mode=mode)
    return accuracy(answers, examples)


def accuracy(answers: list[str], examples: list[TaskExample]) -> float:
    """Share of ``answers`` that answer their example right."""
    return sum(is_right(got, ex) for got, ex in zip(answers, examples, strict=True)) / len(examples)


def showcase(answers: list[str], examples: list[TaskExample]) -> int:
    """Index of the example to show as the run's sample: the first one answered right, so a sample printed after
    "99 %" is one of the 99 %; the first example (a miss, said as such) when none is right."""
    return next((i for i, (got, ex) in enumerate(zip(answers, examples, strict=True)) if is_right(got, ex)), 0)


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0].strip() if stripped else ""
