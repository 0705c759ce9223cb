"""The recipes' datasets: chat (SFT/LoRA) and packed text (pretraining), from local files or the embedded task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from hf_dist.data import (
    IGNORE_INDEX,
    PackedCollator,
    Truncation,
    check_packing,
    fill,
    load_local_dataset,
    matching_columns,
    pack,
    pack_batch,
    split_eval,
    to_messages,
    tokenize_chat,
    truncate,
    validate_messages,
)
from hf_dist.embedded.task import train_eval_examples
from hf_dist.recipe_utils.flags import DataArguments
from hf_dist.runtime.dist import deepspeed_config, parallel_sizes

# ---------------------------------------------------------------- data


class ChatData(NamedTuple):
    """The recipes' chat data: tokenized (and packed) splits, the embedded task's eval examples, and what rank 0
    says about them (truncation, fill)."""

    train: Any
    eval: Any
    task: Any
    lines: list[str]
    packed: bool = False
    fill: float | None = None  # real / computed tokens of the training rows as batched (packed or padded)


def chat_datasets(
    data_args: DataArguments, tokenizer: Any, *, seq_len: int, seed: int, packing: bool = False, batch: Any = None
) -> ChatData:
    """Chat data tokenized for SFT with labels on assistant tokens, cut to ``seq_len`` (counted), and packed into
    rows of ``seq_len`` when ``packing``. ``batch`` (:class:`BatchShape`): the fill line's micro-batch and steps."""
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
        return tokenize_chat(tokenizer, validate_messages(to_messages(example, columns), idx), None)

    def encode_all(ds: Any) -> tuple[Any, Truncation]:
        ds = ds.map(encode, with_indices=True, remove_columns=ds.column_names, desc="tokenizing")
        # an example truncated before its first assistant token has nothing to learn from: dropped, counted
        return truncate(ds, seq_len)

    (train, cut), (eval_, _) = encode_all(train), encode_all(eval_)
    lines, measured = [cut.line()] if cut.cut or cut.dropped else [], None
    if batch is not None:
        f = fill([len(ids) for ids in train["input_ids"]], seq_len, batch.micro_batch)
        lines.append(batch.fill_line(f, seq_len, packed=packing))
        measured = f["packed_fill" if packing else "padded_fill"]
    if packing:
        train, eval_ = pack(train, seq_len), pack(eval_, seq_len)
    return ChatData(train, eval_, task, lines, packing, measured)


@dataclass(frozen=True)
class BatchShape:
    """How rows become optimizer steps: micro-batch per rank, accumulation, data-parallel ranks."""

    micro_batch: int
    accumulation: int
    data_parallel: int

    def steps(self, rows: int) -> int:
        return -(-rows // (self.micro_batch * self.accumulation * self.data_parallel))

    def fill_line(self, f: dict[str, Any], seq_len: int, *, packed: bool) -> str:
        """:func:`hf_dist.data.fill`'s real / computed tokens and steps per epoch, padded per micro-batch and packed,
        in one line."""
        padded_rows = f["padded_batches"] * self.micro_batch  # whole micro-batches (the last may be short)
        packed_rows = f["packed_batches"] * self.micro_batch
        return (
            f"[hf_dist] data: {f['sequences']:,} conversations, {f['real_tokens']:,} tokens; padded per micro-batch "
            f"of {self.micro_batch}: {f['padded_fill']:.0%} real, {self.steps(padded_rows):,} steps/epoch; packed "
            f"into {seq_len:,}-token rows: {f['packed_fill']:.0%} real, {self.steps(packed_rows):,} steps/epoch "
            f"(training {'packed' if packed else 'padded: --packing false'})"
        )


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
            fn_kwargs={
                "tokenizer": tokenizer,
                "block_size": seq_len,
                "document_attention": data_args.document_attention,
            },
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


def use_packing(data_args: DataArguments, args: Any, *, attn_implementation: str | None, embedded: bool) -> bool:
    """Whether the chat recipe packs: ``--packing`` as given (``true`` refuses a layout or attention that cannot
    keep conversations apart, naming it); unset, on for ``--dataset`` where the layout allows it (else rank 0 says
    why not) and off for the embedded task, whose examples are uniformly short. See :func:`packing_attention`."""
    if data_args.packing is False or (data_args.packing is None and embedded):
        return False
    try:
        packing_attention(attn_implementation, args)
    except ValueError as exc:
        if data_args.packing:
            raise
        if args.process_index == 0:
            print(f"[hf_dist] packing off: {exc}", flush=True)
        return False
    return True


def packing_attention(attn_implementation: str | None, args: Any) -> None:
    """:func:`hf_dist.data.check_packing` for the layout of ``args`` (``TrainingArguments``): a ValueError where
    packed sequences cannot be kept apart; under Ulysses sequence parallelism the SP handler of ``args`` is given the
    document-aware sdpa (:mod:`hf_dist.data.attention`), which the model then loads with
    (:func:`~hf_dist.recipe_utils.model.parallel_load_kwargs`)."""
    parallelism = getattr(args, "parallelism_config", None)
    sizes = parallel_sizes(parallelism, deepspeed_config(args))
    attention = check_packing(attn_implementation, cp_size=sizes["cp"], sp_size=sizes["sp"])
    if sizes["sp"] > 1:  # accelerate's handler checks names only when built: the registered name is set after
        parallelism.sp_handler.sp_attn_implementation = attention


ROWS = ("padded", "blocks", "packed")  # what a recipe's dataset rows are: see collator()


def collator(tokenizer: Any, *, rows: str, sp_size: int = 1, seq_len: int | None = None) -> Any:
    """The batches of the recipes' datasets, by what their ``rows`` are:

    - ``padded``: chat examples, padded to the longest of the micro-batch (labels with IGNORE_INDEX);
    - ``blocks``: pretraining blocks of equal length (``default_data_collator``);
    - ``packed``: rows with ``position_ids`` (packed chat, blocks with per-document attention), batched by
      :class:`hf_dist.data.PackedCollator` into ``seq_len`` slots with each sequence attending only to itself.

    Under Ulysses sequence parallelism (``sp_size`` > 1) every batch also carries ``position_ids`` (accelerate's SP
    dataloader splits the sequence and needs each token's global position), and chat examples are padded to
    ``seq_len``: DeepSpeed's SP data adapter all-gathers the batches of the ranks in a group, which must have one
    length (``ulysses_sp.py`` ``refill``), and each rank then takes an equal slice.
    """
    from transformers import DataCollatorForSeq2Seq, default_data_collator

    if rows not in ROWS:
        raise ValueError(f"rows={rows!r}: expected one of {ROWS}")
    if rows == "packed":
        return PackedCollator(seq_len, pad_token_id=tokenizer.pad_token_id or 0, sp_size=sp_size)
    if rows == "blocks":
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
