"""verify cannot lie: NaN/Inf never compare equal, the side lacking a tensor is named, configs are asked for."""

from __future__ import annotations

import re

import torch
from safetensors.torch import save_file

from hf_dist.checkpoint.conversion.verify import verify
from hf_dist.cli.main import main
from tests.unit.checkpoint.fakes import tiny_model_state


def _hf(folder, config, state):
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return folder


def test_nan_weights_never_match_and_are_counted(tiny_state, tmp_path, capsys):
    config, state = tiny_state
    bad = {k: v.clone() for k, v in state.items()}
    name = "model.layers.0.mlp.up_proj.weight"
    bad[name][0, :3] = float("nan")
    bad[name][1, 0] = float("inf")
    a = _hf(tmp_path / "a", config, bad)
    report = verify(a, a)
    assert not report.ok and report.nonfinite == {name: {"A": (3, 1), "B": (3, 1)}}
    assert main(["verify", str(a), str(a)]) == 1
    out = capsys.readouterr().out
    assert f"{name}: A 3 NaN, 1 Inf; B 3 NaN, 1 Inf" in out and out.startswith("MISMATCH")
    assert verify(_hf(tmp_path / "b", config, state), _hf(tmp_path / "c", config, state)).ok


def test_missing_tensor_names_the_side_that_lacks_it(tiny_state, tmp_path, capsys):
    config, state = tiny_state
    a = _hf(tmp_path / "a", config, state)
    b = _hf(tmp_path / "b", config, {k: v for k, v in state.items() if k != "model.norm.weight"})
    report = verify(a, b)
    assert report.only_in_a == ["model.norm.weight"] and not report.ok
    assert main(["verify", str(a), str(b)]) == 1
    captured = capsys.readouterr()
    assert "only in A, missing from B (1): ['model.norm.weight']" in captured.out
    assert "--model-config" not in captured.out + captured.err


def test_dcp_without_any_config_asks_for_one(tiny_state, tmp_path, capsys):
    from hf_dist.checkpoint.formats.reader import TensorSpec
    from hf_dist.checkpoint.write.dcp import write_dcp

    config, state = tiny_state
    dcp = tmp_path / "dcp"
    specs = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in state.items()}
    write_dcp(dcp, specs, iter(state.items()), prefix="model._orig_mod.module.")
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, plain / "model.safetensors")
    assert main(["verify", str(dcp), str(plain)]) == 0  # wrapper prefixes matched to the other side's names
    assert capsys.readouterr().out.startswith("OK")
    config.save_pretrained(tmp_path / "cfg")
    assert verify(dcp, plain, model_config=tmp_path / "cfg").ok
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({"x.y": torch.ones(2)}, bare / "model.safetensors")
    assert main(["verify", str(plain), str(bare)]) == 1
    assert "share no tensor name" in capsys.readouterr().err


def test_differently_shaped_models_name_the_tensor_even_with_logits(tiny_state, tmp_path, capsys):
    """Two models of different widths: the report lists the tensors that differ, and --logits says why it compared
    no logits instead of torch's bare "size of tensor a must match" error."""
    from hf_dist.testing import tiny_llama_config

    config, state = tiny_state
    a = _hf(tmp_path / "a", config, state)
    wide_config, wide_state = tiny_model_state(hidden_size=64)
    b = _hf(tmp_path / "b", wide_config, wide_state)
    assert main(["verify", str(a), str(b), "--logits"]) == 1
    captured = capsys.readouterr()
    assert "model.embed_tokens.weight: A (67, 32) vs B (67, 64)" in captured.out
    assert "logits not compared: " in captured.out and "different models" in captured.out
    assert captured.err == ""
    # same shapes on both sides, but a --model-config that builds another shape: the tensor is named
    other = tmp_path / "other"
    tiny_llama_config(num_hidden_layers=1, hidden_size=64, intermediate_size=48, vocab_size=67).save_pretrained(other)
    assert main(["verify", str(a), str(a), "--logits", "--model-config", str(other)]) == 1
    err = capsys.readouterr().err
    assert re.search(r"tensor '(lm_head|model\.embed_tokens)\.weight' has shape \(67, 32\), but the config in", err)
    assert "builds it as (67, 64)" in err and "--model-config" in err
