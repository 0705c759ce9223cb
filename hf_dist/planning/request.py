"""What a plan is asked for: one :class:`PlanRequest`, each field with the help text every front end shows.

``hf_dist.plan(model, **keywords)`` and ``auto_args(model, **keywords)`` build one from their planner keywords;
``hf-dist plan``'s flags are generated from its fields (:func:`add_request_flags`, :func:`request_from_args`); the
recipes' layout flags (``--strategy``, ``--tp_size``, ...) take their help from it (:func:`request_help`) and
build one for ``auto_args`` (``auto_args(model, request, ...)``).

A field's ``metadata``: ``help``; ``section``, the group its flag is listed under in ``hf-dist plan --help``; and,
for fields with a flag, ``flag`` (when not ``--`` plus the name with dashes), ``choices``, ``switch`` (an
``auto``/``on``/``off`` flag for a ``bool | None`` pin: None is searched), ``nargs``/``metavar``. A field without
``section`` is no flag (an object: ``hardware``, ``peft_config``, ``features``). Values are checked by the planner,
which names what it received and what it accepts; this module only sorts and describes them.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from hf_dist.planning.layout import OFFLOADS, STRATEGIES

__all__ = ["PlanRequest", "add_request_flags", "request_from_args", "request_help", "SECTIONS"]

# hf-dist plan --help: the groups of flags, in order
SECTIONS = {
    "hardware": "the machines (detected where not given)",
    "pins": "layout pins (default: searched)",
    "workload": "what is trained",
    "estimate": "what the estimate counts",
    "verify": "tracing the choice",
}
SWITCH_VALUES = {"auto": None, "on": True, "off": False}
_LORA = "the recipes' LoRA: rank 16, dropout 0.05, q/k/v/o/gate/up/down_proj"


def _ask(default: Any, section: str | None, help: str, **cli: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "section": section, **cli})


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """Everything a plan can be asked for; every field may be left at its default (searched or detected)."""

    # the machines
    gpus: int | None = _ask(None, "hardware", "total GPUs across all nodes (default: detected)")
    gpu_memory_gib: float | None = _ask(None, "hardware", "GiB per GPU (default: detected)", flag="--gpu-memory")
    nodes: int | None = _ask(None, "hardware", "number of nodes (default: from the launcher env, else 1)")
    host_memory_gib: float | None = _ask(None, "hardware", "GiB of RAM per node for CPU offload", flag="--host-memory")
    nvme_gbps: float | None = _ask(
        None,
        "hardware",
        "aggregate GB/s of each node's local NVMe drives (~3 per PCIe 4.0 drive); given, NVMe offload "
        "(ZeRO-Infinity) is considered when nothing else fits",
    )
    hardware: Any = _ask(None, None, "a Hardware (hf_dist.planning.hardware) instead of the five fields above")
    # layout pins
    strategy: str | None = _ask(
        None, "pins", "pin the strategy (auto_args(strategy=...), the recipes' --strategy); default: searched",
        choices=STRATEGIES,
    )  # fmt: skip
    offload: str | None = _ask(
        None,
        "pins",
        "pin what is offloaded to host RAM; default: searched, offload only when nothing fits without it",
        choices=OFFLOADS,
    )
    offload_device: str | None = _ask(
        None,
        "pins",
        "pin where offloaded states go: nvme = ZeRO-Infinity (ZeRO-3; the plan states the swap files each node's "
        "drive must hold), cpu = never NVMe; default: searched",
        choices=("cpu", "nvme"),
    )
    activation_checkpointing: bool | None = _ask(
        None, "pins", "pin activation checkpointing; auto = chosen by the estimated tokens/s", switch=True
    )
    sync_each_batch: bool | None = _ask(
        None,
        "pins",
        "FSDP2 with gradient accumulation: reduce-scatter each micro-batch instead of holding every unsharded "
        "gradient until the last one; auto = chosen by memory and tokens/s",
        switch=True,
    )
    tp_size: int | None = _ask(
        None, "pins", "pin the tensor parallel size (1 = off; inside a node); default: searched when data "
        "parallelism is not enough. Pinning one size sets the others to 1 unless given",
    )  # fmt: skip
    cp_size: int | None = _ask(
        None, "pins", "pin the context parallel size (1 = off; FSDP2, GPUs); default: searched when data "
        "parallelism is not enough",
    )  # fmt: skip
    sp_size: int | None = _ask(
        None, "pins", "pin the Ulysses sequence parallel size (1 = off; DeepSpeed); default: searched when data "
        "parallelism is not enough",
    )  # fmt: skip
    # what is trained
    method: str | None = _ask(
        None, "workload", "what trains (default: lora when a LoRA field is given, else full)",
        choices=("full", "lora", "qlora"),
    )  # fmt: skip
    seq_len: int | None = _ask(
        None,
        "workload",
        "tokens per sequence (default 2048, or the model's max_position_embeddings when fewer; more than those is "
        "refused unless the config scales RoPE)",
    )
    global_batch_size: int | None = _ask(None, "workload", "sequences per optimizer step", flag="--global-batch")
    micro_batch_size: int | None = _ask(None, "workload", "sequences per rank per forward", flag="--micro-batch")
    optimizer: str = _ask("adamw", "workload", "the optimizer whose state is planned", choices=("adamw", "adamw_8bit",
                          "sgd"))  # fmt: skip
    lora_rank: int | None = _ask(None, "workload", f"LoRA rank r (default: {_LORA})")
    lora_dropout: float | None = _ask(
        None,
        "workload",
        "LoRA dropout on each adapter's input; PEFT's LoraConfig defaults to 0.0, the recipes to 0.05",
    )
    lora_targets: Any = _ask(
        None, "workload", "modules to adapt, as PEFT's target_modules: names (q_proj v_proj) or all-linear",
        nargs="+", metavar="NAME",
    )  # fmt: skip
    peft_config: Any = _ask(None, None, "a PEFT LoraConfig: its LoRA is planned before the model exists")
    use_liger_kernel: bool | None = _ask(
        None, "workload", "Liger kernels: auto = considered on CUDA when liger-kernel is installed", switch=True,
        flag="--liger",
    )  # fmt: skip
    # what the estimate counts
    fused_lm_head: bool = _ask(
        False, "estimate", "the loss runs through TRL's fused LM head (SFTTrainer): no logits held; default: the "
        "Trainer's loss",
    )  # fmt: skip
    async_save: bool = _ask(
        False, "estimate", "checkpoints staged in host RAM and written in the background (attach(trainer, "
        "async_save=True)): the staging copy counts against each node's host RAM",
    )  # fmt: skip
    train_tokens: float | None = _ask(
        None, "estimate", "tokens the run trains on (e.g. 2e9): the plan then states the estimated wall time and "
        "GPU-hours of its choice and of the alternatives", metavar="N",
    )  # fmt: skip
    safety_margin: float = _ask(0.1, "estimate", "share of each GPU's memory left unplanned (default 0.1)")
    pure_bf16: bool = _ask(
        False, "estimate", "plan bf16 weights and bf16 Adam state without fp32 master weights (less memory, less "
        "accurate updates); default: bf16 mixed precision with fp32 master weights and Adam state",
    )  # fmt: skip
    features: Any = _ask(None, None, "what the libraries accept (default: the installed ones)")
    trust_remote_code: bool = _ask(
        False, None, "import the modelling code the model config's auto_map names; without it that code never runs"
    )
    # tracing the choice (hf_dist.plan, a floor above the search)
    verify: bool = _ask(
        False, "verify", "trace the chosen layout on the real model with fake tensors (seconds to a minute, no GPU) "
        "and take the next candidate if the traced memory does not fit",
    )  # fmt: skip
    verify_time_limit_s: float | None = _ask(
        None, "verify", "seconds per trace before it stops and the analytic estimate stands (default: 120 on a quiet "
        "2-core machine, stretched up to 5x when this one dispatches slower now)", flag="--verify-time-limit",
    )  # fmt: skip

    @classmethod
    def of(cls, request: PlanRequest | None, keywords: dict[str, Any]) -> PlanRequest:
        """``request`` with ``keywords`` set over it (or a request of ``keywords`` alone); an unknown keyword is
        refused with the names a request has."""
        unknown = sorted(set(keywords) - _NAMES)
        if unknown:
            raise TypeError(f"unknown planner keyword(s) {unknown}; a PlanRequest has {sorted(_NAMES)}")
        return dataclasses.replace(request or cls(), **keywords)

    def given(self) -> dict[str, Any]:
        """The fields set to something other than their default, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def hardware_keywords(self) -> dict[str, Any]:
        """The machine fields, as :func:`hf_dist.planning.hardware.detect_hardware` keywords."""
        return {
            name: getattr(self, name) for name in ("gpus", "gpu_memory_gib", "nodes", "host_memory_gib", "nvme_gbps")
        }


