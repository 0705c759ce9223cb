"""Small DeepSpeed-layout checkpoints built in-process (no deepspeed, no ranks) for fast unit tests.

The layout mirrors what deepspeed 0.19 writes (checked against real checkpoints in
tests/distributed/test_convert.py): ZeRO-1/2 split each param group's flat fp32 vector into equal
per-rank partitions (padded to a multiple of 2*world); ZeRO-3 splits every param on its own into
``ceil(numel/world)`` elements per rank.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch


def tiny_model_state(tied: bool = False, seed: int = 0, hidden_size: int = 32):
    from transformers import AutoModelForCausalLM

    from hf_dist.testing import tiny_llama_config

    torch.manual_seed(seed)
    config = tiny_llama_config(tie_word_embeddings=tied, num_hidden_layers=1, hidden_size=hidden_size,
                               intermediate_size=48, vocab_size=67, num_attention_heads=2,
                               num_key_value_heads=1)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    state = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    if tied:
        state.pop("lm_head.weight")
    return config, state


def make_zero_checkpoint(
    root: Path,
    config,
    state: dict[str, torch.Tensor],
    *,
    stage: int,
    world_size: int = 2,
    num_groups: int = 2,
    bf16: bool = True,
    tag: str = "global_step3",
    shared: dict[str, str] | None = None,
    mp_rank: int = 0,
    universal_info: dict | None = None,
    lr_scheduler: dict | None = None,
) -> Path:
    """Write ``root/{latest, config.json, tag/*}`` as deepspeed would; returns the tag folder. ``mp_rank``: the
    AutoTP rank whose files these are (``state`` holds its slices); ``universal_info``: AutoTP's split rules;
    ``lr_scheduler``: the state of DeepSpeed's own LR scheduler (a DeepSpeed config with a ``scheduler`` section)."""
    tag_dir = Path(root) / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    (Path(root) / "latest").write_text(tag)
    config.save_pretrained(root)
    names = list(state)
    per_group = math.ceil(len(names) / num_groups)
    groups = [names[i : i + per_group] for i in range(0, len(names), per_group)]
    param_shapes = [OrderedDict((n, state[n].shape) for n in group) for group in groups]
    half = torch.bfloat16 if bf16 else torch.float16
    model_states = {
        "module": OrderedDict((n, t.to(half) if stage < 3 else torch.empty(0, dtype=half)) for n, t in state.items()),
        "buffer_names": [],
        "param_shapes": param_shapes,
        "frozen_param_shapes": None,
        "shared_params": shared or {},
        "frozen_param_fragments": None,
        "dp_world_size": world_size,
        "ds_config": {"bf16": {"enabled": bf16}, "zero_optimization": {"stage": stage}},
        "ds_version": "0.19.8",
        "lr_scheduler": lr_scheduler,
    }
    if universal_info is not None:
        model_states["universal_checkpoint_info"] = universal_info
    prefix = "bf16_" if bf16 else ""
    flats = _zero3_flats(state, groups, world_size) if stage == 3 else _zero12_flats(state, groups, world_size)
    for rank in range(world_size):
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        optim = {"zero_stage": stage, "partition_count": world_size if stage == 3 else [world_size] * len(groups),
                 key: flats[rank], "loss_scale": 1.0}  # fmt: skip
        torch.save(
            {"optimizer_state_dict": optim},
            tag_dir / f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt",
        )
        if stage == 3:
            torch.save(model_states, tag_dir / f"zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_model_states.pt")
    if stage < 3:
        torch.save(model_states, tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt")
    return tag_dir


ROW_PARALLEL = ("o_proj", "down_proj")  # DeepSpeed AutoTP's LinearAllreduce: split along dim 1
REPLICATED = ("embed_tokens", "norm")  # whole on every TP rank


def make_autotp_checkpoint(root: Path, config, state: dict[str, torch.Tensor], *, tp: int = 2, **kw) -> Path:
    """A ZeRO-2 AutoTP checkpoint as deepspeed 0.19 writes it: one ZeRO checkpoint per TP rank holding its slices
    (``torch.chunk``: uneven when a dim does not divide), with the split rules in ``universal_checkpoint_info``."""
    info = {
        "tp_replicated_parameter_patterns": [rf"^{n}$" for n in state if any(r in n for r in REPLICATED)],
        "parameter_with_row_parallelism_patterns": [rf"^{n}$" for n in state if any(r in n for r in ROW_PARALLEL)],
    }
    for m in range(tp):
        shard = OrderedDict()
        for name, t in state.items():
            whole = any(r in name for r in REPLICATED)
            shard[name] = t if whole else t.chunk(tp, dim=1 if any(r in name for r in ROW_PARALLEL) else 0)[m]
        tag_dir = make_zero_checkpoint(root, config, shard, stage=2, mp_rank=m, universal_info=info, **kw)
    return tag_dir


def _zero12_flats(state, groups, world_size):
    per_rank = [[] for _ in range(world_size)]
    for group in groups:
        flat = torch.cat([state[n].float().reshape(-1) for n in group])
        align = 2 * world_size
        flat = torch.cat([flat, torch.zeros(-flat.numel() % align)])
        for rank, part in enumerate(flat.chunk(world_size)):
            per_rank[rank].append(part.clone())
    return per_rank


def _zero3_flats(state, groups, world_size):
    per_rank = [[] for _ in range(world_size)]
    for group in groups:
        slices = [[] for _ in range(world_size)]
        for name in group:
            flat = state[name].float().reshape(-1)
            size = math.ceil(flat.numel() / world_size)
            flat = torch.cat([flat, torch.zeros(size * world_size - flat.numel())])
            for rank in range(world_size):
                slices[rank].append(flat[rank * size : (rank + 1) * size])
        for rank in range(world_size):
            per_rank[rank].append(torch.cat(slices[rank]).clone())
    return per_rank


def seal(folder: Path, world_size: int = 1, step: int | None = None, run: str | None = None) -> dict:
    """The manifest hf_dist's callbacks write once every rank saved (every file hashed here)."""
    from hf_dist.checkpoint.lifecycle.manifest import write_manifest

    return write_manifest(Path(folder), hashed={}, world_size=world_size, step=step, run=run)


def make_trainer_zero_checkpoint(root: Path, tiny_state, step: int) -> Path:
    """``root/checkpoint-<step>`` as a Trainer saves ZeRO-3 on 2 ranks (:func:`make_zero_checkpoint`, the ranks' RNG
    states, the scheduler and ``trainer_state.json``), without hf_dist's manifest."""
    import json

    config, state = tiny_state
    ckpt = root / f"checkpoint-{step}"
    make_zero_checkpoint(ckpt, config, state, stage=3, tag=f"global_step{step}")
    for rank in range(2):
        torch.save({"python": None}, ckpt / f"rng_state_{rank}.pth")
    torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return ckpt
