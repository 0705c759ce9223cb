"""Packing whole conversations: best-fit-decreasing rows, and no conversation seeing another.

Each conversation's logits inside a packed batch are compared with its logits alone, on a model with its default
config (``use_cache=True``), for sdpa, eager and flash-attention's varlen path (a CPU reference kernel behind
transformers' own ``_flash_attention_forward``); each comparison has a control that contaminates, so it can fail.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_dist.data import IGNORE_INDEX, PackedCollator, check_packing, fill, pack, real_tokens, truncate
from hf_dist.data.attention import DOCUMENT_SDPA, document_mask, register_document_attention
from hf_dist.data.packing import best_fit_decreasing, document_positions, pack_sequences

VOCAB = 64


def tiny_llama(attn: str = "sdpa", **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn, **overrides,
    )  # fmt: skip
    assert config.use_cache  # the default: the model builds a cache unless the batch says otherwise
    return LlamaForCausalLM(config).eval()


def conversations(lengths, seed=0):
    """Token lists with labels on their second half (the 'assistant' part)."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(1, VOCAB) for _ in range(n)]
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (n // 2) + ids[n // 2 :]})
    return out


def as_dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


LENGTHS = [5, 9, 3, 12, 7, 2, 15, 11, 4]


# ---------------------------------------------------------------- rows


def test_best_fit_decreasing_places_every_sequence_once_and_fits():
    rng = random.Random(1)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 128)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert bins == best_fit_decreasing(lengths, 128)  # deterministic
    assert len(bins) <= -(-sum(lengths) // 128) * 1.1  # BFD is near the lower bound on this data


def test_best_fit_decreasing_picks_the_fullest_bin():
    # 7 opens bin 0 (room 3), 6 opens bin 1 (room 4); 3 goes to bin 0 (the best fit), 4 to bin 1
    assert best_fit_decreasing([7, 6, 3, 4], 10) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="sequence 0 has 11 tokens, more than the row's 10"):
        best_fit_decreasing([11], 10)


def test_pack_restarts_positions_and_masks_each_first_label():
    rows = conversations(LENGTHS)
    packed = pack(as_dataset(rows), 16)
    assert packed.column_names == ["input_ids", "labels", "position_ids"]
    assert all(len(r) <= 16 for r in packed["input_ids"])
    assert sum(len(r) for r in packed["input_ids"]) == sum(LENGTHS)
    seen = []
    for ids, labels, pos in zip(packed["input_ids"], packed["labels"], packed["position_ids"], strict=True):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:], strict=False):
            assert pos[a:b] == list(range(b - a))
            assert labels[a] == IGNORE_INDEX
            seen.append(ids[a:b])
    assert sorted(map(tuple, seen)) == sorted(tuple(r["input_ids"]) for r in rows)


def test_pack_refuses_what_it_cannot_pack():
    rows = conversations([4, 5])
    with pytest.raises(ValueError, match="already has position_ids: it looks packed already"):
        pack(pack(as_dataset(rows), 16), 16)
    with pytest.raises(ValueError, match=r"missing \['labels'\].*tokenize_chat"):
        pack(as_dataset([{"input_ids": [1, 2, 3]}]), 16)


def test_truncate_counts_what_it_cuts_and_refuses_nothing_left():
    rows = conversations([30, 8, 20])
    rows.append({"input_ids": list(range(1, 21)), "labels": [IGNORE_INDEX] * 12 + list(range(13, 21))})
    cut, report = truncate(as_dataset(rows), 12)
    # the 30-token and the last conversation have their first label past 12: nothing left to learn from
    assert (report.sequences, report.cut, report.tokens_cut, report.dropped) == (4, 3, 18 + 8 + 8, 2)
    assert max(len(r) for r in cut["input_ids"]) == 12 and cut.num_rows == 2
    assert "3 of 4 conversations cut (34 tokens), 2 dropped" in report.line()
    with pytest.raises(ValueError, match="none of the 1 sequences has a label token within 8 tokens"):
        truncate(as_dataset(rows[-1:]), 8)


def test_fill_counts_padded_and_packed_real_tokens():
    f = fill([10, 2, 10, 2], seq_len=12, micro_batch=2)
    assert f["real_tokens"] == 24 and f["padded_fill"] == 24 / 40 and f["packed_fill"] == 1.0
    assert (f["padded_batches"], f["packed_batches"]) == (2, 1)


