"""DeepSpeed ZeRO traced: the two shims (module.to on a fake module; the values DeepSpeed reads in Python), the version
gate, the config the engine gets, and ZeRO-1/2/3 traced on a tiny model with hand-computed model states."""

from __future__ import annotations

import importlib.util
import logging
import math
import re
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from hf_dist.runtime.library_warnings import DEPRECATED_COLLECTIVES
from hf_dist.testing import tiny_llama_config
from hf_dist.tracing import TraceSetup, TraceUnsupported, trace_memory, zero_shims
from hf_dist.tracing.zero_shims import UnknownScalarRead, fake_module_to, healthy_scalar_reads, version_reason
from tests.unit.marks import needs_traced_deepspeed

pytest.importorskip("deepspeed")


@pytest.fixture
def fake_world(monkeypatch):
    """Rank 0 of a fake process group of 2 (what DeepSpeed's rank checks broadcast over)."""
    import deepspeed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hf_dist.tracing.zero import release_groups

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    deepspeed.init_distributed()  # deepspeed.comm takes the fake group as its world
    yield
    release_groups()
    dist.destroy_process_group()


# ---------------------------------------------------------------- 1. module.to(device)


def _fake_module() -> tuple[torch.nn.Module, FakeTensorMode]:
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with fake:
        module.to_empty(device="cpu")
    return module, fake


def test_module_to_on_a_fake_module_is_what_deepspeed_cannot_do():
    module, fake = _fake_module()
    with fake, pytest.raises(RuntimeError, match="Couldn't swap"):
        module.to(torch.device("cpu"))


def test_fake_module_to_keeps_a_module_on_its_device_and_converts_in_place():
    module, fake = _fake_module()
    weight = module[0].weight
    storage = weight.untyped_storage()
    with fake, fake_module_to(module):
        assert module.to(torch.device("cpu")) is module  # DeepSpeed's call: nothing to move, nothing allocated
        assert module[0].weight is weight and weight.untyped_storage() is storage
        module.to(torch.bfloat16)  # a real conversion: the same Parameter, a new bf16 tensor
        assert module[0].weight is weight and weight.dtype == torch.bfloat16 and weight.requires_grad
    assert "to" not in vars(module)  # the module's own .to is back


# ---------------------------------------------------------------- 2. values read in Python


@needs_traced_deepspeed
def test_grad_norm_check_takes_the_healthy_branch_and_still_computes_the_norm():
    from deepspeed.runtime.utils import clip_tensors_by_global_norm, is_invalid_grad_norm

    with FakeTensorMode():
        norm = torch.linalg.vector_norm(torch.ones(8))
        with pytest.raises(DataDependentOutputException):
            is_invalid_grad_norm(norm)  # fake tensors have no values
        grads = [torch.ones(8)]
        with healthy_scalar_reads():
            assert is_invalid_grad_norm(norm) is False
            assert clip_tensors_by_global_norm(grads, max_norm=1.0, global_norm=norm) is norm  # clipped in place


def test_overflow_check_reduces_the_flag_and_reads_no_overflow(fake_world):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    class Stub:  # what has_overflow reads of the optimizer
        cpu_offload, dp_process_group = False, None
        bit16_groups, averaged_gradients = [[torch.ones(2)]], {0: [torch.ones(2)]}
        _has_inf_or_nan = staticmethod(DeepSpeedZeroOptimizer._has_inf_or_nan)
        has_overflow_partitioned_grads_serial = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial
        _model_parallel_all_reduce = DeepSpeedZeroOptimizer._model_parallel_all_reduce
        model_parallel_group = None

    stub = Stub()
    with FakeTensorMode(allow_non_fake_inputs=True):
        stub.averaged_gradients = {0: [torch.ones(2)]}
        with healthy_scalar_reads():
            assert DeepSpeedZeroOptimizer.has_overflow(stub) is False


