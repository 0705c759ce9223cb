"""hf_dist.data and hf_dist.embedded.task: embedded task and tokenizer, chat masking, packing, local loading."""

import json

import pytest

from hf_dist.data import (
    DEFAULT_CHAT_TEMPLATE,
    IGNORE_INDEX,
    build_tokenizer,
    ensure_chat_template,
    load_local_dataset,
    matching_columns,
    pack_sequences,
    tokenize_chat,
    validate_messages,
)
from hf_dist.embedded.task import make_examples, train_eval_examples


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_task_examples_are_deterministic_and_eval_is_held_out():
    assert make_examples(5, seed=3) == make_examples(5, seed=3)
    train, eval_ = train_eval_examples(500, 50, seed=0)
    assert len(train) == 500 and len(eval_) == 50
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in eval_}
    ex = make_examples(1, seed=1)[0]
    assert ex.messages()[1]["content"] == ex.answer
    assert ex.text() == f"{ex.prompt} = {ex.answer}"


def test_task_rejects_unknown_operation():
    with pytest.raises(ValueError, match="available"):
        make_examples(1, ops=("multiply",))


def test_tokenizer_round_trips_text_and_has_chat_template(tokenizer):
    ids = tokenizer("reverse: abc = cba", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("reverse: abc = cba")  # one token per character
    assert tokenizer.decode(ids) == "reverse: abc = cba"
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE
    assert len(tokenizer) < 128


def test_labels_cover_exactly_the_assistant_answer_and_eos(tokenizer):
    messages = [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]
    enc = tokenize_chat(tokenizer, messages, max_length=64)
    trained = [tok for tok in enc["labels"] if tok != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "cba" + tokenizer.eos_token
    assert len(enc["labels"]) == len(enc["input_ids"]) == len(enc["attention_mask"])


def test_multi_turn_trains_every_assistant_turn_only(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "copy: ab"},
        {"role": "assistant", "content": "ab"},
        {"role": "user", "content": "upper: ab"},
        {"role": "assistant", "content": "AB"},
    ]
    enc = tokenize_chat(tokenizer, messages, max_length=128)
    trained = tokenizer.decode([t for t in enc["labels"] if t != IGNORE_INDEX])
    assert trained == f"ab{tokenizer.eos_token}AB{tokenizer.eos_token}"


def test_truncation_applies_to_labels_too(tokenizer):
    messages = [{"role": "user", "content": "copy: " + "a" * 50}, {"role": "assistant", "content": "a" * 50}]
    enc = tokenize_chat(tokenizer, messages, max_length=16)
    assert len(enc["input_ids"]) == 16 and all(t == IGNORE_INDEX for t in enc["labels"])


def test_missing_chat_template_falls_back_to_default_with_a_message(tokenizer, caplog):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    with caplog.at_level("WARNING"):
        assert ensure_chat_template(tokenizer) is True
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE
    assert "no chat template" in caplog.text
    assert ensure_chat_template(tokenizer) is False  # already has one now


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ([{"role": "bot", "content": "x"}], "role"),
        ([{"role": "user", "content": "x"}], "no 'assistant'"),
    ],
)
def test_bad_conversations_are_rejected(messages, match):
    with pytest.raises(ValueError, match=match):
        validate_messages(messages, 7)


def test_packing_fills_blocks_with_eos_separated_documents():
    blocks = pack_sequences([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4, eos_token_id=0)
    assert blocks == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert pack_sequences([[1, 2]], 8, eos_token_id=0) == []  # remainder shorter than a block is dropped
    with pytest.raises(ValueError, match="block_size"):
        pack_sequences([[1]], 1, eos_token_id=0)


def test_missing_dataset_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_local_dataset(tmp_path / "nope.jsonl")


def test_unknown_file_type_is_rejected(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match="supported"):
        load_local_dataset(path)


def test_jsonl_parquet_and_saved_folder_load_the_same_rows(tmp_path):
    rows = [{"prompt": f"copy: {c}", "completion": c} for c in "abc"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    ds = load_local_dataset(jsonl)
    assert ds.to_list() == rows
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert load_local_dataset(tmp_path / "d.parquet").to_list() == rows
    ds.save_to_disk(str(tmp_path / "saved"))
    assert load_local_dataset(tmp_path / "saved").to_list() == rows


def test_wrong_columns_name_the_expected_ones():
    assert matching_columns(["messages", "id"], "chat") == ("messages",)
    assert matching_columns(["prompt", "completion"], "chat") == ("prompt", "completion")
    with pytest.raises(ValueError, match=r"expects \['messages'\] or \['prompt', 'completion'\]"):
        matching_columns(["question", "answer"], "chat")
    with pytest.raises(ValueError, match=r"\['text'\]"):
        matching_columns(["content"], "text")


def test_sequence_parallel_batches_have_positions_and_one_length():
    """DeepSpeed's SP data adapter all-gathers a group's batches (one length each) and splits every sequence by its
    position_ids; without them the recipes died at step 1."""
    from hf_dist.data.tokenizer import build_tokenizer
    from hf_dist.recipe_utils.data import collator

    tokenizer = build_tokenizer(model_max_length=16)
    features = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    batch = collator(tokenizer, rows="padded", sp_size=2, seq_len=16)(features)
    assert batch["input_ids"].shape == (2, 16) and batch["position_ids"].tolist() == [list(range(16))] * 2
    assert "position_ids" not in collator(tokenizer, rows="padded")(features)
    with pytest.raises(ValueError, match="sequence length divisible by it, got 15"):
        collator(tokenizer, rows="padded", sp_size=2, seq_len=15)