# ---------------------------------------------------------------- the batch


def test_collator_pads_every_row_to_seq_len_as_its_own_sequence():
    packed = pack(as_dataset(conversations(LENGTHS)), 16)
    batch = PackedCollator(16, pad_token_id=0)(list(packed))
    assert batch["input_ids"].shape == (packed.num_rows, 16) and "attention_mask" not in batch
    assert batch["use_cache"] is False
    assert int(real_tokens(batch)) == sum(LENGTHS)
    cu = batch["cu_seq_lens_q"].tolist()
    # every conversation and every padded tail is one segment of the flattened rows
    assert len(cu) - 1 == len(LENGTHS) + sum(len(r) < 16 for r in packed["input_ids"])
    assert cu[-1] == batch["input_ids"].numel() and batch["max_length_q"] == max(
        b - a for a, b in zip(cu, cu[1:], strict=False)
    )
    assert (batch["labels"][batch["position_ids"] == 0] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="PackedCollator takes the rows of hf_dist.data.pack"):
        PackedCollator(16)([{"input_ids": [1, 2], "labels": [1, 2]}])
    with pytest.raises(ValueError, match="a packed row has 15 tokens, more than seq_len 8: pack with seq_len=8"):
        PackedCollator(8)(list(packed))


def test_real_tokens_of_a_padded_batch_is_its_mask():
    batch = {
        "input_ids": torch.ones(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]]),
    }
    assert int(real_tokens(batch)) == 7


def _alone(model, rows):
    with torch.no_grad():
        return [model(input_ids=torch.tensor([r["input_ids"]])).logits[0] for r in rows]


def _split(logits, batch):
    """Each sequence's logits in a packed batch, in row order (the padded tails left out)."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        pos = batch["position_ids"][r]
        starts = [*(pos == 0).nonzero().view(-1).tolist(), len(pos)]
        for a, b in zip(starts, starts[1:], strict=False):
            if (batch["labels"][r, a:b] != IGNORE_INDEX).any():
                out.append((batch["input_ids"][r, a:b].tolist(), logits[r, a:b]))
    return out


def _max_difference(model, rows, batch, inputs=None):
    """The largest difference of a sequence's logits in ``batch`` (fed as ``inputs``, default all of it) from alone."""
    with torch.no_grad():
        packed = model(**(batch if inputs is None else inputs)).logits
    alone = {tuple(r["input_ids"]): logits for r, logits in zip(rows, _alone(model, rows), strict=True)}
    split = _split(packed, batch)
    assert len(split) == len(rows)
    return max(float((logits - alone[tuple(ids)]).abs().max()) for ids, logits in split)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_conversation_in_a_packed_batch_matches_itself_alone(attn):
    model, rows = tiny_llama(attn), conversations(LENGTHS)
    batch = PackedCollator(16)(list(pack(as_dataset(rows), 16)))
    assert _max_difference(model, rows, batch) < 1e-5
    # the control: the same rows without what the batch carries (the default config builds a cache) contaminate
    plain = {k: batch[k] for k in ("input_ids", "position_ids")}
    with torch.no_grad():
        contaminated = _split(model(**plain).logits, batch)
    alone = {tuple(r["input_ids"]): lg for r, lg in zip(rows, _alone(model, rows), strict=True)}
    assert max(float((lg - alone[tuple(ids)]).abs().max()) for ids, lg in contaminated) > 1e-2


def _reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, **kwargs):
    """flash_attn_varlen_func on CPU: causal attention inside each [cu[i], cu[i+1]) of the flattened tokens."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
    assert max_seqlen_q == int(cu_seqlens_q.diff().max())
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for a, b in zip(cu, cu[1:], strict=False):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # (heads, tokens, dim)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=kwargs.get("softmax_scale"), enable_gqa=True
        ).transpose(0, 1)
    return out


def _reference_dense(q, k, v, **kwargs):
    """flash_attn_func on CPU: causal over each whole row (what runs when no varlen arguments arrive)."""
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, scale=kwargs.get("softmax_scale"), enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """transformers' flash-attention path (``_flash_attention_forward``, its branch choice) with CPU kernels."""
    import inspect

    from transformers import modeling_flash_attention_utils as fa

    # newer transformers also return a kv-cache kernel and a paged kwargs processor; 5.0 does not
    with_kvcache = "flash_kvcache_fn" in inspect.getsource(fa._flash_attention_forward)

    def kernels(implementation=None, attention_wrapper=None, allow_all_kernels=False):
        process = fa._lazy_define_process_function(_reference_varlen)
        if with_kvcache:
            return (_reference_dense, _reference_varlen, None, fa._pad_input, fa._unpad_input), (process, None)
        return (_reference_dense, _reference_varlen, fa._pad_input, fa._unpad_input), process

    monkeypatch.setattr(fa, "lazy_import_flash_attention", kernels)


