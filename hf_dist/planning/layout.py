"""How a training run is laid out: the strategy registry and the typed :class:`Layout`.

Every property of a strategy lives in :data:`REGISTRY` and nowhere else: which engine runs it, what
it shards (ZeRO paper fig. 1), which offloads it allows, the checkpoint family the Trainer writes for
it, whether that checkpoint loads on another world size, its preference among equally fast plans and
its one-line description. Memory, planner, configs, callbacks, resume and bench ask a
:class:`Strategy` (``strategy("zero3").zero_stage``) instead of comparing names.

:class:`Layout` is one run's layout (torchtitan's ``ParallelDims`` is the model): the strategy, the
sizes in accelerate's ``ParallelismConfig`` names (``dp_replicate_size``, ``dp_shard_size``, ``tp_size``,
``cp_size``, ``sp_size``), offload and its device (CPU or NVMe), activation checkpointing and precision. It
validates itself and prints the arithmetic when the numbers do not fit.

User-facing names stay strings (``plan(strategy="zero3")``, ``hf-dist plan --strategy zero3``); they
are turned into a :class:`Strategy` once, by :func:`strategy`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hf_dist.validation import check_choice

OFFLOADS = ("none", "optimizer", "optimizer+params")
OFFLOAD_DEVICES = ("cpu", "nvme")  # nvme: ZeRO-Infinity (DeepSpeed ZeRO-3), through pinned host buffers
MIXED_PRECISIONS = ("bf16", "fp16", "no")


class Engine(enum.Enum):
    """The library that wraps the model."""

    DDP = "ddp"  # torch DistributedDataParallel (or one process)
    FSDP2 = "fsdp2"  # torch fully_shard, through accelerate
    DEEPSPEED = "deepspeed"


class CheckpointFamily(enum.Enum):
    """What the Trainer writes in a ``checkpoint-N`` folder for a strategy (and can read back)."""

    FULL = "full"
    ZERO12 = "zero12"
    ZERO3 = "zero3"
    DCP = "fsdp"

    @property
    def text(self) -> str:
        return _FAMILY_TEXT[self]

    @property
    def is_zero(self) -> bool:
        return self in (CheckpointFamily.ZERO12, CheckpointFamily.ZERO3)


_FAMILY_TEXT = {
    CheckpointFamily.FULL: "full weights + optimizer.pt (DDP)",
    CheckpointFamily.ZERO12: "DeepSpeed ZeRO-1/2 shards",
    CheckpointFamily.ZERO3: "DeepSpeed ZeRO-3 shards",
    CheckpointFamily.DCP: "FSDP distributed checkpoint (DCP)",
}


@dataclass(frozen=True)
class Sharding:
    """Which model states a strategy splits across its shard group."""

    params: bool
    grads: bool
    optimizer: bool


@dataclass(frozen=True)
class Strategy:
    """One data-parallel strategy and every property hf_dist knows of it.

    ``reshards``: its checkpoint loads on another world size as written (DCP reshards on load, full
    checkpoints are replicated); ZeRO checkpoints need ``hf-dist reshard`` first. ``gathers_params``:
    the full parameters stay gathered from forward to the end of backward (FSDP shard-grad-op), so
    although the shards are split at rest, the peak holds them whole. ``preference``: lower is
    simpler; it breaks ties between plans of about the same speed.
    """

    name: str
    engine: Engine
    shards: Sharding
    offloads: tuple[str, ...]
    checkpoint: CheckpointFamily
    reshards: bool
    preference: int
    description: str
    zero_stage: int = 0
    fsdp_mode: str = ""  # TrainingArguments(fsdp=...): full_shard, shard_grad_op, hybrid_shard
    replicates_across_nodes: bool = False  # HSDP: shards inside a node, replicas across nodes
    gathers_params: bool = False

    @property
    def is_ddp(self) -> bool:
        return self.engine is Engine.DDP

    @property
    def is_fsdp(self) -> bool:
        return self.engine is Engine.FSDP2

    @property
    def is_deepspeed(self) -> bool:
        return self.engine is Engine.DEEPSPEED

    @property
    def min_nodes(self) -> int:
        return 2 if self.replicates_across_nodes else 1

    def shard_degree(self, world_size: int, nodes: int) -> int:
        """Ranks over which this strategy's sharded states are split."""
        if self.is_ddp:
            return 1
        return world_size // nodes if self.replicates_across_nodes else world_size

    def __str__(self) -> str:
        return self.name


