"""The two places where DeepSpeed's engine cannot run on fake tensors, handled so that it allocates what it would.

1. ``DeepSpeedEngine._configure_distributed_model`` calls ``module.to(device)``. torch swaps the parameters of a
   fake-materialised module (``Module._apply`` always swaps ``FakeTensor`` parameters), and ``FakeTensorMode`` holds
   weak references to them, so the swap fails. :func:`fake_module_to` gives the module the ``.to`` torch runs for
   ordinary tensors: each tensor converted and set with ``param.data = ...``, which for a module already on the
   device is no copy at all, as on a real rank.
2. The optimizer step branches in Python on tensor values (``.item()``, ``bool(tensor)``): the overflow and
   gradient-norm checks, and ZeRO-3's checks that every rank recorded the same parameter order. Fake tensors have
   no values. :class:`HealthyScalarReads` answers each such read at the places read from DeepSpeed's source
   (:data:`SITES`) with what a healthy step reads there (no overflow, a finite norm, every rank agreeing); every
   tensor those checks build is still allocated and reduced. A read anywhere else in DeepSpeed stops the trace
   (:class:`UnknownScalarRead`): a version whose checks moved is refused, never traced down a guessed branch.

And one that changes nothing DeepSpeed allocates, only which stream the trace says it allocates on
(:func:`traced_streams`): on a GPU, ZeRO's optimizers reduce (and ZeRO-3 gathers) on streams of their own, whose
allocations CUDA's caching allocator serves from those streams' own blocks; on the fake world's CPU accelerator the
streams are None and ``stream()`` a no-op. The shim names the streams the GPU would make and tags what is allocated
inside ``with get_accelerator().stream(...)``, for the per-stream replay (:mod:`hf_dist.tracing.allocations`).

Derived from DeepSpeed 0.19.8's source (:data:`SHIMS_DERIVED_FROM`); :func:`version_reason` refuses other versions.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

# The DeepSpeed releases whose sources the shims were read from and run against (docs/planner.md, "Tracing").
# 0.17.0 - 0.19.5 (read from their tags) check the gradient norm with ``.item()`` in ``get_grad_norm_direct`` and
# take Python floats through the step; 0.19.8 keeps the norm a tensor and reads it in ``is_invalid_grad_norm``.
SHIMS_DERIVED_FROM = "0.19.8"
SUPPORTED_RANGE = ((0, 19, 8), (0, 20, 0))  # [low, high)


class UnknownScalarRead(RuntimeError):
    """DeepSpeed read a tensor's value where the shims have no healthy answer; the message names the place."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.19.8+cu121"`` -> (0, 19, 8); a part that is not a number counts as 0."""
    parts = [p for p in text.split("+")[0].split(".")[:3]]
    numbers = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts]
    return tuple((numbers + [0, 0, 0])[:3])  # type: ignore[return-value]


