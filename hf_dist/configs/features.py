"""What the installed libraries accept, as one explicit value the config factories take.

The factories in ``hf_dist.configs`` are pure: they never import transformers to look at it. Whoever calls
them says which library behaviour to target: ``hf_dist.auto_args`` and ``hf-dist config`` pass
:func:`hf_dist.runtime.support.installed_features` (probed once per process); the default,
:data:`NEWEST_TESTED_FEATURES`, is what the newest tested versions accept (transformers 5.23,
accelerate 1.15).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LibraryFeatures:
    """``fsdp_version``: 2 where torch/accelerate/transformers run FSDP2 through the Trainer, else 1.
    ``fsdp_flag_takes_bool``: ``TrainingArguments(fsdp=True)`` (transformers >= 5.1; 5.0 wants the string
    form ``"full_shard auto_wrap"``). ``activation_checkpointing_field``: the ``TrainingArguments`` flag
    (``gradient_checkpointing`` up to transformers 5.22). ``warmup_ratio_field``: whether
    ``TrainingArguments`` still has ``warmup_ratio`` (a float ``warmup_steps`` < 1 is a ratio without it).
    ``parallelism_config``: accelerate's ``ParallelismConfig`` with ``tp_size``/``cp_size`` and
    ``TrainingArguments(parallelism_config=...)`` (accelerate >= 1.10), needed for TP and CP.
    ``sequence_parallel``: ``ParallelismConfig(sp_backend="deepspeed", sp_size=...)`` with DeepSpeed's Ulysses
    attention (accelerate >= 1.12, deepspeed >= 0.18.2). ``deepspeed_autotp``: DeepSpeed's training AutoTP
    (``"tensor_parallel": {"autotp_size": N}``, deepspeed >= 0.16.4). ``fsdp2_checkpoints_children``: accelerate's
    ``fsdp2_apply_ac`` wraps every *child* of a decoder layer in its own checkpoint (accelerate <= 1.14: it tests the
    wrap policy on the parent), so each child's input is saved, not only the layer's. ``fsdp2_embedding_unit``:
    accelerate's ``fsdp2_prepare_model`` shards an untied input embedding as its own unit, resharded after its
    forward (accelerate >= 1.15), so only the tail (final norm, ``lm_head``) stays gathered until backward.
    """

    fsdp_version: int = 2
    fsdp_flag_takes_bool: bool = True
    activation_checkpointing_field: str = "activation_checkpointing"
    warmup_ratio_field: bool = False
    parallelism_config: bool = True
    sequence_parallel: bool = True
    deepspeed_autotp: bool = True
    fsdp2_checkpoints_children: bool = False
    fsdp2_embedding_unit: bool = True

    def __post_init__(self) -> None:
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"FSDP version must be 1 or 2, got {self.fsdp_version!r}.")

    @property
    def activation_checkpointing_kwargs_field(self) -> str:
        return f"{self.activation_checkpointing_field}_kwargs"


NEWEST_TESTED_FEATURES = LibraryFeatures()


def check_features(layout, features: LibraryFeatures) -> None:
    """Refuse a layout whose model-parallel dimensions the libraries described by ``features`` cannot run."""
    s = layout.strategy
    if (layout.tp_size > 1 and not s.is_deepspeed) or layout.cp_size > 1:
        if not features.parallelism_config:
            dim = f"tp_size {layout.tp_size}" if layout.tp_size > 1 else f"cp_size {layout.cp_size}"
            raise ValueError(
                f"{dim} needs accelerate's ParallelismConfig with tp_size/cp_size and "
                "TrainingArguments(parallelism_config=...) (accelerate >= 1.10, transformers >= 4.57); the installed "
                "versions lack it: upgrade accelerate and transformers, or drop the size"
            )
        if features.fsdp_version != 2 and s.is_fsdp:
            raise ValueError(f"{s.name} with tp/cp needs FSDP2 (accelerate >= 1.10); the installed versions run FSDP1")
    if layout.sp_size > 1 and not features.sequence_parallel:
        raise ValueError(
            f"sp_size {layout.sp_size} needs ParallelismConfig(sp_backend='deepspeed') with DeepSpeed Ulysses "
            "(accelerate >= 1.12, deepspeed >= 0.18.2); the installed versions lack it: upgrade accelerate and "
            "deepspeed, or drop sp_size"
        )
    if layout.tp_size > 1 and s.is_deepspeed and not features.deepspeed_autotp:
        raise ValueError(
            f"tp_size {layout.tp_size} with {s.name} needs DeepSpeed AutoTP training "
            "('tensor_parallel': {'autotp_size': N}, deepspeed >= 0.16.4); the installed DeepSpeed lacks it: "
            "upgrade deepspeed, or use fsdp_full_shard for FSDP2 x TP"
        )
