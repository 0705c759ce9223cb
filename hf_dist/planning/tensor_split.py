"""What transformers' tensor-parallel plan splits in a decoder layer, read from the model's own plan.

``from_pretrained(tp_plan="auto")`` shards a parameter only when a rule of the model's plan (``model.tp_plan``: the
config's ``base_model_tp_plan`` under the base model's prefix, with the head's) names it, and the rule's style splits
a tensor. The rest stays whole on every rank: norms, routers, and any linear the rules miss. Those rules differ by
family and version. transformers 5.24's Qwen2-MoE rules name ``mlp.gate_proj``, which its shared expert, named
``mlp.shared_expert.gate_proj``, does not match, so that expert (a third of the layer) is whole on every rank.
transformers 5.0 names no expert of Qwen2-MoE at all. So the memory model asks the plan the installed transformers
applies, parameter by parameter, instead of assuming every linear splits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

# styles that shard the parameter they name (transformers 5.24 ``distributed/tensor_parallel.py``, 5.0
# ``integrations/tensor_parallel.py``); the rest (``gather``, ``replicate``, ``replicated_with_grad_allreduce``,
# ``mla_kv_a_proj``, ``moe_tp_experts``, ``sequence_parallel``, ...) keep it whole or act on the module's input/output
_SPLITTING = frozenset({
    "colwise", "colwise_rep", "colwise_gather_output", "local_colwise", "packed_colwise",
    "rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise", "packed_rowwise", "local_packed_rowwise",
    "embedding_rowwise", "embedding_colwise",
})  # fmt: skip
# row-wise styles split a linear's weight along its input; its bias is added after the reduction, whole on each rank
_ROWWISE = frozenset(s for s in _SPLITTING if "rowwise" in s and not s.startswith("embedding"))


class TensorSplit(NamedTuple):
    """What a tensor-parallel plan splits in the decoder layers.

    ``whole_params``: parameters of the largest layer that every rank holds whole. ``whole_in_layers`` and
    ``layers_params``: those of every layer, and all their parameters (a model's layers differ: DeepSeek's first is
    dense). Split or not: ``heads``, the attention projections by head; ``mlp``, the feed-forward width (a dense
    model's MLP, an MoE's routed experts); ``shared``, an MoE's shared expert(s); ``dense``, the MLP of an MoE's
    dense layers."""

    whole_params: int
    whole_in_layers: int
    layers_params: int
    heads: bool = True
    mlp: bool = True
    shared: bool = True
    dense: bool = True

    @staticmethod
    def split(size: int, tp_size: int, applies: bool) -> int:
        """``size`` per rank: ceil(size / tp) where the plan splits it, else whole."""
        return math.ceil(size / tp_size) if applies else size


def parameter_style(name: str, plan: dict[str, str]) -> str | None:
    """The style ``plan`` gives parameter ``name``: transformers' own rule (5.24 ``distributed/parallel_utils.py
    _get_parameter_plan``, 5.0 ``integrations/tensor_parallel.py _get_parameter_tp_plan``, the same rule under two
    names): layer numbers become ``*``, then the parameter's name, else its module's name, is looked up."""
    generic = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    if generic in plan:
        return plan[generic]
    module = generic.rsplit(".", 1)[0] if "." in generic else None
    return plan.get(module) if module is not None else None


def _is_split(name: str, plan: dict[str, str]) -> bool:
    style = parameter_style(name, plan)
    if name.endswith(".bias") and style in _ROWWISE:
        return False
    return style in _SPLITTING


def tensor_split(layers: Any, prefix: str, plan: dict[str, str] | None, index: int) -> TensorSplit | None:
    """What ``plan`` splits in ``layers`` (the model's decoder ``ModuleList`` named ``prefix``; ``index``: its largest
    layer), or None when the model has no plan. A PEFT-wrapped linear counts as the layer it wraps."""
    if not plan or layers is None:
        return None
    params = []
    for layer in layers:
        named = [(n, p.numel()) for n, p in layer.named_parameters()
                 if not any(marker in n for marker in ("lora_", "modules_to_save"))]  # fmt: skip
        params.append([(n.replace(".base_layer.", ".").replace(".original_module.", "."), size) for n, size in named])
    return split_by_plan(params, prefix, plan, index)


def split_by_plan(
    layers: Sequence[Sequence[tuple[str, int]]], prefix: str, plan: dict[str, str] | None, index: int
) -> TensorSplit | None:
    """:func:`tensor_split` of layers given as their parameters' (relative name, size), built or counted."""
    if not plan or not layers:
        return None
    split: dict[str, bool] = {}  # relative parameter name -> split, over every layer (dense and MoE layers differ)
    whole, whole_in_layers, layers_params = 0, 0, 0
    for i, layer in enumerate(layers):
        for name, size in layer:
            split[name] = cut = _is_split(f"{prefix}.{i}.{name}", plan)
            layers_params += size
            whole_in_layers += 0 if cut else size
            whole += 0 if cut or i != index else size
    dense = _any(split, lambda parts: parts[:2] == ["mlp", "down_proj"], default=True)
    return TensorSplit(
        whole_params=whole,
        whole_in_layers=whole_in_layers,
        layers_params=layers_params,
        heads=_any(split, lambda parts: parts[0] == "self_attn" and "o_proj" in parts, default=True),
        mlp=_any(split, lambda parts: "experts" in parts, default=dense),
        shared=_any(split, lambda parts: "shared_expert" in parts or "shared_experts" in parts, default=True),
        dense=dense,
    )


def _any(split: dict[str, bool], chosen, default: bool) -> bool:
    """Whether the plan splits the parameters ``chosen`` picks by their name's parts (``default`` if it picks none)."""
    picked = [cut for name, cut in split.items() if chosen(name.split("."))]
    return any(picked) if picked else default