_NONE, _OPT, _ALL = ("none",), ("none", "optimizer"), ("none", "optimizer+params")
# FSDP2's CPUOffloadPolicy moves parameters, gradients and the optimizer step together, so FSDP has no
# optimizer-only offload; shard-grad-op keeps the full parameters gathered, so offloading them gains nothing.
REGISTRY: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "ddp", Engine.DDP, Sharding(False, False, False), _NONE, CheckpointFamily.FULL, True, 0,
            "DDP - every GPU holds the full model, gradients all-reduced",
        ),
        Strategy(
            "zero1", Engine.DEEPSPEED, Sharding(False, False, True), _OPT, CheckpointFamily.ZERO12, False, 1,
            "DeepSpeed ZeRO-1 - optimizer states sharded", zero_stage=1,
        ),
        Strategy(
            "zero2", Engine.DEEPSPEED, Sharding(False, True, True), _OPT, CheckpointFamily.ZERO12, False, 3,
            "DeepSpeed ZeRO-2 - optimizer states and gradients sharded", zero_stage=2,
        ),
        Strategy(
            "zero3", Engine.DEEPSPEED, Sharding(True, True, True), ("none", "optimizer", "optimizer+params"),
            CheckpointFamily.ZERO3, False, 5,
            "DeepSpeed ZeRO-3 - parameters, gradients and optimizer states sharded", zero_stage=3,
        ),
        Strategy(
            "fsdp_full_shard", Engine.FSDP2, Sharding(True, True, True), _ALL, CheckpointFamily.DCP, True, 4,
            "FSDP2 full shard - parameters, gradients and optimizer states sharded", fsdp_mode="full_shard",
        ),
        Strategy(
            "fsdp_shard_grad_op", Engine.FSDP2, Sharding(True, True, True), _NONE, CheckpointFamily.DCP, True, 2,
            "FSDP2 shard-grad-op - gradients and optimizer sharded, parameters kept after forward",
            fsdp_mode="shard_grad_op", gathers_params=True,
        ),
        Strategy(
            "hsdp", Engine.FSDP2, Sharding(True, True, True), _ALL, CheckpointFamily.DCP, True, 6,
            "HSDP - FSDP2 sharding inside each node, replicas across nodes",
            fsdp_mode="hybrid_shard", replicates_across_nodes=True,
        ),
    )
}  # fmt: skip
STRATEGIES = tuple(REGISTRY)  # the user-facing names


def strategy(name: str | Strategy) -> Strategy:
    """The registry entry for a user-facing name; a ValueError listing the names otherwise."""
    if isinstance(name, Strategy):
        return name
    check_choice("strategy", name, STRATEGIES)
    return REGISTRY[name]


def by_engine(engine: Engine) -> tuple[Strategy, ...]:
    return tuple(s for s in REGISTRY.values() if s.engine is engine)


def zero_stage_strategy(stage: int) -> Strategy:
    """The ZeRO strategy of a DeepSpeed ``zero_optimization.stage`` (1, 2 or 3)."""
    for s in by_engine(Engine.DEEPSPEED):
        if s.zero_stage == stage:
            return s
    raise ValueError(f"DeepSpeed ZeRO stage {stage!r} is not one hf_dist runs; allowed: 1, 2, 3")


