"""Packing: many sequences in one row of ``seq_len`` tokens, each attending only to itself.

Chat conversations (:func:`pack`, :class:`PackedCollator`) are packed whole, best-fit-decreasing, with
``position_ids`` restarting at each conversation and no label predicting across a boundary. What keeps attention
inside a conversation is the batch itself, for every attention implementation, with the model's default config:

- sdpa / eager: the batch has ``position_ids``, **no** ``attention_mask`` and ``use_cache=False``, the one
  case where transformers builds a per-sequence causal mask from the restarting positions
  (``masking_utils.find_packed_sequence_indices``; a 2D mask or a cache, which the config's default
  ``use_cache=True`` builds, turns that detection off);
- flash-attention: ``cu_seq_lens_q/k`` and ``max_length_q/k`` (what transformers' ``DataCollatorWithFlattening``
  emits), which select the varlen kernel over the flattened rows whatever the micro-batch;
- Ulysses sequence parallelism: ``position_ids`` only (DeepSpeed all-gathers them and shards every ``[rows, seq]``
  tensor, so the ``cu_seq_lens`` cannot travel), read by the attention it wraps: hf_dist's document-aware sdpa
  (:mod:`hf_dist.data.attention`; :func:`check_packing` returns it).

Raw text for continued pretraining (:func:`pack_sequences`, :func:`pack_batch`) is concatenated and cut into
blocks; ``document_attention=True`` restarts ``position_ids`` at each document (and each block) so documents keep
to themselves as well.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hf_dist.data.attention import DOCUMENT_SDPA, register_document_attention
from hf_dist.data.chat import IGNORE_INDEX

PACKED_COLUMNS = ("input_ids", "labels", "position_ids")
# attention implementations that keep packed sequences apart from the batch above (transformers' own paths; each is
# tested against every sequence alone in tests/unit/test_packing.py, flash through its varlen arguments)
SEPARATING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# under Ulysses SP DeepSpeed drops the mask and gives the wrapped attention the gathered position_ids, which plain
# sdpa ignores and flash reads only at one row per micro-batch: sdpa is replaced by the document-aware sdpa
SP_SEPARATING_ATTENTION = ("sdpa", DOCUMENT_SDPA)


# ---------------------------------------------------------------- chat: whole conversations, best-fit-decreasing


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``: longest first, each into the fullest bin
    it fits (ties: the earlier bin). Deterministic given the lengths; every length must be <= ``capacity``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin index), sorted: the first with room >= n fits best
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"sequence {i} has {n} tokens, more than the row's {capacity}; truncate it first")
        at = bisect.bisect_left(open_bins, (n, -1))
        if at == len(open_bins):
            bins.append([i])
            room, b = capacity - n, len(bins) - 1
        else:
            room, b = open_bins.pop(at)
            bins[b].append(i)
            room -= n
        if room > 0:
            bisect.insort(open_bins, (room, b))
    return bins


@dataclass(frozen=True)
class Truncation:
    """What cutting sequences to ``seq_len`` cost: said in one line by the recipes (rank 0)."""

    sequences: int  # all sequences seen
    cut: int  # sequences longer than seq_len
    tokens_cut: int
    dropped: int  # sequences left with no label token after the cut: nothing to learn from
    seq_len: int

    def line(self) -> str:
        return (
            f"[hf_dist] truncation to {self.seq_len} tokens: {self.cut} of {self.sequences} conversations cut "
            f"({self.tokens_cut:,} tokens), {self.dropped} dropped with no assistant token left"
        )


def truncate(dataset: Any, seq_len: int) -> tuple[Any, Truncation]:
    """``dataset`` (``input_ids``, ``labels``) with rows cut to ``seq_len`` and rows without a label token dropped,
    and what that cost. A ValueError when nothing is left, with the counts."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    cut = [n - seq_len for n in lengths if n > seq_len]
    if cut:
        dataset = dataset.map(
            lambda ex: {k: ex[k][:seq_len] for k in ("input_ids", "labels", "attention_mask") if k in ex},
            desc="truncating",
        )
    keep = [i for i, labels in enumerate(dataset["labels"]) if any(t != IGNORE_INDEX for t in labels)]
    report = Truncation(len(lengths), len(cut), sum(cut), len(lengths) - len(keep), seq_len)
    if not keep:
        raise ValueError(
            f"none of the {len(lengths)} sequences has a label token within {seq_len} tokens "
            f"({len(cut)} were longer and cut): use a longer --max_seq_length, or check that the data has "
            "assistant turns"
        )
    return (dataset.select(keep) if len(keep) < len(lengths) else dataset), report


