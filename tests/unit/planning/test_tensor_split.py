"""What transformers' tensor-parallel plan splits (issue 39): the memory model counts whole on every TP rank what the
installed transformers' plan leaves whole (Qwen2-MoE's shared expert, routers, norms), checked against transformers'
own rule parameter by parameter and against a real TP distribution of the meta model."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from hf_dist.planning.layout import Layout
from hf_dist.planning.model_source import config_from_dict, meta_model
from hf_dist.planning.modelinfo import model_spec
from hf_dist.planning.tensor_split import parameter_style
from hf_dist.testing import tiny_llama_config
from tests.unit.planning.test_moe import TINY


def _transformers_rule():
    """transformers' own rule: 5.24 ``distributed/parallel_utils.py _get_parameter_plan``, 5.0
    ``integrations/tensor_parallel.py _get_parameter_tp_plan``."""
    for module, name in (("transformers.distributed.parallel_utils", "_get_parameter_plan"),
                         ("transformers.integrations.tensor_parallel", "_get_parameter_tp_plan")):  # fmt: skip
        rule = getattr(importlib.import_module(module), name, None) if importlib.util.find_spec(module) else None
        if rule is not None:
            return rule
    raise AssertionError("transformers has no TP-plan rule where the test looks for it")


CONFIGS = {"llama": tiny_llama_config(), **{kind: config_from_dict(TINY[kind]) for kind in TINY}}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_each_parameter_gets_the_style_transformers_gives_it(kind):
    model = meta_model(CONFIGS[kind])
    rule, plan = _transformers_rule(), model.tp_plan
    names = [name for name, _ in model.named_parameters()]
    assert any(parameter_style(name, plan) for name in names)
    for name in names:
        assert parameter_style(name, plan) == rule(name, plan), name


def _whole_on_a_rank(model) -> int:
    """Elements of one decoder layer (the largest) that no splitting rule of the model's plan names, by hand:
    transformers' rule for each parameter, a row-wise linear's bias whole."""
    rule, plan = _transformers_rule(), model.tp_plan
    layers = model.model.layers
    index = max(range(len(layers)), key=lambda i: sum(p.numel() for p in layers[i].parameters()))
    whole = 0
    for name, param in layers[index].named_parameters():
        style = rule(f"model.layers.{index}.{name}", plan)
        splits = style in ("colwise", "rowwise", "packed_colwise", "local_colwise", "local_rowwise", "packed_rowwise")
        whole += 0 if splits and not (name.endswith("bias") and "rowwise" in style) else param.numel()
    return whole


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_the_memory_model_keeps_whole_what_the_plan_does_not_split(kind):
    spec = model_spec(CONFIGS[kind])
    model = meta_model(CONFIGS[kind])
    assert spec.tp_split.whole_params == _whole_on_a_rank(model)
    local = spec.tensor_parallel_shard(2)
    whole = spec.tp_split.whole_params
    assert local.layer_params == -(-(spec.layer_params - whole) // 2) + whole


def test_qwen2_moes_shared_expert_stays_whole_when_the_plan_misses_it():
    """transformers 5.24 names ``mlp.gate_proj`` in Qwen2-MoE's plan; its shared expert is ``mlp.shared_expert.*``,
    which no rule matches, so each TP rank holds it whole, and its activations are the whole width."""
    spec = model_spec(CONFIGS["qwen2_moe"])
    model = meta_model(CONFIGS["qwen2_moe"])
    shared = sum(p.numel() for n, p in model.model.layers[0].named_parameters() if ".shared_expert." in n)
    assert not any(parameter_style(f"model.layers.0.{n}", model.tp_plan) for n, _ in
                   model.model.layers[0].named_parameters() if ".shared_expert." in n)  # fmt: skip
    assert spec.tp_split.whole_params >= shared > 0
    local = spec.tensor_parallel_shard(2)
    assert local.moe.shared_size == spec.moe.shared_size  # computed whole on each rank
    assert not spec.tp_split.shared


def test_a_real_tp_distribution_holds_what_the_model_counts():
    """transformers' own TP distribution of the meta model (the run's ``from_pretrained(tp_plan="auto")`` mesh, as
    the tracer applies it) holds on a rank exactly the parameters the memory model counts, for each MoE family."""
    from hf_dist.tracing import TraceUnsupported, trace_memory
    from hf_dist.tracing.setup import _transformers_distributes_meta_models

    for kind in ("qwen2_moe", "deepseek_v2", "llama"):
        config = CONFIGS[kind]
        setup = dict(strategy="ddp", world_size=2, tp_size=2, seq_len=16, micro_batch_size=1, pure_bf16=True)
        if not _transformers_distributes_meta_models():  # older transformers: refused, naming what is missing
            with pytest.raises(TraceUnsupported, match="maybe_distribute_model, transformers >= 5.23"):
                trace_memory(config, isolate=False, **setup)
            return
        result = trace_memory(config, isolate=False, **setup)
        local = Layout("ddp", 2, tp_size=2).rank_spec(model_spec(config))
        assert result.states["params"] == 2 * local.num_params, kind  # bf16 weights (the grouped experts need them)