@needs_traced_deepspeed
def test_rank_agreement_checks_read_this_ranks_own_list(fake_world):
    from deepspeed.runtime.zero.utils import assert_ints_same_as_other_ranks

    with FakeTensorMode(), healthy_scalar_reads():
        assert_ints_same_as_other_ranks([7, 3, 9, 3])  # broadcast from rank 0, compared element by element
        assert_ints_same_as_other_ranks([])


def test_a_read_elsewhere_in_deepspeed_stops_the_trace_naming_the_place(tmp_path):
    folder = tmp_path / "deepspeed" / "runtime"
    folder.mkdir(parents=True)
    (folder / "moved.py").write_text(
        textwrap.dedent("""
        def check(t):
            return t.sum().item() > 0
    """)
    )
    spec = importlib.util.spec_from_file_location("moved_check", folder / "moved.py")
    moved = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moved)
    with FakeTensorMode(), healthy_scalar_reads():
        with pytest.raises(UnknownScalarRead, match=r"deepspeed/runtime/moved.py:3 \(check\).*do not know"):
            moved.check(torch.ones(3))
        with pytest.raises(DataDependentOutputException):  # outside DeepSpeed, fake mode's own refusal stands
            torch.ones(3).sum().item()


# ---------------------------------------------------------------- versions


@pytest.mark.parametrize("version", ["0.17.0", "0.18.9", "0.19.5", "0.20.0", "1.0.0"])
def test_other_deepspeed_versions_are_refused_naming_the_version(version):
    reason = version_reason(version)
    assert reason.startswith(f"DeepSpeed {version}: ") and "0.19.8 <= version < 0.20.0" in reason
    assert "\n" not in reason


def test_supported_versions_and_a_missing_deepspeed():
    assert version_reason("0.19.8") is None and version_reason("0.19.12+cu128") is None
    assert "not installed" in version_reason(None)


def test_a_zero3_plan_with_another_deepspeed_is_not_traced(monkeypatch):
    import hf_dist

    monkeypatch.setattr(zero_shims, "installed_version", lambda: "0.20.1")
    with pytest.raises(TraceUnsupported, match=r"cannot trace zero3 .*DeepSpeed 0.20.1: .*the analytic estimate"):
        trace_memory(tiny_llama_config(), strategy="zero3", world_size=8)
    plan = hf_dist.plan(tiny_llama_config(), gpus=8, gpu_memory_gib=80, strategy="zero3", verify=True)
    assert plan.verification == (
        "not traced zero3/none: DeepSpeed 0.20.1: hf_dist's tracing shims copy DeepSpeed 0.19.8 and run only with "
        "0.19.8 <= version < 0.20.0; install deepspeed==0.19.8 to trace; the analytic estimate stands"
    )
    assert plan.trace is None


# ---------------------------------------------------------------- the engine's config and the traced run