def fsdp_mode_strategy(mode: str) -> Strategy:
    """The FSDP strategy of a ``TrainingArguments.fsdp`` sharding mode (``full_shard``, ...)."""
    for s in by_engine(Engine.FSDP2):
        if s.fsdp_mode == mode:
            return s
    allowed = [s.fsdp_mode for s in by_engine(Engine.FSDP2)]
    raise ValueError(f"FSDP sharding mode {mode!r} is not one hf_dist runs; allowed: {', '.join(allowed)}")


@dataclass(frozen=True)
class Layout:
    """How one run is laid out over ``world_size`` ranks on ``nodes`` nodes.

    Sizes use accelerate's ``ParallelismConfig`` names: ``dp_shard_size`` ranks split the sharded
    states, ``dp_replicate_size`` groups of them hold replicas; their product is the data-parallel
    size, ``world_size / (tp_size * cp_size * sp_size)``.
    """

    strategy: Strategy
    world_size: int = 1
    nodes: int = 1
    offload: str = "none"
    activation_checkpointing: bool = False
    mixed_precision: str = "bf16"
    pure_bf16: bool = False
    tp_size: int = 1
    cp_size: int = 1
    sp_size: int = 1
    offload_device: str = "cpu"
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", strategy(self.strategy))
        for name in ("world_size", "nodes", "tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_choice("offload", self.offload, OFFLOADS)
        check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        s = self.strategy
        if self.world_size % self.nodes:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by nodes {self.nodes} "
                f"({self.world_size} / {self.nodes} = {self.world_size / self.nodes:g}); use the same GPUs per node"
            )
        if self.nodes < s.min_nodes:
            raise ValueError(
                f"{s.name} replicates across nodes and needs nodes >= {s.min_nodes}, got nodes={self.nodes}; "
                "use fsdp_full_shard on a single node"
            )
        if self.offload not in s.offloads:
            able = [o.name for o in REGISTRY.values() if self.offload in o.offloads]
            why = {
                "optimizer": " (FSDP2 offloads parameters, gradients and the optimizer step together, so only ZeRO "
                "offloads the optimizer alone)",
                "optimizer+params": " (only strategies that shard the parameters can offload them)",
            }.get(self.offload, "")
            raise ValueError(
                f"strategy {s.name!r} does not support offload {self.offload!r}; allowed: {', '.join(s.offloads)}. "
                f"Strategies that offload {self.offload!r}: {', '.join(able)}{why}"
            )
        if self.pure_bf16 and self.mixed_precision != "bf16":
            raise ValueError(f"pure_bf16 needs mixed_precision='bf16', got {self.mixed_precision!r}")
        model_parallel = self.tp_size * self.cp_size * self.sp_size
        if self.world_size % model_parallel:
            raise ValueError(
                f"tp_size * cp_size * sp_size = {self.tp_size} * {self.cp_size} * {self.sp_size} = {model_parallel} "
                f"does not divide world_size {self.world_size}"
            )
        self._check_model_parallel()
        self._check_offload_device()
        self._check_sync_each_batch()

    def _check_sync_each_batch(self) -> None:
        if not isinstance(self.sync_each_batch, bool):
            raise ValueError(f"sync_each_batch must be True or False, got {self.sync_each_batch!r}")
        if self.sync_each_batch and not self.strategy.is_fsdp:
            raise ValueError(
                f"sync_each_batch with {self.strategy.name}: only FSDP2 keeps unsharded gradients across "
                "micro-batches (the Trainer's no_sync), which sync_each_batch avoids; use an FSDP2 strategy, or drop it"
            )

    def _check_model_parallel(self) -> None:
        """What each model-parallel dimension needs from the engine and the machines."""
        s = self.strategy
        if self.tp_size > 1 and self.gpus_per_node % self.tp_size:
            raise ValueError(
                f"tp_size {self.tp_size} does not divide the {self.gpus_per_node} GPUs per node "
                f"({self.world_size} GPUs / {self.nodes} nodes): tensor parallelism all-reduces inside every layer "
                "and only runs inside a node (NVLink); use tp_size <= GPUs per node and shard across nodes instead"
            )
        if s.replicates_across_nodes and self.dp_size % self.nodes:
            raise ValueError(
                f"{s.name} keeps one replica per node, but the data-parallel size world_size / (tp * cp * sp) = "
                f"{self.world_size} / {self.tp_size * self.cp_size * self.sp_size} = {self.dp_size} is not a multiple "
                f"of the {self.nodes} nodes; use fsdp_full_shard, or sizes that stay inside a node"
            )
        if self.tp_size > 1 and s.is_deepspeed and s.zero_stage > 2:
            raise ValueError(
                f"tp_size {self.tp_size} with {s.name}: DeepSpeed AutoTP runs with ZeRO stage <= 2; use zero1/zero2, "
                "or fsdp_full_shard for FSDP2 x TP"
            )
        if self.cp_size > 1 and not s.is_fsdp:
            raise ValueError(
                f"cp_size {self.cp_size} with {s.name}: context parallelism (accelerate's ParallelismConfig) runs "
                "only with FSDP2; use fsdp_full_shard, or sp_size (DeepSpeed Ulysses) with a ZeRO strategy"
            )
        if self.sp_size > 1 and not s.is_deepspeed:
            raise ValueError(
                f"sp_size {self.sp_size} with {s.name}: sequence parallelism (DeepSpeed Ulysses, accelerate "
                "sp_backend='deepspeed') runs only with DeepSpeed ZeRO; use zero1/zero2/zero3, or cp_size with FSDP2"
            )
        if self.tp_size > 1 and self.sp_size > 1:
            raise ValueError(
                f"tp_size {self.tp_size} and sp_size {self.sp_size}: DeepSpeed AutoTP and Ulysses do not compose "
                "through accelerate and the Trainer (AutoTP replaces the engine's sequence-parallel groups with its own "
                "TP x DP mesh; measured: DeepSpeed's batch-size check fails at start); choose one: sp_size with "
                "zero1/zero2/zero3, or tp_size with zero1/zero2 (AutoTP) or fsdp_full_shard (FSDP2 x TP)"
            )
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError(
                f"cp_size {self.cp_size} and sp_size {self.sp_size}: both split the sequence; choose one "
                "(cp with FSDP2, sp with DeepSpeed)"
            )

    def _check_offload_device(self) -> None:
        check_choice("offload_device", self.offload_device, OFFLOAD_DEVICES)
        if self.offload_device == "nvme" and (self.offload == "none" or self.strategy.zero_stage != 3):
            raise ValueError(
                f"offload_device 'nvme' with {self.strategy.name} offload={self.offload!r}: NVMe offload is "
                "DeepSpeed ZeRO-Infinity, which needs zero3 and offload 'optimizer' or 'optimizer+params'"
            )

    def check_model(self, spec, seq_len: int) -> None:
        """Refuse sizes the model cannot be split by: attention and KV heads by tp, attention heads by sp, the sequence
        by cp (2 * cp_size chunks: torch's load-balanced ring attention) and by sp."""
        if not spec.has_shape:
            return
        heads, kv = spec.num_attention_heads, spec.num_key_value_heads
        # TP shards q/k/v projections column-wise: both head counts split. Ulysses scatters the query heads;
        # DeepSpeed replicates KV heads when there are fewer than sp_size.
        splits = ((("tp_size", self.tp_size, (("attention heads", heads), ("KV heads", kv)))),)
        splits += (("sp_size", self.sp_size, (("attention heads", heads),)),)
        for name, size, counts in splits:
            for what, count in counts:
                if size > 1 and count % size:
                    raise ValueError(
                        f"{name} {size} does not divide the model's {count} {what} ({count} % {size} = "
                        f"{count % size}); choose a {name} that divides {count}"
                    )
        chunks = {"cp_size": 2 * self.cp_size if self.cp_size > 1 else 1, "sp_size": self.sp_size}
        for name, chunk in chunks.items():
            if chunk > 1 and seq_len % chunk:
                raise ValueError(
                    f"{name} {getattr(self, name)} needs a sequence length divisible by {chunk}, got {seq_len} "
                    f"({seq_len} % {chunk} = {seq_len % chunk}); pad or pack to a multiple of {chunk}"
                )

    def rank_spec(self, spec):
        """What one rank of a tensor-parallel group holds and computes (the whole model without TP): torch TP
        (transformers' plan) splits ``embed_tokens`` by vocabulary rows, DeepSpeed AutoTP leaves it whole."""
        return spec.tensor_parallel_shard(self.tp_size, vocab_parallel_embedding=not self.strategy.is_deepspeed)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.cp_size * self.sp_size)

    @property
    def dp_shard_size(self) -> int:
        """Ranks that split the sharded states (1 under DDP)."""
        return self.strategy.shard_degree(self.dp_size, self.nodes)

    @property
    def state_shard_size(self) -> int:
        """Ranks that split the sharded model states: FSDP2 shards over dp_shard x cp (accelerate's ``dp_shard_cp``
        mesh), ZeRO over dp x sp (DeepSpeed's sequence-data-parallel group); tensor parallelism splits them first."""
        return self.dp_shard_size * self.cp_size * self.sp_size

    @property
    def seq_shards(self) -> int:
        """Pieces each sequence is split into (context or sequence parallelism)."""
        return self.cp_size * self.sp_size

    @property
    def dp_replicate_size(self) -> int:
        return self.dp_size // self.dp_shard_size

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nodes

    def describe(self) -> str:
        """``zero3 x 16 ranks (2 nodes), offload optimizer, checkpointing, bf16``."""
        parts = [
            f"{self.strategy.name} x {self.world_size} ranks" + (f" ({self.nodes} nodes)" if self.nodes > 1 else "")
        ]
        sizes = [f"{n}={getattr(self, n + '_size')}" for n in ("tp", "cp", "sp") if getattr(self, n + "_size") > 1]
        if sizes:
            parts.append(" ".join(sizes))
        if self.offload != "none":
            parts.append(f"offload {self.offload}" + (" to NVMe" if self.offload_device == "nvme" else ""))
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        if self.sync_each_batch:
            parts.append("gradients reduce-scattered every micro-batch")
        parts.append("pure bf16" if self.pure_bf16 else self.mixed_precision)
        return ", ".join(parts)


