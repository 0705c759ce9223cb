"""What the planner searches: the strategies, offload rungs, checkpointing and Liger options a call leaves open, and
the ladder that tries them (data parallelism, then model parallelism, then Ulysses SP with ZeRO CPU offload, then
NVMe offload; docs/parallelism.md)."""

from __future__ import annotations

import dataclasses

from hf_dist.planning.candidates import Setup, accumulates, batch_refusal, candidate, combos, refusal
from hf_dist.planning.hardware import Hardware
from hf_dist.planning.layout import OFFLOAD_DEVICES, OFFLOADS, REGISTRY, STRATEGIES
from hf_dist.planning.plan_result import Candidate, Combo
from hf_dist.validation import restrict


def search_space(
    hw: Hardware, method, strategy, offload, offload_device, activation_checkpointing, use_liger_kernel,
    sync_each_batch=None,
):  # fmt: skip
    """(strategies, offload rungs, checkpointing options, Liger options, FSDP2's sync_each_batch options) a call
    leaves open on ``hw``: each pinned argument keeps its one value; refused with ValueError where a pin cannot run
    there."""
    if method == "qlora" and hw.device != "cuda":
        raise ValueError("qlora needs CUDA GPUs (bitsandbytes 4-bit kernels); use method='lora' on CPU")
    if hw.device == "cpu" and offload not in (None, "none"):
        raise ValueError(f"offload {offload!r} moves states to host RAM, but training already runs on CPU; use 'none'")
    strategies = restrict("strategy", strategy, STRATEGIES)
    if offload_device == "nvme":
        strategies = nvme_strategies(strategy, offload, method)
    elif offload_device not in (None, *OFFLOAD_DEVICES):
        raise ValueError(
            f"offload_device must be one of {list(OFFLOAD_DEVICES)} or None (search), got {offload_device!r}"
        )
    # bitsandbytes 4-bit weights stay on the GPU, so QLoRA never offloads
    no_offload = (method == "qlora" or hw.device == "cpu") and offload is None
    offloads = restrict("offload", offload, ("none",) if no_offload else OFFLOADS)
    ckpts = restrict("activation_checkpointing", activation_checkpointing, (False, True))
    ligers = liger_options(use_liger_kernel, hw)
    if strategy is not None and hw.nodes < REGISTRY[strategy].min_nodes:
        raise ValueError(
            f"strategy {strategy!r} needs nodes >= {REGISTRY[strategy].min_nodes} (it replicates across nodes), "
            f"got nodes={hw.nodes}; use fsdp_full_shard"
        )
    syncs = restrict("sync_each_batch", sync_each_batch, (False, True))
    return strategies, offloads, ckpts, ligers, syncs


def liger_options(use_liger_kernel: bool | None, hw: Hardware) -> tuple[bool, ...]:
    """Liger kernels need CUDA (Triton) and the package; they are considered wherever both are there."""
    if use_liger_kernel is None:
        return (False, True) if hw.device == "cuda" and hw.liger_kernel else (False,)
    if not isinstance(use_liger_kernel, bool):
        raise ValueError(f"use_liger_kernel must be True, False or None (decide), got {use_liger_kernel!r}")
    if use_liger_kernel and hw.device != "cuda":
        raise ValueError(
            "use_liger_kernel=True needs CUDA GPUs (Liger's kernels are Triton), but this plan is for CPU ranks; "
            "drop use_liger_kernel, or plan for GPUs with gpu_memory_gib=..."
        )
    if use_liger_kernel and not hw.liger_kernel:
        raise ValueError(
            "use_liger_kernel=True but liger-kernel is not installed here; install it (pip install 'hf_dist[liger]') "
            "or pass detect_hardware(liger_kernel=True) when planning for a machine that has it"
        )
    return (use_liger_kernel,)


def nvme_strategies(strategy: str | None, offload: str | None, method: str) -> tuple[str, ...]:
    """The strategies ``offload_device="nvme"`` leaves: ZeRO-3 only (DeepSpeed swaps to NVMe in stage 3 alone)."""
    if strategy not in (None, "zero3"):
        raise ValueError(
            f"offload_device='nvme' with strategy {strategy!r}: NVMe offload (ZeRO-Infinity) is DeepSpeed ZeRO-3's "
            "(ZeRO-1/2 and FSDP2 offload to CPU memory only); use strategy='zero3', or offload_device='cpu'"
        )
    if offload == "none" or method == "qlora":
        raise ValueError(
            f"offload_device='nvme' needs offload 'optimizer' or 'optimizer+params', got "
            f"{'method qlora (4-bit weights stay on the GPU)' if method == 'qlora' else 'offload none'}"
        )
    return ("zero3",)