def check_pack_input(column_names: Sequence[str]) -> None:
    """Refuse what :func:`pack` cannot pack, saying what it expects."""
    if "position_ids" in column_names:
        raise ValueError(
            "this dataset already has position_ids: it looks packed already; pass the tokenized conversations "
            "(input_ids, labels) to hf_dist.data.pack, or turn packing off (--packing false)"
        )
    missing = [c for c in ("input_ids", "labels") if c not in column_names]
    if missing:
        raise ValueError(
            f"packing needs tokenized sequences with input_ids and labels (IGNORE_INDEX={IGNORE_INDEX} where no loss); "
            f"this dataset has {sorted(column_names)}, missing {missing}; tokenize chat data with "
            "hf_dist.data.tokenize_chat first"
        )


def pack(dataset: Any, seq_len: int) -> Any:
    """Tokenized sequences (``input_ids``, ``labels``) → rows of at most ``seq_len`` tokens (``input_ids``,
    ``labels``, ``position_ids``), whole sequences packed best-fit-decreasing.

    ``position_ids`` restart at 0 at each sequence; the label of each sequence's first token is ``IGNORE_INDEX``
    (it would be predicted by the previous sequence's last token). Sequences longer than ``seq_len`` must be cut
    first (:func:`truncate`). Batch the rows with :class:`PackedCollator`. Deterministic given the data.
    """
    from datasets import Dataset

    check_pack_input(dataset.column_names)
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2 (one input and one target token)")
    ids, labels = dataset["input_ids"], dataset["labels"]
    rows: dict[str, list] = {name: [] for name in PACKED_COLUMNS}
    for members in best_fit_decreasing([len(x) for x in ids], seq_len):
        row = {name: [] for name in PACKED_COLUMNS}
        for i in members:
            row["input_ids"].extend(ids[i])
            row["labels"].extend([IGNORE_INDEX, *labels[i][1:]])
            row["position_ids"].extend(range(len(ids[i])))
        for name in PACKED_COLUMNS:
            rows[name].append(row[name])
    return Dataset.from_dict(rows)