def test_flash_attention_varlen_arguments_keep_conversations_apart(flash_on_cpu):
    model, rows = tiny_llama("sdpa"), conversations(LENGTHS)
    model.config._attn_implementation = "flash_attention_2"  # no flash_attn on CPU: its kernels are the fixture's
    batch = PackedCollator(16)(list(pack(as_dataset(rows), 16)))
    assert batch["input_ids"].shape[0] > 1  # several rows: transformers' position_ids detection would not run
    assert _max_difference(model, rows, batch) < 1e-5
    without = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    assert _max_difference(model, rows, without) > 1e-2  # the control: the dense kernel over whole rows


def test_loss_per_label_token_equals_the_unpacked_loss():
    model, rows = tiny_llama("sdpa"), conversations(LENGTHS)
    batch = PackedCollator(16)(list(pack(as_dataset(rows), 16)))
    labels_total = sum(sum(t != IGNORE_INDEX for t in r["labels"][1:]) for r in rows)
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == labels_total
    with torch.no_grad():
        packed = model(**batch, num_items_in_batch=labels_total).loss
        alone = sum(
            model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]]),
                  num_items_in_batch=labels_total).loss
            for r in rows
        )  # fmt: skip
    assert torch.allclose(packed, alone, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- layouts and attention refused


def test_check_packing_refuses_what_cannot_keep_conversations_apart():
    for attn in ("sdpa", "eager", "flash_attention_2", None):
        assert check_packing(attn) == attn
    with pytest.raises(ValueError, match=r"context parallelism \(cp_size=2\).*--packing false"):
        check_packing("sdpa", cp_size=2)
    assert check_packing("sdpa", sp_size=2) == check_packing(None, sp_size=2) == DOCUMENT_SDPA
    with pytest.raises(ValueError, match=r"'flash_attention_2' cannot keep packed conversations apart under sequence"):
        check_packing("flash_attention_2", sp_size=2)
    with pytest.raises(ValueError, match=r"attention 'paged\|sdpa' cannot keep packed conversations apart in a"):
        check_packing("paged|sdpa")


def test_document_sdpa_separates_sequences_from_position_ids_alone():
    """What DeepSpeed's Ulysses hands the attention it wraps: no mask, the row's position_ids. Plain sdpa then attends
    across the row (the control); the document-aware sdpa, registered and loaded by name, keeps each apart."""
    register_document_attention()
    model, rows = tiny_llama(DOCUMENT_SDPA), conversations(LENGTHS)
    batch = PackedCollator(16)(list(pack(as_dataset(rows), 16)))
    as_ulysses = {k: batch[k] for k in ("input_ids", "position_ids")}  # no use_cache=False, no varlen arguments
    assert _max_difference(model, rows, batch, as_ulysses) < 1e-5
    model.config._attn_implementation = "sdpa"
    assert _max_difference(model, rows, batch, as_ulysses) > 1e-2


def test_document_mask_is_causal_within_each_sequence():
    mask = document_mask(torch.tensor([[0, 1, 0, 1, 2]]), 5)[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask, expected)
    assert document_mask(torch.arange(5)[None], 5) is None  # one sequence: plain causal sdpa


# ---------------------------------------------------------------- pretraining: per-document attention


def test_document_positions_restart_at_each_document_and_block():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    blocks = pack_sequences(docs, 4, eos_token_id=0)  # 1 2 3 0 | 4 5 6 7 | 8 0 9 0
    assert blocks == [[1, 2, 3, 0], [4, 5, 6, 7], [8, 0, 9, 0]]
    assert document_positions(docs, 4, eos_token_id=0) == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 1]]


