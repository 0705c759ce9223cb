"""Side files (tokenizer, generation config, chat template, model and adapter config) are copied into an output only
from inside the folder they are read from (issue 38): a linked side file whose target is elsewhere (``tokenizer.model
-> ~/.ssh/id_rsa``) is refused, naming the link; nothing is written and the target's bytes are never copied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_dist.checkpoint.formats.hf import side_file
from hf_dist.checkpoint.safety.paths import PathEscapeError
from hf_dist.cli.main import main

SECRET = '{"private_key": "PLANTED-SECRET"}'  # valid JSON: the link, not the content, must be what is refused
SIDE_FILES = ("tokenizer.model", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
              "config.json")  # fmt: skip


def _fsdp_file_source(tmp_path: Path, tiny_state) -> Path:
    """A single-file source (``pytorch_model_fsdp.bin``) with the model config beside it."""
    config, state = tiny_state
    folder = tmp_path / "handed"
    folder.mkdir()
    config.save_pretrained(folder)
    torch.save(dict(state), folder / "pytorch_model_fsdp.bin")
    return folder


def _no_secret_written(tmp_path: Path) -> None:
    for path in tmp_path.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.parent != tmp_path:
            assert b"PLANTED-SECRET" not in path.read_bytes(), path


@pytest.mark.parametrize("name", SIDE_FILES)
@pytest.mark.parametrize("source", ["zero checkpoint", "folder around it", "single file"])
def test_a_side_file_linked_out_of_its_folder_is_refused(name, source, tmp_path, tiny_state, zero_ckpt, capsys):
    secret = tmp_path / "id_rsa"
    secret.write_text(SECRET)
    if source == "zero checkpoint":
        folder, _ = zero_ckpt
        src = folder
    elif source == "folder around it":  # the config and tokenizer found beside the checkpoint, in the run's folder
        src, _ = zero_ckpt
        folder = tmp_path / "run"
        folder.mkdir()
        src = src.rename(folder / src.name)
        (src / "config.json").rename(folder / "config.json")
    else:
        folder = _fsdp_file_source(tmp_path, tiny_state)
        src = folder / "pytorch_model_fsdp.bin"
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(secret)
    assert main(["convert", str(src), str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"refusing to read {folder / name}: it resolves to {secret}, outside the " in err
    assert not (tmp_path / "out").exists()
    _no_secret_written(tmp_path)


def test_tokenizer_flag_folder_is_confined_too(tmp_path, zero_ckpt, capsys):
    root, _ = zero_ckpt
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tmp_path / "id_rsa").write_text(SECRET)
    (tokenizer / "tokenizer.json").symlink_to(tmp_path / "id_rsa")
    argv = ["convert", str(root), str(tmp_path / "out"), "--tokenizer", str(tokenizer), "--no-progress"]
    assert main(argv) == 1
    assert f"refusing to read {tokenizer / 'tokenizer.json'}: it resolves to" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_link_inside_its_folder_is_copied(tmp_path, zero_ckpt):
    root, _ = zero_ckpt
    (root / "tokenizers").mkdir()
    (root / "tokenizers" / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "tokenizer.json").symlink_to(root / "tokenizers" / "tokenizer.json")
    assert main(["convert", str(root), str(tmp_path / "out"), "--no-progress"]) == 0
    copied = tmp_path / "out" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == '{"version": "1.0"}'


def test_an_adapter_config_linked_out_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere.json").write_text(SECRET)
    (tmp_path / "run" / "adapter_config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(PathEscapeError, match=r"run/adapter_config.json: it resolves to .*elsewhere.json, outside"):
        side_file(tmp_path / "run", "adapter_config.json")