def fill(lengths: Sequence[int], seq_len: int, micro_batch: int) -> dict[str, float | int]:
    """Real / computed tokens and rows for ``lengths`` padded per micro-batch (in order) and packed into
    ``micro_batch`` rows of ``seq_len``: what the plan states when it has the data."""
    lengths = [min(n, seq_len) for n in lengths]
    real = sum(lengths)
    padded = sum(max(lengths[i : i + micro_batch]) * len(lengths[i : i + micro_batch])
                 for i in range(0, len(lengths), micro_batch))  # fmt: skip
    rows = len(best_fit_decreasing(lengths, seq_len))
    return {
        "sequences": len(lengths),
        "real_tokens": real,
        "padded_fill": real / padded if padded else 0.0,
        "packed_fill": real / (rows * seq_len) if rows else 0.0,
        "padded_batches": -(-len(lengths) // micro_batch),
        "packed_batches": -(-rows // micro_batch),
    }


# ---------------------------------------------------------------- the batch


class PackedCollator:
    """Rows of :func:`pack` → a batch that ``model(**batch)`` trains on with no conversation seeing another.

    Each row is padded to ``seq_len`` (a fixed number of token slots per micro-batch, what the memory plan
    counts); the padding is a sequence of its own (positions from 0, labels ``IGNORE_INDEX``). The batch holds
    ``input_ids``, ``labels``, ``position_ids``, ``use_cache=False`` and no ``attention_mask``; with
    ``sp_size`` 1 also ``cu_seq_lens_q/k`` and ``max_length_q/k`` for flash-attention's varlen kernel. See the
    module's docstring for why each is there. ``seq_len=None`` pads to the longest row (rounded up to a multiple
    of ``sp_size``).
    """

    def __init__(self, seq_len: int | None = None, *, pad_token_id: int = 0, sp_size: int = 1) -> None:
        if seq_len is not None and seq_len % sp_size:
            raise ValueError(f"seq_len {seq_len} must be divisible by sp_size {sp_size} (each rank takes a slice)")
        self.seq_len, self.pad_token_id, self.sp_size = seq_len, pad_token_id, sp_size

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        for f in features:
            missing = [c for c in PACKED_COLUMNS if c not in f]
            if missing:
                raise ValueError(
                    f"PackedCollator takes the rows of hf_dist.data.pack ({', '.join(PACKED_COLUMNS)}); a row "
                    f"lacks {missing}: pack the dataset first, or use a padding collator"
                )
        width = self.seq_len or -(-max(len(f["input_ids"]) for f in features) // self.sp_size) * self.sp_size
        columns = {name: [] for name in PACKED_COLUMNS}
        for f in features:
            n = len(f["input_ids"])
            if n > width:
                raise ValueError(f"a packed row has {n} tokens, more than seq_len {width}: pack with seq_len={width}")
            columns["input_ids"].append([*f["input_ids"], *[self.pad_token_id] * (width - n)])
            columns["labels"].append([*f["labels"], *[IGNORE_INDEX] * (width - n)])
            columns["position_ids"].append([*f["position_ids"], *range(width - n)])
        batch: dict[str, Any] = {name: torch.tensor(v, dtype=torch.long) for name, v in columns.items()}
        batch["labels"][batch["position_ids"] == 0] = IGNORE_INDEX  # no label predicted across a boundary
        batch["use_cache"] = False
        if self.sp_size == 1:
            batch.update(varlen_kwargs(batch["position_ids"]))
        return batch


def sequence_starts(position_ids: Any) -> Any:
    """Flat indices (over rows × seq) where a sequence starts: position 0, or the first token of a row."""
    import torch

    flat = position_ids.reshape(-1)
    starts = flat == 0
    starts[:: position_ids.shape[-1]] = True
    return torch.nonzero(starts).view(-1)


def varlen_kwargs(position_ids: Any) -> dict[str, Any]:
    """``cu_seq_lens_q/k`` (int32, over the flattened rows) and ``max_length_q/k`` for flash-attention varlen."""
    import torch

    starts = sequence_starts(position_ids).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([position_ids.numel()], dtype=torch.int32)])
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def real_tokens(batch: dict[str, Any]) -> Any:
    """Tokens of ``batch`` that are not padding, as a 0-d tensor on the batch's device (no host sync): the ones of a
    2D ``attention_mask``; in a packed batch all but each row's padding sequence (the last sequence of a row,
    after another, with no label token: what :class:`PackedCollator` appends); else every token."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is not None and getattr(mask, "ndim", 0) == 2:
        return mask.sum()
    pos, labels = batch.get("position_ids"), batch.get("labels")
    if pos is None or labels is None or pos.shape != ids.shape or labels.shape != ids.shape:
        return ids.new_tensor(ids.numel())
    starts = pos == 0
    starts[:, 0] = True
    seg = starts.cumsum(-1)
    last = seg == seg[:, -1:]
    padding = ~((labels != IGNORE_INDEX) & last).any(-1) & (seg[:, -1] > 1)
    return ids.numel() - (last & padding[:, None]).sum()


# ---------------------------------------------------------------- attention implementations and layouts


def check_packing(attn_implementation: str | None, *, cp_size: int = 1, sp_size: int = 1) -> str | None:
    """The attention a packed run uses, or a ValueError naming a combination that cannot keep packed sequences
    apart and what works. Under Ulysses sequence parallelism sdpa becomes :data:`DOCUMENT_SDPA` (registered here:
    load the model with it and give DeepSpeed's SP handler the same name); otherwise the attention as given."""
    impl = attn_implementation or "sdpa"
    if cp_size > 1:
        raise ValueError(
            f"packing under context parallelism (cp_size={cp_size}) would let conversations attend to each other: "
            "torch's context-parallel attention runs causal sdpa without a mask. Use --packing false with cp, or "
            "sequence parallelism (--sp_size) with packing"
        )
    if sp_size > 1 and impl in SP_SEPARATING_ATTENTION:
        return register_document_attention()
    allowed = SP_SEPARATING_ATTENTION if sp_size > 1 else SEPARATING_ATTENTION
    if impl not in allowed:
        where = f"under sequence parallelism (sp_size={sp_size})" if sp_size > 1 else "in a packed row"
        raise ValueError(
            f"attention {impl!r} cannot keep packed conversations apart {where}; use one of {list(allowed)}, "
            "or --packing false"
        )
    return attn_implementation


# ---------------------------------------------------------------- raw text: documents concatenated into blocks


def pack_sequences(documents: Iterable[list[int]], block_size: int, *, eos_token_id: int | None) -> list[list[int]]:
    """Concatenate token lists (each followed by ``eos_token_id``) and cut them into ``block_size`` blocks.

    Every training token is a real token (no pad, no wasted compute). The trailing remainder shorter than a block
    is dropped, so at most ``block_size - 1`` tokens are lost. Document boundaries: :func:`document_positions`.
    """
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be >= 2 (one input and one target token)")
    blocks: list[list[int]] = []
    buffer: list[int] = []
    for doc in documents:
        buffer.extend(doc)
        if eos_token_id is not None:
            buffer.append(eos_token_id)
        while len(buffer) >= block_size:
            blocks.append(buffer[:block_size])
            buffer = buffer[block_size:]
    return blocks


def document_positions(
    documents: Iterable[list[int]], block_size: int, *, eos_token_id: int | None
) -> list[list[int]]:
    """The ``position_ids`` of :func:`pack_sequences`' blocks, restarting at 0 at each document and each block: a
    document then attends only to itself (a document cut by a block edge goes on as a new sequence)."""
    blocks: list[list[int]] = []
    block: list[int] = []
    for doc in documents:
        n = len(doc) + (eos_token_id is not None)
        while n:
            take = min(n, block_size - len(block))
            block.extend(range(take))
            n -= take
            if len(block) == block_size:
                blocks.append(block)
                block = []
    return blocks


def pack_batch(
    batch: dict[str, list], *, tokenizer, block_size: int, text_column: str = "text", document_attention: bool = False
) -> dict[str, list]:
    """``datasets.map(batched=True)`` function: tokenize a batch of raw text and pack it; with
    ``document_attention`` the blocks carry ``position_ids`` restarting at each document (batch them with
    :class:`PackedCollator`) instead of an all-ones ``attention_mask``."""
    ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
    blocks = pack_sequences(ids, block_size, eos_token_id=tokenizer.eos_token_id)
    out = {"input_ids": blocks, "labels": [b[:] for b in blocks]}
    if document_attention:
        out["position_ids"] = document_positions(ids, block_size, eos_token_id=tokenizer.eos_token_id)[: len(blocks)]
    else:
        out["attention_mask"] = [[1] * block_size for _ in blocks]
    return out
