import pytest

from hf_dist.checkpoint.formats.contents import read_contents
from hf_dist.planning.layout import CheckpointFamily


def test_checkpoint_dir_inner_dir_and_tag_dir_are_all_accepted(zero_ckpt):
    root, _ = zero_ckpt
    (root / "trainer_state.json").write_text('{"global_step": 3}')
    for path in (root, root / "global_step3"):
        info = read_contents(path)
        assert (info.format, info.stage, info.tag, info.step) == ("deepspeed", 3, "global_step3", 3)
        assert info.path == root / "global_step3" and info.config_dir == root and info.train_dtype == "bf16"


def test_wrong_tag_lists_available_tags(zero_ckpt):
    root, _ = zero_ckpt
    with pytest.raises(ValueError, match=r"tag 'global_step9' not found .*\['global_step3'\]"):
        read_contents(root, tag="global_step9")


def test_latest_naming_a_missing_tag(zero_ckpt):
    root, _ = zero_ckpt
    (root / "latest").write_text("global_step7")
    with pytest.raises(FileNotFoundError, match=r"latest names tag 'global_step7'.*pass --tag"):
        read_contents(root)
    assert read_contents(root, tag="global_step3").tag == "global_step3"


def test_trainer_output_dir_gets_a_hint(zero_ckpt):
    root, _ = zero_ckpt
    with pytest.raises(ValueError, match=r"Trainer output_dir, pass one of its checkpoints.*checkpoint-3"):
        read_contents(root.parent)