def layouts(points: list[Combo]) -> int:
    """Layouts among ``points``: FSDP2 with and without ``sync_each_batch`` is one layout run two ways."""
    return len({c._replace(sync=False) for c in points})


MEMORY = "no data-parallel layout fits without offload"


class Search:
    """The ladder: data parallelism (with CPU offload as a last resort), then model parallelism without offload
    when no data-parallel layout fits without it or the global batch is smaller than the GPUs, then Ulysses SP with
    ZeRO CPU offload, then NVMe offload when nothing fits. A global batch the data-parallel ranks do not divide is
    refused (:func:`~hf_dist.planning.candidates.batch_refusal`) unless memory needs the model split.
    ``split_reason``: why model parallelism was searched, once :meth:`run` searched it."""

    def __init__(
        self, setup: Setup, strategies, offloads, ckpts, ligers, syncs, pinned_strategy: bool, features, device
    ):  # fmt: skip
        self.s, self.strategies, self.offloads, self.ckpts, self.ligers = setup, strategies, offloads, ckpts, ligers
        self.syncs, self.pinned_strategy, self.features, self.device = syncs, pinned_strategy, features, device
        self.dp_combos = self._combos(strategies, offloads, (1, 1, 1))
        self.split_reason = MEMORY

    def _combos(self, strategies, offloads, *sizes) -> list[Combo]:
        """The combinations of ``sizes``; FSDP2 with ``sync_each_batch`` only where gradients accumulate."""
        hw = self.s.hw
        found = combos(strategies, offloads, self.ckpts, self.ligers, hw, self.pinned_strategy, self.features, sizes,
                       self.syncs)  # fmt: skip
        return [c for c in found if not c.sync or accumulates(self.s, c, hw)]

    def _evaluate(self, points: list[Combo]) -> list[Candidate]:
        return [candidate(self.s, combo) for combo in points]

    def run(self, options, pinned: tuple[int, int, int] | None) -> tuple[list[Candidate], list[str]]:
        hw, dims = self.s.hw, [f"{n}: {why}" for n, why in options.unavailable.items()]
        if self.device == "nvme":
            return self._nvme([pinned or (1, 1, 1)]), dims + ["nvme: offload_device='nvme' was asked for"]
        if pinned is not None:
            points = self._combos(self.strategies, self.offloads, pinned)
            if not points:
                raise ValueError(self._no_layout_for(pinned))
            return self._evaluate(points), dims
        if not self.dp_combos:
            raise ValueError(f"no strategy among {list(self.strategies)} can use offload {list(self.offloads)}")
        candidates = self._evaluate(self.dp_combos)
        if any(c.fits and c.offload == "none" for c in candidates):
            return candidates, dims + ["tp/cp/sp not searched: a data-parallel layout fits without offload"]
        if "none" not in self.offloads:
            return candidates, dims + ["tp/cp/sp not searched: offload was asked for (model parallelism is searched "
                                       "without offload)"]  # fmt: skip
        self.split_reason = self._why_split()
        triples = options.triples(hw.world_size)
        mp = self._combos(self.strategies, ("none",), *triples)
        candidates += self._evaluate(mp)
        dims.append(f"searched {options.describe()} ({layouts(mp)} layouts) because {self.split_reason}")
        if any(c.fits for c in candidates):
            return candidates, dims
        if self.offloads == ("none",):
            return candidates, dims + ["offload with sp, nvme: not searched: offload is 'none' here (asked for, "
                                       "QLoRA or CPU ranks)"]  # fmt: skip
        self._undivided(self.offloads)  # a batch the ranks do not divide is no reason to split the model either
        seq = [t for t in triples if t[0] == t[1] == 1]  # Ulysses SP alone
        offloads = [o for o in ("optimizer", "optimizer+params") if o in self.offloads]  # unless offload is pinned
        # ZeRO CPU offload with Ulysses SP: DeepSpeed ALST's recipe for long sequences on few GPUs
        zero = [name for name in self.strategies if REGISTRY[name].is_deepspeed]
        offloaded = self._combos(zero, offloads, *seq)
        candidates += self._evaluate(offloaded)
        dims.append(f"searched sp with ZeRO CPU offload ({len(offloaded)} layouts, DeepSpeed ALST's recipe): nothing "
                    "fits without offload")  # fmt: skip
        if any(c.fits for c in candidates):
            return candidates, dims
        if self.device == "cpu":
            return candidates, dims + ["nvme: not searched: offload_device='cpu' was asked for"]
        if hw.nvme_gbps is None:
            return candidates, dims + ["nvme: not searched: pass nvme_gbps (hf-dist plan --nvme-gbps) for the "
                                       "nodes' local NVMe drives to consider ZeRO-Infinity"]  # fmt: skip
        nvme = self._nvme([(1, 1, 1), *seq])
        return candidates + nvme, dims + [
            f"nvme: searched zero3 offload to NVMe ({len(nvme)} layouts): nothing else fits"
        ]

    def _nvme(self, sizes) -> list[Candidate]:
        """ZeRO-3 with its optimizer (and parameters) offloaded to NVMe, with the ``sizes`` (tp, cp, sp) triples."""
        zero3 = ["zero3"] if "zero3" in self.strategies else []
        offloads = [o for o in ("optimizer", "optimizer+params") if o in self.offloads]
        nvme = [c._replace(nvme=True) for c in self._combos(zero3, offloads, *sizes)]
        return self._evaluate([c for c in nvme if refusal(c, self.s.hw, self.features) is None])

    def _no_layout_for(self, sizes) -> str:
        """Why no strategy runs the pinned sizes: the library's own reason when one strategy was asked for."""
        tp, cp, sp = sizes
        if self.pinned_strategy:
            combo = Combo(self.strategies[0], "none", False, False, tp, cp, sp)
            reason = refusal(combo, self.s.hw, self.features)
            if reason:
                return reason
        hw = self.s.hw
        return (
            f"no layout runs tp_size={tp} cp_size={cp} sp_size={sp} with strategy {'/'.join(self.strategies)} on "
            f"{hw.world_size} GPU(s) in {hw.nodes} node(s): TP needs FSDP2 (or DDP with nothing replicated, or "
            "zero1/zero2 AutoTP) inside a node, CP needs FSDP2, SP needs DeepSpeed ZeRO, and their product must "
            "divide the world size"
        )

    def _why_split(self) -> str:
        """Why model parallelism is searched once no data-parallel layout fits without offload: memory, or a global
        batch smaller than the GPUs. A global batch the data-parallel ranks do not divide, where one they divide
        would fit, is refused with the arithmetic (:meth:`_undivided`)."""
        valid = self._undivided(("none",))
        if valid is None:
            return MEMORY
        g, world = self.s.global_batch, self.s.hw.world_size
        smaller = f"the global batch ({g}) is smaller than the {world} GPUs"
        if valid is False:
            undivided = smaller if g < world else f"{g} is not divisible by {(self.s.micro_batch or 1) * world}"
            return f"{MEMORY}, even at global batch {self._nearest()}, and {undivided}"
        return smaller

    def _undivided(self, offloads) -> int | bool | None:
        """For a global batch the data-parallel ranks do not divide: the nearest one they do when a data-parallel
        layout with ``offloads`` fits there, False when none does; None when the ranks divide it (or no global batch
        was given). Refused with the arithmetic (:func:`batch_refusal`) when it is at least the GPUs and a
        data-parallel layout fits: splitting the model for it would be a choice the user never made."""
        s, world = self.s, self.s.hw.world_size
        if s.global_batch is None or s.global_batch % ((s.micro_batch or 1) * world) == 0:
            return None
        valid = self._nearest()
        setup = dataclasses.replace(s, global_batch=valid)
        if not any(candidate(setup, c).fits for c in self.dp_combos if c.offload in offloads):
            return False
        if s.global_batch >= world:
            raise ValueError(batch_refusal(s.global_batch, s.micro_batch, world))
        return valid

    def _nearest(self) -> int:
        """The largest global batch the data-parallel ranks divide up to the one asked for (else the smallest)."""
        step = (self.s.micro_batch or 1) * self.s.hw.world_size
        return self.s.global_batch // step * step or step
