"""The embedded instruction task: tiny string operations on which learning is visible in minutes.

Each example is an instruction such as ``reverse: cadb`` with the answer ``bdac``. A randomly
initialised tiny Llama answers ~0% of them exactly; after a couple of minutes of training on
2 CPU processes it answers most of them, so the demo shows a before/after accuracy rather than
only a falling loss. Examples are generated from a seed, so nothing is downloaded or committed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# op name -> function of the input string; each is learnable by a 2-layer transformer
OPERATIONS = {
    "reverse": lambda s: s[::-1],
    "upper": lambda s: s.upper(),
    "copy": lambda s: s,
}
ALPHABET = "abcdefgh"
MIN_LEN, MAX_LEN = 3, 6


@dataclass(frozen=True)
class TaskExample:
    op: str
    arg: str

    @property
    def prompt(self) -> str:
        return f"{self.op}: {self.arg}"

    @property
    def answer(self) -> str:
        return OPERATIONS[self.op](self.arg)

    def messages(self) -> list[dict[str, str]]:
        """The example as a chat: one user turn and the assistant's answer (what SFT trains on)."""
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]

    def text(self) -> str:
        """The example as one line of raw text (what continued pretraining trains on)."""
        return f"{self.prompt} = {self.answer}"

    def text_prompt(self) -> str:
        """The raw-text prefix whose greedy continuation should be the answer."""
        return f"{self.prompt} ="


def make_examples(n: int, *, seed: int = 0, ops: tuple[str, ...] = tuple(OPERATIONS)) -> list[TaskExample]:
    """``n`` examples drawn from ``seed``; different seeds give (almost) disjoint sets."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    unknown = sorted(set(ops) - set(OPERATIONS))
    if unknown:
        raise ValueError(f"unknown task operations {unknown}; available: {sorted(OPERATIONS)}")
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = rng.randint(MIN_LEN, MAX_LEN)
        arg = "".join(rng.choice(ALPHABET) for _ in range(length))
        examples.append(TaskExample(rng.choice(ops), arg))
    return examples


def train_eval_examples(
    num_train: int, num_eval: int, *, seed: int = 0
) -> tuple[list[TaskExample], list[TaskExample]]:
    """Disjoint train and eval sets (eval prompts never appear in train)."""
    train = make_examples(num_train, seed=seed)
    seen = {ex.prompt for ex in train}
    eval_: list[TaskExample] = []
    draw_seed = seed + 1_000_003
    while len(eval_) < num_eval:
        for ex in make_examples(num_eval, seed=draw_seed):
            if ex.prompt not in seen and len(eval_) < num_eval:
                seen.add(ex.prompt)
                eval_.append(ex)
        draw_seed += 1
    return train, eval_
