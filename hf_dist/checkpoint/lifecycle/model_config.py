"""The model a checkpoint belongs to: its ``config.json`` written with every save, and compared before a resume.

- :func:`write_model_config`: rank 0 writes the model's ``config.json`` (and ``generation_config.json`` when the
  model generates) into ``checkpoint-N`` when the save leaves none (FSDP2's DCP folders), atomically, so
  ``hf-dist convert checkpoint-N OUT`` needs no ``--model-config``;
- :func:`check_same_model`: a checkpoint whose ``config.json`` describes another architecture is refused before
  the Trainer loads it, naming both (the Trainer would fail with a size mismatch on every rank, after building
  everything); :func:`check_resumed_model` runs it at the start of ``trainer.train(resume_from_checkpoint=...)``
  of a Trainer given to :func:`hf_dist.callbacks.attach`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_dist.atomic_io import atomic_write_text
from hf_dist.checkpoint.safety.paths import ConfinedFolder

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# the fields that decide an architecture's parameter names and shapes (Llama/Mistral/Qwen names, GPT-2's, OPT's, MoE)
SHAPE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "n_embd", "n_layer", "n_head", "n_inner",
    "n_positions", "d_model", "ffn_dim", "num_local_experts", "num_experts", "moe_intermediate_size",
)  # fmt: skip


class OtherModelError(ValueError):
    """The checkpoint to resume was written by a model of another architecture."""


def base_config(model: Any) -> Any:
    """The ``PretrainedConfig`` of ``model`` (of the base model under PEFT), or None."""
    inner = getattr(model, "get_base_model", None)
    return getattr(inner() if callable(inner) else model, "config", None)


def write_model_config(folder: str | Path, model: Any) -> list[str]:
    """Rank 0: ``config.json`` (and the generation config of a model that generates) into ``folder`` when absent."""
    config, folder, written = base_config(model), ConfinedFolder(Path(folder)), []
    if config is None or not hasattr(config, "to_json_string") or folder.path(CONFIG).exists():
        return written
    atomic_write_text(folder.path(CONFIG), config.to_json_string(use_diff=True))
    written.append(CONFIG)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate() and not folder.path(GENERATION_CONFIG).exists():
        atomic_write_text(folder.path(GENERATION_CONFIG), generation.to_json_string(use_diff=True))
        written.append(GENERATION_CONFIG)
    return written


def differences(saved: dict, live: dict) -> dict[str, tuple[Any, Any]]:
    """``{field: (checkpoint's, model's)}`` for the shape fields both give and that differ."""
    return {f: (saved[f], live[f]) for f in SHAPE_FIELDS if f in saved and f in live and saved[f] != live[f]}


def check_same_model(checkpoint: str | Path, model: Any) -> None:
    """Refuse to resume ``checkpoint`` into ``model`` when its ``config.json`` gives another architecture; a
    checkpoint without one (or a model without a config) is not checked."""
    path, config = ConfinedFolder(Path(checkpoint)).path(CONFIG), base_config(model)
    if config is None or not hasattr(config, "to_dict") or not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # its loader reports a broken file
    diff = differences(saved, config.to_dict()) if isinstance(saved, dict) else {}
    if diff:
        ckpt = ", ".join(f"{k} {a}" for k, (a, _) in diff.items())
        mine = ", ".join(f"{k} {b}" for k, (_, b) in diff.items())
        raise OtherModelError(
            f"cannot resume {checkpoint}: it holds another model ({ckpt}) than the one being trained ({mine}); "
            "resume a checkpoint of this model, or train into a new output_dir"
        )


def check_resumed_model(trainer: Any, resume_from_checkpoint: Any) -> None:
    """At the start of ``trainer.train(resume_from_checkpoint=...)``: the checkpoint it resumes (``True``: the newest
    of ``output_dir``, the Trainer's pick) must be of ``trainer.model`` (:func:`check_same_model`), before anything
    is prepared or loaded."""
    checkpoint = resume_from_checkpoint
    if checkpoint is True and Path(trainer.args.output_dir).is_dir():
        from transformers.trainer_utils import get_last_checkpoint

        checkpoint = get_last_checkpoint(trainer.args.output_dir)
    if checkpoint:
        check_same_model(checkpoint, trainer.model)