def installed_version() -> str | None:
    """The DeepSpeed this process runs: the imported module's version, else the installed package's metadata
    (importing DeepSpeed takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    module = sys.modules.get("deepspeed")
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return None


def version_reason(version: str | None) -> str | None:
    """Why DeepSpeed ``version`` cannot be traced, or None when the shims were derived from it."""
    if version is None:
        return "DeepSpeed is not installed (pip install deepspeed; hf_dist's extra: pip install 'hf_dist[deepspeed]')"
    low, high = SUPPORTED_RANGE
    if low <= parse_version(version) < high:
        return None
    # short enough for the plan's one line (verify.why_not keeps 160 characters), the way to trace included
    return (
        f"DeepSpeed {version}: hf_dist's tracing shims copy DeepSpeed {SHIMS_DERIVED_FROM} and run only with "
        f"{_dotted(low)} <= version < {_dotted(high)}; install deepspeed=={SHIMS_DERIVED_FROM} to trace"
    )


def _dotted(parts: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in parts)


# ---------------------------------------------------------------- 1. module.to(device)


@contextlib.contextmanager
def fake_module_to(module: Any):
    """Within the block, ``module.to(...)`` converts each parameter and buffer and assigns it in place
    (``param.data = converted``: the path ``Module._apply`` takes for ordinary tensors) instead of swapping fake
    tensors. A tensor already on the device and in the dtype is kept as is: nothing is allocated, as on a real rank
    whose module is on its device; a conversion allocates the converted tensor and frees the old one, as torch does."""
    module.to = types.MethodType(_to_in_place, module)
    try:
        yield module
    finally:
        del module.to


def _to_in_place(module: Any, *args: Any, **kwargs: Any) -> Any:
    import torch

    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)

    def convert(t: Any) -> Any:
        keep = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else None
        return t.to(device=device, dtype=keep, non_blocking=non_blocking)

    with torch.no_grad():
        for sub in module.modules():
            for tensors in (sub._parameters, sub._buffers):
                for key, tensor in tensors.items():
                    if tensor is None:
                        continue
                    moved = convert(tensor)
                    if moved is tensor:
                        continue
                    if isinstance(tensor, torch.nn.Parameter):
                        tensor.data = moved
                    else:
                        tensors[key] = moved
    return module


# ---------------------------------------------------------------- streams


class TracedStream:
    """A stream the GPU would have (``name``; None: the default stream). DeepSpeed's ordering calls (``wait_stream``,
    ``wait_event``, ``synchronize``, ``query``) do nothing: on one fake rank there is no work to order."""

    def __init__(self, name: str | None) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"TracedStream({self.name!r})"

    def wait_stream(self, *args: Any) -> None:
        return None

    def wait_event(self, *args: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


DEFAULT_STREAM = TracedStream(None)
REDUCTION_STREAM = "ZeRO reduction"  # ZeRO-1/2's reduction_stream, ZeRO-3's reduce_and_partition_stream
ALLGATHER_STREAM = "ZeRO-3 all-gather"  # ZeRO-3's parameter coordinator's __allgather_stream

# Where DeepSpeed 0.19.8 makes its streams, on a device that is not synchronized (a GPU; on the CPU accelerator each is
# None): (class, attribute) -> the stream, given the engine's ``overlap_comm`` (True: a stream of its own, False: the
# default stream, as DeepSpeed passes ``default_stream()``)
STREAM_SITES = {
    # stage_1_and_2.py DeepSpeedZeroOptimizer.__init__: reduction_stream = ... get_accelerator().Stream()
    # (always a stream of its own; average_tensor, reduce_ipg_grads, allreduce_and_copy and
    # _allreduce_noncontiguous_bucket_preserving_fp32 enter it when overlap_comm is set; allreduce_no_retain and
    # allreduce_and_copy_with_multiple_ranks run inside average_tensor's)
    ("DeepSpeedZeroOptimizer", "reduction_stream"): lambda overlap: REDUCTION_STREAM,
    # stage3.py DeepSpeedZeroOptimizer_Stage3.__init__: reduce_and_partition_stream = Stream() if overlap_comm else
    # default_stream() (entered by __add_grad_to_ipg_bucket, __reduce_and_partition_ipg_grads -- its
    # __avg_scatter_grads and partition_grads --, has_overflow; stage3.py's allreduce_and_copy enters a
    # self.reduction_stream that ZeRO-3 never sets: not called). record_stream (stage3.py, partition_parameters.py
    # free_param, stage_1_and_2.py; GPU only) delays a freed block's return to its own stream's pool, nothing more
    ("DeepSpeedZeroOptimizer_Stage3", "reduce_and_partition_stream"): lambda overlap: REDUCTION_STREAM if overlap
    else None,
    # parameter_offload.py DeepSpeedZeRoOffload.__init__: __allgather_stream = Stream() if overlap_comm else
    # default_stream(), handed to partitioned_param_coordinator.py PartitionedParameterCoordinator, whose fetch_sub_module
    # enters it around all_gather_coalesced and the wait for the gathered parameters
    ("DeepSpeedZeRoOffload", "_DeepSpeedZeRoOffload__allgather_stream"): lambda overlap: ALLGATHER_STREAM if overlap
    else None,
    ("PartitionedParameterCoordinator", "_PartitionedParameterCoordinator__allgather_stream"): lambda overlap:
    ALLGATHER_STREAM if overlap else None,
}  # fmt: skip


def _stream_holders(engine: Any) -> list[Any]:
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", None)
    coordinator = getattr(offload, "param_coordinator", None)
    return [o for o in (optimizer, offload, coordinator) if o is not None]


def name_streams(engine: Any) -> list[str]:
    """Give the started engine's ZeRO objects the streams a GPU rank's would have (:data:`STREAM_SITES`), in place of
    the None the CPU accelerator left; the streams named. Raises ``LookupError`` when a ZeRO optimizer of a known class
    lacks the attribute, or holds something other than None there (DeepSpeed moved its streams: the version check
    should have refused it)."""
    overlap = bool(engine.zero_overlap_comm())
    named = []
    for holder in _stream_holders(engine):
        for (cls, attr), stream in STREAM_SITES.items():
            if type(holder).__name__ != cls:
                continue
            if getattr(holder, attr, "missing") is not None:
                raise LookupError(f"DeepSpeed's {cls}.{attr} is not the None the CPU accelerator gives: not traced")
            setattr(holder, attr, TracedStream(stream(overlap)) if stream(overlap) else DEFAULT_STREAM)
            named.append(f"{cls}.{attr}")
    return named


@contextlib.contextmanager
def traced_streams():
    """Within the block, DeepSpeed's accelerator (the CPU accelerator of the fake world, whose streams are None) keeps
    the current stream: ``stream(s)`` makes ``s`` current for the block (:func:`hf_dist.tracing.allocations.on_stream`,
    read where each storage is logged), ``current_stream()`` and ``default_stream()`` return the current and the
    default :class:`TracedStream`. A device that is not synchronized (a GPU accelerator) is left alone."""
    from deepspeed.accelerator import get_accelerator

    from hf_dist.tracing.allocations import current_stream, on_stream

    accelerator = get_accelerator()
    if not accelerator.is_synchronized_device():
        yield
        return

    def stream(s: Any) -> Any:
        if isinstance(s, TracedStream):
            return on_stream(s.name)
        return contextlib.nullcontext()  # None: the CPU accelerator's own stream, no switch

    def current(device_index: Any = None) -> TracedStream:
        name = current_stream()
        return DEFAULT_STREAM if name is None else TracedStream(name)

    patched = {"stream": stream, "current_stream": current, "default_stream": lambda device_index=None: DEFAULT_STREAM}
    saved = {name: accelerator.__dict__.get(name) for name in patched}
    accelerator.__dict__.update(patched)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                accelerator.__dict__.pop(name, None)
            else:
                accelerator.__dict__[name] = value


# ---------------------------------------------------------------- 2. values read in Python


def _no_overflow(frame: Any, tensor: Any) -> Any:
    return 0  # ``overflow_gpu[0].item()``: the all-reduced max of every rank's inf/nan flag


def _valid_norm(frame: Any, tensor: Any) -> Any:
    return False  # ``bool((~isfinite(norm) | (norm < 0)).any())``: the norm is finite and not the -1 sentinel


def _clip(frame: Any, tensor: Any) -> Any:
    return True  # ``clip_coef < 1``: the norm exceeds max_norm; the gradients are scaled in place (no allocation)


def _rank0_length(frame: Any, tensor: Any) -> Any:
    return frame.f_locals["local_list_length"]  # rank 0 recorded as many as this rank


def _rank0_element(frame: Any, tensor: Any) -> Any:
    # ``[t.item() for t in lst_tensor.cpu()]``: rank 0's list, element by element (a comprehension frame of its own
    # before Python 3.12); every rank recorded the same
    owner = frame.f_back if frame.f_code.co_name == "<listcomp>" else frame
    values = owner.f_locals["lst"]
    index = _ELEMENT_INDEX.get(id(owner), 0)
    _ELEMENT_INDEX[id(owner)] = index + 1
    if index + 1 == len(values):
        del _ELEMENT_INDEX[id(owner)]
    return values[index]


_ELEMENT_INDEX: dict[int, int] = {}

# (file under deepspeed/, function) -> the value a healthy step reads there; read from DeepSpeed 0.19.8
SITES: dict[tuple[str, str], Callable[[Any, Any], Any]] = {
    ("runtime/zero/stage_1_and_2.py", "has_overflow"): _no_overflow,
    ("runtime/zero/stage3.py", "has_overflow"): _no_overflow,
    ("runtime/utils.py", "is_invalid_grad_norm"): _valid_norm,
    ("runtime/utils.py", "clip_tensors_by_global_norm"): _clip,
    ("runtime/zero/utils.py", "assert_lst_len_same_as_other_ranks"): _rank0_length,
    ("runtime/zero/utils.py", "get_lst_from_rank0"): _rank0_element,
    ("runtime/zero/utils.py", "<listcomp>"): _rank0_element,
}


# frames between the code that reads a value and the dispatch mode that answers it
_MACHINERY = ("/torch/utils/_python_dispatch.py", "/torch/_subclasses/", "/torch/distributed/_tools/",
              "/torch/_compile.py", "/torch/_dynamo/", "/torch/utils/_stats.py", "/hf_dist/tracing/")  # fmt: skip


def _reading_frame(frame: Any) -> tuple[Any, str]:
    """The frame whose code reads the value (dispatch machinery skipped), and its file."""
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if not any(part in name for part in _MACHINERY):
            return frame, name
        frame = frame.f_back
    raise LookupError("no reading frame")


def answer(tensor: Any) -> tuple[Any, str]:
    """The value a healthy step reads from ``tensor`` at the DeepSpeed call site on the stack, as the Python type
    ``Tensor.item()`` returns for its dtype, and the site's function. Raises :class:`UnknownScalarRead` for a DeepSpeed site not in
    :data:`SITES`, and ``LookupError`` when no DeepSpeed code is reading (the caller lets fake mode refuse it)."""
    frame, name = _reading_frame(sys._getframe(1))
    if "/deepspeed/" not in name:
        raise LookupError(f"not a DeepSpeed read: {name}")
    path = name.rsplit("/deepspeed/", 1)[1]
    site = SITES.get((path, frame.f_code.co_name))
    if site is None:
        raise UnknownScalarRead(
            f"DeepSpeed {installed_version()} reads a tensor's value at deepspeed/{path}:{frame.f_lineno} "
            f"({frame.f_code.co_name}), a place the tracing shims do not know (they answer "
            f"{sorted({f for _, f in SITES})}, read from DeepSpeed {SHIMS_DERIVED_FROM}); the trace stops rather "
            "than guess the branch"
        )
    value = site(frame, tensor)
    name = frame.f_back.f_code.co_name if frame.f_code.co_name == "<listcomp>" else frame.f_code.co_name
    if tensor.dtype.is_floating_point:
        return float(value), name
    return (bool(value) if str(tensor.dtype) == "torch.bool" else int(value)), name


def healthy_scalar_reads() -> Any:
    """A dispatch mode (enter it inside ``FakeTensorMode``) that answers DeepSpeed's reads of tensor values
    (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``float()``) with :func:`answer`; every other op, and
    every read outside DeepSpeed, passes through unchanged."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    local_scalar = torch.ops.aten._local_scalar_dense.default

    class HealthyScalarReads(TorchDispatchMode):
        answered: dict[str, int] = {}  # noqa: RUF012  (replaced per instance below)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is local_scalar:
                with contextlib.suppress(LookupError):
                    value, site = answer(args[0])
                    self.answered[site] = self.answered.get(site, 0) + 1
                    return value
            return func(*args, **(kwargs or {}))

    mode = HealthyScalarReads()
    mode.answered = {}
    return mode