class ReadsLayout:
    """The fields of ``self.layout``, read through the holder as they always were (``holder.strategy`` is the
    strategy's name): :class:`~hf_dist.planning.plan_result.Plan` and :class:`~hf_dist.tracing.setup.TraceSetup`."""

    layout: Layout
    strategy = property(lambda self: self.layout.strategy.name)
    world_size = property(lambda self: self.layout.world_size)
    nodes = property(lambda self: self.layout.nodes)
    offload = property(lambda self: self.layout.offload)
    activation_checkpointing = property(lambda self: self.layout.activation_checkpointing)
    mixed_precision = property(lambda self: self.layout.mixed_precision)  # "bf16" | "fp16" | "no"
    pure_bf16 = property(lambda self: self.layout.pure_bf16)  # bf16 weights and Adam state, no fp32 masters
    tp_size = property(lambda self: self.layout.tp_size)  # tensor parallel group (inside a node)
    cp_size = property(lambda self: self.layout.cp_size)  # context parallel group (FSDP2, torch ring attention)
    sp_size = property(lambda self: self.layout.sp_size)  # Ulysses sequence parallel group (DeepSpeed)
    offload_device = property(lambda self: self.layout.offload_device)  # "cpu", or "nvme" (ZeRO-Infinity)
    sync_each_batch = property(lambda self: self.layout.sync_each_batch)  # FSDP2 reduce-scatters every micro-batch


# the names ReadsLayout gives, as a flat constructor or a JSON takes them
LAYOUT_KEYWORDS = (
    "strategy", "world_size", "nodes", "offload", "activation_checkpointing", "mixed_precision", "pure_bf16",
    "tp_size", "cp_size", "sp_size", "offload_device", "sync_each_batch",
)  # fmt: skip
