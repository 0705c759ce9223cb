"""Every config field the planner reads is validated, one line each, before anything is built: ``hf-dist plan``,
``auto_args`` and the trace on a config.json with a field of the wrong type or range (transformers' own validators
raise tracebacks, or the plan went on with exit 0), and a layer count over the cap (issue 38, leftovers)."""

from __future__ import annotations

import json
import math
import time

import pytest

from hf_dist.cli.main import main
from hf_dist.testing import tiny_llama_config

BAD = [
    ({"head_dim": 7.5}, "head_dim must be a positive integer, got 7.5"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    ({"max_position_embeddings": math.nan}, "max_position_embeddings must be a positive integer, got nan"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, got 'no'"),
    ({"torch_dtype": "float7"}, "torch_dtype must name a torch floating dtype .*got 'float7'"),
    ({"dtype": "float7"}, "dtype must name a torch floating dtype .*got 'float7'"),
    ({"rope_theta": math.nan}, "rope_theta must be a finite positive number, got nan"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta must be a finite positive"),
    ({"num_hidden_layers": 200_000}, "num_hidden_layers 200000 is over hf_dist's cap of 10,000 layers"),
]
IDS = [f"{next(iter(c))}={next(iter(c.values()))}" for c, _ in BAD]


def _folder(tmp_path, change):
    data = tiny_llama_config().to_dict()
    data.update(change)
    (tmp_path / "config.json").write_text(json.dumps(data))  # NaN written as JSON's NaN, read back by json.load
    return tmp_path


@pytest.mark.parametrize("change, said", BAD, ids=IDS)
def test_hf_dist_plan_refuses_in_one_line(change, said, tmp_path, capsys):
    folder = _folder(tmp_path, change)
    for model in (folder, folder / "config.json"):
        started = time.monotonic()
        assert main(["plan", str(model), "--gpus", "2", "--gpu-memory", "80"]) == 1
        assert time.monotonic() - started < 30  # 200,000 layers ran past 90 s
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"{model if model.name == 'config.json' else model / 'config.json'}: " in err, err
        assert __import__("re").search(said, err) and err.endswith("fix config.json"), err


@pytest.mark.parametrize("change, said", BAD, ids=IDS)
def test_auto_args_and_the_trace_refuse_before_building(change, said, tmp_path):
    from hf_dist import auto_args
    from hf_dist.tracing.api import _config_of

    folder = _folder(tmp_path, change)
    with pytest.raises(ValueError, match=said):
        auto_args(str(folder), gpus=2, gpu_memory_gib=80)
    with pytest.raises(ValueError, match=said):
        _config_of(str(folder), False)
    with pytest.raises(ValueError, match=said):  # a config dict
        auto_args({**tiny_llama_config().to_dict(), **change}, gpus=2, gpu_memory_gib=80)


@pytest.mark.parametrize("key, value, said", [
    ("head_dim", 0, "head_dim must be a positive integer, got 0"),
    ("max_position_embeddings", 0, "max_position_embeddings must be a positive integer"),
    ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false"),
    ("num_hidden_layers", 200_000, "over hf_dist's cap"),
])  # fmt: skip
def test_a_config_object_changed_after_construction_is_checked_too(key, value, said):
    from hf_dist import auto_args

    config = tiny_llama_config()
    object.__setattr__(config, key, value)
    with pytest.raises(ValueError, match=said):
        auto_args(config, gpus=2, gpu_memory_gib=80)


def test_a_valid_config_still_plans(tmp_path):
    folder = _folder(tmp_path, {"torch_dtype": "bfloat16", "rope_theta": 10000.0, "head_dim": 16})
    assert main(["plan", str(folder), "--gpus", "2", "--gpu-memory", "80"]) == 0