def test_engine_config_fills_the_trainers_auto_values():
    from hf_dist.tracing.prepare import build_model
    from hf_dist.tracing.zero import engine_config

    setup = TraceSetup(strategy="zero3", world_size=16, micro_batch_size=2, gradient_accumulation_steps=4)
    config = engine_config(setup, build_model(tiny_llama_config(), setup))
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 4)
    assert config["train_batch_size"] == 2 * 4 * 16 and config["gradient_clipping"] == 1.0
    assert config["bf16"]["enabled"] and config["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()  # the Trainer's global config is not left behind


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def _partition(numel: int, world: int) -> int:
    return math.ceil(numel / world)


@needs_traced_deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_traced_hold_their_partitions(stage):
    """Full fine-tuning of the tiny Llama on 8 ranks, bf16: the fp32 master partition and AdamW's two moments are
    1/8 of the trainable parameters per group (decay and no-decay, each padded); ZeRO-1/2 keep every bf16 weight,
    ZeRO-3 a partition."""
    from hf_dist.planning.modelinfo import model_spec

    world, config = 8, tiny_llama_config()
    said = _Said()
    logging.getLogger("transformers.training_args").addHandler(said)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = trace_memory(config, isolate=False, strategy=f"zero{stage}", world_size=world, seq_len=32,
                                  micro_batch_size=2)  # fmt: skip
    finally:
        logging.getLogger("transformers.training_args").removeHandler(said)
    # nothing of the hypothetical launch reaches the user: torch's deprecation of DeepSpeed's collectives, transformers'
    # "process group is initialized, but parallel_mode != DISTRIBUTED" (hf-dist plan --verify printed both)
    assert not [w for w in caught if re.search(DEPRECATED_COLLECTIVES, str(w.message))]
    assert not said.records, said.records
    n = model_spec(config).num_params
    norms = config.hidden_size * (2 * config.num_hidden_layers + 1)
    partitions = _partition(n - norms, world) + _partition(norms, world)
    assert result.complete and result.peak_phase != "optimizer step"
    assert result.states["optimizer"] == pytest.approx(3 * 4 * partitions, abs=64)  # + AdamW's step scalars
    params = 2 * n if stage < 3 else 2 * partitions
    assert result.states["params"] == pytest.approx(params, rel=0.1)  # ZeRO-3: + the persistent norms
    assert torch.nn.functional.linear is torch._C._nn.linear  # ZeRO-3's replacement does not outlive the trace


def test_traced_streams_tag_what_deepspeed_allocates_inside_its_stream_contexts():
    """On the CPU accelerator ``stream()`` is a no-op and every stream None; within ``traced_streams`` a named stream's
    context makes it current for the allocation log, and the accelerator is restored after."""
    from deepspeed.accelerator import get_accelerator

    from hf_dist.tracing.allocations import current_stream

    accelerator = get_accelerator()
    reduction = zero_shims.TracedStream(zero_shims.REDUCTION_STREAM)
    with zero_shims.traced_streams():
        assert accelerator.current_stream() is zero_shims.DEFAULT_STREAM
        with accelerator.stream(reduction):
            assert current_stream() == zero_shims.REDUCTION_STREAM
            with accelerator.stream(accelerator.current_stream()):  # average_tensor without overlap_comm
                assert current_stream() == zero_shims.REDUCTION_STREAM
            with accelerator.stream(None):  # a stream the CPU accelerator left None: no switch
                assert current_stream() == zero_shims.REDUCTION_STREAM
            with accelerator.stream(accelerator.default_stream()):
                assert current_stream() is None
        assert current_stream() is None
    assert accelerator.current_stream() is None and "stream" not in accelerator.__dict__


def test_name_streams_gives_zeros_objects_the_streams_a_gpu_rank_makes():
    def engine(overlap, **holders):
        optimizer = type("DeepSpeedZeroOptimizer_Stage3", (), {})()
        optimizer.reduce_and_partition_stream = holders.get("stream")
        optimizer.parameter_offload = type("DeepSpeedZeRoOffload", (), {})()
        optimizer.parameter_offload._DeepSpeedZeRoOffload__allgather_stream = None
        coordinator = type("PartitionedParameterCoordinator", (), {})()
        coordinator._PartitionedParameterCoordinator__allgather_stream = None
        optimizer.parameter_offload.param_coordinator = coordinator
        return type("Engine", (), {"optimizer": optimizer, "zero_overlap_comm": lambda self: overlap})()

    overlapped = engine(True)
    assert len(zero_shims.name_streams(overlapped)) == 3
    assert overlapped.optimizer.reduce_and_partition_stream.name == zero_shims.REDUCTION_STREAM
    coordinator = overlapped.optimizer.parameter_offload.param_coordinator
    assert coordinator._PartitionedParameterCoordinator__allgather_stream.name == zero_shims.ALLGATHER_STREAM
    plain = engine(False)  # stage3.py: default_stream() without overlap_comm
    zero_shims.name_streams(plain)
    assert plain.optimizer.reduce_and_partition_stream is zero_shims.DEFAULT_STREAM
    with pytest.raises(LookupError, match="reduce_and_partition_stream"):
        zero_shims.name_streams(engine(True, stream=object()))  # a DeepSpeed whose streams moved is not traced
