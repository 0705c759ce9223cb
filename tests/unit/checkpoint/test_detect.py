import pytest

from hf_dist.checkpoint.detect import detect_format


def test_checkpoint_dir_inner_dir_and_tag_dir_are_all_accepted(zero_ckpt):
    root, _ = zero_ckpt
    (root / "trainer_state.json").write_text('{"global_step": 3}')
    for path in (root, root / "global_step3"):
        info = detect_format(path)
        assert (info.format, info.stage, info.tag, info.step) == ("deepspeed", 3, "global_step3", 3)
        assert info.path == root / "global_step3" and info.config_dir == root and info.train_dtype == "bf16"


def test_wrong_tag_lists_available_tags(zero_ckpt):
    root, _ = zero_ckpt
    with pytest.raises(ValueError, match=r"tag 'global_step9' not found .*\['global_step3'\]"):
        detect_format(root, tag="global_step9")


def test_latest_naming_a_missing_tag(zero_ckpt):
    root, _ = zero_ckpt
    (root / "latest").write_text("global_step7")
    with pytest.raises(FileNotFoundError, match=r"latest names tag 'global_step7'.*pass --tag"):
        detect_format(root)
    assert detect_format(root, tag="global_step3").tag == "global_step3"


def test_trainer_output_dir_gets_a_hint(zero_ckpt):
    root, _ = zero_ckpt
    with pytest.raises(ValueError, match=r"Trainer output_dir, pass one of its checkpoints.*checkpoint-3"):
        detect_format(root.parent)


def test_missing_path_and_unknown_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        detect_format(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no supported checkpoint found .*notes\.txt.*Expected a DeepSpeed"):
        detect_format(tmp_path)