def test_missing_path_and_unknown_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_contents(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no supported checkpoint found .*notes\.txt.*Expected a DeepSpeed"):
        read_contents(tmp_path)


# -- the one layout model: family, world size and per-rank files from file names alone -------------------------
def _touch(root, *names):
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    return root


@pytest.mark.parametrize(
    ("names", "fmt", "family", "world"),
    [
        (["model.safetensors", "rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"], "hf", "full", 3),
        (["model.safetensors", "rng_state.pth"], "hf", "full", 1),
        (["pytorch_model_fsdp.bin"], "fsdp_full", "fsdp", None),
        (["pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
          "optimizer_0/__0_0.distcp", "optimizer_0/__1_0.distcp"], "dcp", "fsdp", 2),
        (["latest", "global_step4/mp_rank_00_model_states.pt"]
         + [f"global_step4/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)], "deepspeed", "zero12", 4),
        (["latest"] + [f"global_step4/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)]
         + [f"global_step4/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)], "deepspeed", "zero3", 2),
    ],
)  # fmt: skip
def test_each_family_and_world_size_from_file_names(tmp_path, names, fmt, family, world):
    root = _touch(tmp_path / "checkpoint-4", *names)
    if "latest" in names:
        (root / "latest").write_text("global_step4")
    layout = read_contents(root)
    assert (layout.format, layout.family.value, layout.world_size, layout.step) == (fmt, family, world, 4)
    assert layout.missing_rank_files(world or 1) == []


def test_missing_rank_files_name_the_kind_and_the_rank(tmp_path):
    root = _touch(
        tmp_path / "checkpoint-2",
        "latest",
        "rng_state_0.pth",
        "rng_state_2.pth",
        "global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "global_step2/zero_pp_rank_1_mp_rank_00_model_states.pt",
        "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    (root / "latest").write_text("global_step2")
    layout = read_contents(root)
    assert (layout.family, layout.stage, layout.world_size) == (CheckpointFamily.ZERO3, 3, 2)
    assert sorted(layout.rank_files["rng state"]) == [0, 2]
    assert layout.missing_rank_files(2) == [
        "rng state of rank 1",
        "DeepSpeed optimizer shard of rank 1",
    ]
    assert "DeepSpeed ZeRO-3 model shard of rank 2" in layout.missing_rank_files(3)


def test_lenient_read_answers_for_a_half_written_folder(tmp_path):
    root = _touch(tmp_path / "checkpoint-1", "rng_state_0.pth", "optimizer.pt")
    with pytest.raises(ValueError, match="no supported checkpoint found"):
        read_contents(root)
    layout = read_contents(root, strict=False)
    assert (layout.format, layout.family, layout.world_size) == (None, CheckpointFamily.FULL, 1)
    (root / "latest").write_text("global_step9")  # names a tag that was never written
    assert read_contents(root, strict=False).format is None


def test_universal_copy_is_found_and_not_taken_for_a_tag(tmp_path):
    root = _touch(
        tmp_path / "checkpoint-3",
        "global_step3/mp_rank_00_model_states.pt",
        "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step3_universal/mp_rank_00_model_states.pt",
    )
    assert read_contents(root).universal_tag is None
    (root / "latest_universal").write_text("global_step3_universal")
    layout = read_contents(root)  # no `latest`: the only tag is global_step3, the universal copy is no tag
    assert (layout.tag, layout.universal_tag, layout.world_size) == ("global_step3", "global_step3_universal", 1)


# ---------------------------------------------------------------- trainer_state.json, read in one place


def test_trainer_state_is_read_in_one_place_and_says_what_is_wrong(tmp_path, monkeypatch):
    """Every reader of a checkpoint's step goes through formats.trainer_state: a missing file, bad JSON, a JSON list,
    a step that is no step, deep nesting, an int past Python's digit limit, a link out of the folder and a file
    larger than any Trainer writes each give one reason (auto_resume's skip line)."""
    import json

    import pytest

    from hf_dist.checkpoint.formats import trainer_state
    from hf_dist.checkpoint.formats.trainer_state import TrainerStateError, read_trainer_state, saved_step

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    state = folder / "trainer_state.json"
    with pytest.raises(TrainerStateError, match="trainer_state.json is missing"):
        read_trainer_state(folder)
    for text, says in (("{", "is unreadable"), ("[4]", r"is unreadable \(a JSON list"),
                       ('{"global_step": "4"}', "says global_step '4', not a step"),
                       ('{"global_step": -1}', "says global_step -1, not a step")):  # fmt: skip
        state.write_text(text)
        with pytest.raises(TrainerStateError, match=says):
            read_trainer_state(folder)
        assert saved_step(folder) is None
    for planted in ("[" * 100_000 + "]" * 100_000, '{"global_step": 1' + "0" * 5000 + "}"):  # nesting, digits
        state.write_text(planted)
        with pytest.raises(TrainerStateError, match="is unreadable"):
            read_trainer_state(folder)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"global_step": 4}))
    state.unlink()
    state.symlink_to(outside)  # a link out of the checkpoint: refused, never read
    with pytest.raises(TrainerStateError, match="outside the folder"):
        read_trainer_state(folder)
    state.unlink()
    state.write_text(json.dumps({"global_step": 4, "max_steps": 8}))
    assert read_trainer_state(folder)["max_steps"] == 8 and saved_step(folder) == 4
    monkeypatch.setattr(trainer_state, "MAX_BYTES", 10)
    with pytest.raises(TrainerStateError, match="over the 10 a Trainer writes"):
        read_trainer_state(folder)


def test_contents_are_frozen_and_opening_the_files_refines_a_copy(zero_ckpt):
    """Readers return what they found (``Reader.found``) instead of writing into the contents they were given."""
    import dataclasses

    from hf_dist.checkpoint.conversion.convert import open_reader
    from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint

    root, _ = zero_ckpt
    checkpoint = open_checkpoint(root)
    info = checkpoint.contents
    assert info == read_contents(root)
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.contents = info
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.world_size = 99
    before = dataclasses.asdict(info)
    refined, reader = open_reader(checkpoint)
    reader.close()
    assert dataclasses.asdict(info) == before  # the contents read stay what was read
    assert (refined.stage, refined.world_size, refined.train_dtype) == (3, reader.world_size, reader.train_dtype)
    assert refined.train_dtype is not None and refined == dataclasses.replace(info, **reader.found)