def test_throughput_counts_real_tokens_and_the_slots_computed():
    from hf_dist.callbacks.throughput import _count_tokens

    packed = pack(as_dataset(conversations(LENGTHS)), 16)
    batch = PackedCollator(16)(list(packed))
    real, slots, seq_len = _count_tokens((), batch)
    assert (int(real), slots, seq_len) == (sum(LENGTHS), batch["input_ids"].numel(), 16)
    padded = {
        "input_ids": torch.ones(2, 8, dtype=torch.long),
        "attention_mask": torch.tensor([[1] * 8, [1] * 3 + [0] * 5]),
    }
    real, slots, _ = _count_tokens((), padded)
    assert (int(real), slots) == (11, 16)


# ---------------------------------------------------------------- the recipes' refusals


def _recipe_args(cp: int = 1, sp: int = 1, packing=None):
    from types import SimpleNamespace

    from accelerate import ParallelismConfig

    from hf_dist.recipe_utils.flags import DataArguments

    parallelism = ParallelismConfig(cp_size=cp) if cp > 1 else None
    args = SimpleNamespace(parallelism_config=parallelism, deepspeed=None, process_index=0)
    return DataArguments(dataset="chat.jsonl", packing=packing), args


def test_the_recipe_packs_by_default_and_says_why_not_under_context_parallelism(capsys):
    from hf_dist.recipe_utils import use_packing

    data_args, args = _recipe_args()
    assert use_packing(data_args, args, attn_implementation=None, embedded=False)
    assert not use_packing(data_args, args, attn_implementation=None, embedded=True)  # uniform short examples
    data_args, args = _recipe_args(cp=2)
    assert not use_packing(data_args, args, attn_implementation=None, embedded=False)
    assert capsys.readouterr().out.startswith("[hf_dist] packing off: packing under context parallelism (cp_size=2)")
    data_args, args = _recipe_args(cp=2, packing=True)
    with pytest.raises(ValueError, match=r"context parallelism \(cp_size=2\) would let conversations attend"):
        use_packing(data_args, args, attn_implementation=None, embedded=False)
    data_args, args = _recipe_args(packing=True)
    with pytest.raises(ValueError, match=r"attention 'paged\|eager' cannot keep packed conversations apart"):
        use_packing(data_args, args, attn_implementation="paged|eager", embedded=False)


@pytest.mark.parametrize("columns", [["input_ids", "labels"], ["input_ids", "labels", "position_ids"]])
def test_the_chat_recipe_refuses_tokenized_or_packed_rows_saying_what_it_expects(columns):
    from hf_dist.data import matching_columns

    state = "packed" if "position_ids" in columns else "tokenized"
    with pytest.raises(
        ValueError, match=rf"expects \['messages'\].*already {state}: the recipe renders, tokenizes and"
    ):
        matching_columns(columns, "chat")


def test_best_fit_decreasing_equals_the_plain_search():
    """The sorted open bins pick what a scan of every open bin picks (smallest room that fits, then the earlier bin).
    On 400,000 lengths shaped as the issue's chat corpus (median 410, p90 2,107, cut to 2,048) it takes ~1.2 s."""

    def plain(lengths, capacity):
        bins, rooms = [], []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            fits = [(room, b) for b, room in enumerate(rooms) if room >= lengths[i]]
            if fits:
                _, b = min(fits)
                bins[b].append(i)
                rooms[b] -= lengths[i]
            else:
                bins.append([i])
                rooms.append(capacity - lengths[i])
        return bins

    rng = random.Random(3)
    for capacity in (1, 7, 64, 100):
        lengths = [rng.randint(1, capacity) for _ in range(300)]
        assert best_fit_decreasing(lengths, capacity) == plain(lengths, capacity)


def test_packing_under_sequence_parallelism_gives_ulysses_and_the_model_the_document_aware_sdpa():
    from types import SimpleNamespace

    from hf_dist.planning.features import installed_features

    if not installed_features().sequence_parallel:
        pytest.skip("this accelerate/DeepSpeed has no Ulysses SP; the recipes refuse it (test_recipe_refusals.py)")
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from hf_dist.recipe_utils import packing_attention, parallel_load_kwargs

    handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    parallelism = ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=handler)
    args = SimpleNamespace(parallelism_config=parallelism, deepspeed={"sequence_parallel_size": 2}, process_index=0)
    packing_attention(None, args)
    assert handler.sp_attn_implementation == DOCUMENT_SDPA
    assert parallel_load_kwargs(args)["attn_implementation"] == DOCUMENT_SDPA