_NAMES = frozenset(f.name for f in dataclasses.fields(PlanRequest))


def request_help(name: str) -> str:
    """The help text of field ``name``, its choices named (the recipes' flag of the same name shows it)."""
    meta = next(f.metadata for f in dataclasses.fields(PlanRequest) if f.name == name)
    return meta["help"] + (f" (one of: {', '.join(meta['choices'])})" if "choices" in meta else "")


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field with a section (``hf-dist plan``), listed by section; each flag's dest is its field."""
    groups = {key: parser.add_argument_group(title) for key, title in SECTIONS.items()}
    for f in dataclasses.fields(PlanRequest):
        meta = f.metadata
        if meta["section"] is None:
            continue
        flag = _flag(f)
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if meta.get("switch"):
            kwargs.update(choices=tuple(SWITCH_VALUES), default="auto")
        elif f.default is False:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=_type(f), default=f.default)
            kwargs.update({k: meta[k] for k in ("choices", "nargs", "metavar") if k in meta})
            if "choices" not in meta:  # argparse lists the choices in place of a metavar
                kwargs.setdefault("metavar", flag.removeprefix("--").replace("-", "_").upper())
        groups[meta["section"]].add_argument(flag, **kwargs)


def _type(f: dataclasses.Field) -> Any:
    text = str(f.type)
    return int if text.startswith("int") else float if text.startswith("float") else str


def request_from_args(args: argparse.Namespace, **objects: Any) -> PlanRequest:
    """The :class:`PlanRequest` of ``hf-dist plan``'s parsed flags (``objects``: fields that are no flag, e.g.
    ``hardware=``); ``auto`` switches are left to the search, ``--lora-targets all-linear`` is PEFT's shorthand."""
    values = dict(objects)
    for f in dataclasses.fields(PlanRequest):
        if not hasattr(args, f.name):  # an object (hardware=, ...) or a flag this parser lacks
            continue
        value = getattr(args, f.name)
        values[f.name] = SWITCH_VALUES[value] if f.metadata.get("switch") else value
    values["lora_targets"] = _targets(values.get("lora_targets"))
    return PlanRequest(**values)


def _targets(names: list[str] | str | None) -> Any:
    """``--lora-targets``: names as a list, ``all-linear`` (one value) as PEFT's shorthand string."""
    if not isinstance(names, list):
        return names
    return names[0] if len(names) == 1 and names[0].lower() == "all-linear" else names
