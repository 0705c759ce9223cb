"""The recipes' datasets: chat (SFT/LoRA) and packed text (pretraining), from local files or the embedded task."""

from __future__ import annotations

from typing import Any

from hf_dist.data import (
    IGNORE_INDEX,
    load_local_dataset,
    matching_columns,
    pack_batch,
    split_eval,
    to_messages,
    tokenize_chat,
    validate_messages,
)
from hf_dist.embedded.task import train_eval_examples
from hf_dist.recipe_utils.args import DataArguments

# ---------------------------------------------------------------- data


def chat_datasets(data_args: DataArguments, tokenizer: Any, *, seq_len: int, seed: int):
    """(train, eval, task eval examples | None) tokenized for SFT with labels on assistant tokens."""
    from datasets import Dataset

    if data_args.dataset is None:
        train_ex, eval_ex = train_eval_examples(data_args.num_train_examples, data_args.num_eval_examples, seed=seed)
        train = Dataset.from_list([{"messages": ex.messages()} for ex in train_ex])
        eval_ = Dataset.from_list([{"messages": ex.messages()} for ex in eval_ex])
        columns, task = ("messages",), eval_ex
    else:
        train, eval_ = _user_splits(data_args, kind="chat", seed=seed)
        columns, task = matching_columns(train.column_names, "chat"), None

    def encode(example: dict[str, Any], idx: int) -> dict[str, list[int]]:
        return tokenize_chat(tokenizer, validate_messages(to_messages(example, columns), idx), seq_len)

    def encode_all(ds: Any) -> Any:
        ds = ds.map(encode, with_indices=True, remove_columns=ds.column_names, desc="tokenizing")
        # an example truncated before its first assistant token has nothing to learn from
        return ds.filter(lambda ex: any(label != IGNORE_INDEX for label in ex["labels"]))

    return encode_all(train), encode_all(eval_), task


def text_datasets(data_args: DataArguments, tokenizer: Any, *, seq_len: int, seed: int):
    """(train, eval, task eval examples | None) of packed ``seq_len`` blocks for continued pretraining."""
    from datasets import Dataset

    if data_args.dataset is None:
        train_ex, eval_ex = train_eval_examples(data_args.num_train_examples, data_args.num_eval_examples, seed=seed)
        train = Dataset.from_list([{"text": ex.text()} for ex in train_ex])
        eval_ = Dataset.from_list([{"text": ex.text()} for ex in eval_ex])
        task = eval_ex
    else:
        train, eval_ = _user_splits(data_args, kind="text", seed=seed)
        matching_columns(eval_.column_names, "text")
        task = None

    def pack(ds: Any) -> Any:
        return ds.map(
            pack_batch,
            batched=True,
            batch_size=1000,
            remove_columns=ds.column_names,
            fn_kwargs={"tokenizer": tokenizer, "block_size": seq_len},
            desc="packing",
        )

    train, eval_ = pack(train), pack(eval_)
    if len(train) == 0 or len(eval_) == 0:
        raise ValueError(
            f"packing into blocks of {seq_len} tokens left {len(train)} train / {len(eval_)} eval blocks; "
            "use a smaller --max_seq_length or more text"
        )
    return train, eval_, task


def check_dataset(data_args: DataArguments, *, kind: str) -> None:
    """Fail fast on a missing path or wrong columns, before any model is built (``datasets`` caches the load)."""
    for path in filter(None, (data_args.dataset, data_args.eval_dataset)):
        matching_columns(load_local_dataset(path).column_names, kind)


def _user_splits(data_args: DataArguments, *, kind: str, seed: int):
    train = load_local_dataset(data_args.dataset)
    matching_columns(train.column_names, kind)
    if data_args.eval_dataset is not None:
        return train, load_local_dataset(data_args.eval_dataset)
    return split_eval(train, data_args.eval_fraction, seed=seed)


def collator(tokenizer: Any, *, packed: bool, sp_size: int = 1, seq_len: int | None = None) -> Any:
    """Packed blocks are already equal length; chat examples are padded (labels with IGNORE_INDEX).

    Under Ulysses sequence parallelism (``sp_size`` > 1) every batch also carries ``position_ids`` (accelerate's SP
    dataloader splits the sequence and needs each token's global position), and chat examples are padded to
    ``seq_len``: DeepSpeed's SP data adapter all-gathers the batches of the ranks in a group, which must have one
    length (``ulysses_sp.py`` ``refill``), and each rank then takes an equal slice.
    """
    from transformers import DataCollatorForSeq2Seq, default_data_collator

    if packed:
        base = default_data_collator
    elif sp_size > 1:
        if not seq_len or seq_len % sp_size:
            raise ValueError(
                f"sequence parallelism over {sp_size} ranks needs a sequence length divisible by it, got {seq_len}"
            )
        base = DataCollatorForSeq2Seq(
            tokenizer, padding="max_length", max_length=seq_len, label_pad_token_id=IGNORE_INDEX, return_tensors="pt"
        )
    else:
        base = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
    return base if sp_size == 1 else _WithPositions(base, sp_size)


class _WithPositions:
    """A collator whose batches also hold ``position_ids`` 0..len-1 per row, for sequence parallelism."""

    def __init__(self, base: Any, sp_size: int) -> None:
        self.base, self.sp_size = base, sp_size

    def __call__(self, features: list) -> dict:
        import torch

        batch = self.base(features)
        rows, length = batch["input_ids"].shape
        if length % self.sp_size:
            raise ValueError(
                f"a batch of {length} tokens per row cannot be split over sp_size {self.sp_size}; use a sequence "
                f"length divisible by {self.sp_size} (--max_seq_length)"
            )
        batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
        return batch
