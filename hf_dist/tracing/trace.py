"""Trace one rank's training memory with fake tensors and a fake process group: exact, allocation-free, no GPU.

The real model of the config is built and prepared as the run will be (:mod:`hf_dist.tracing.prepare`), then one
warm-up step (which creates the optimizer state) and one measured step run the Trainer's loop body: forward with
the labels (the model's own loss), ``backward`` of the loss over the accumulation steps, ``optimizer.step()``,
``zero_grad(set_to_none=True)``. torch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2) records every storage made
or freed under ``FakeTensorMode``; the peak and its breakdown are rank 0's. Collectives go to torch's fake process
group of the plan's world size, so 512 ranks cost what 8 do.

What it measures is ``torch.cuda.max_memory_allocated`` of the run: live tensors. Every storage made and freed is
also logged in order and replayed through torch's caching allocator (:mod:`hf_dist.tracing.allocations`): what the run
reserves (``max_memory_reserved``); :meth:`TraceResult.device_total` adds the CUDA context.
A CPU build of torch cannot fake CUDA tensors, so the trace runs CPU kernels' shapes (autocast on CPU; sdpa's CPU
flash kernel saves what the CUDA one does for these shapes).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

from hf_dist.tracing.allocations import AllocationLog
from hf_dist.tracing.result import TERM_ORDER, TraceError, TraceResult, TraceTimeout
from hf_dist.tracing.setup import TraceSetup, TraceUnsupported, check_traceable
from hf_dist.tracing.tracker import as_terms, inplace_fused_optimizer_ops, new_tracker, snapshot
from hf_dist.tracing.zero_shims import UnknownScalarRead

# torch 2.13's FSDP2 warns whenever a wrapped module returns a view (every embedding and TP linear under FSDP2 x TP),
# in case the model changes it in place. It speaks of the user's model in their own run; in a trace of fake tensors,
# whose gradients nobody reads, it is noise in `hf-dist plan --verify`'s output.
FSDP_VIEW_OUTPUT = r"FSDP2-wrapped module \(.*\) returned a view tensor"

# ---------------------------------------------------------------- the fake world


@contextlib.contextmanager
def fake_world(setup: TraceSetup):
    """A fake process group of the setup's world size and the device mesh the layout uses, made before any
    fake tensor exists (the mesh must be real); torn down afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TraceError(
            "a process group is already initialised in this process; trace_memory(..., isolate=True) runs the "
            "trace in a process of its own"
        )
    layout = setup.layout
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setup.world_size)
    try:
        if setup.tp_size > 1 or layout.strategy.is_deepspeed:  # transformers / DeepSpeed make their own groups
            mesh = None
        elif layout.strategy.replicates_across_nodes:
            mesh = init_device_mesh("cpu", (layout.dp_replicate_size, layout.dp_shard_size),
                                    mesh_dim_names=("dp_replicate", "dp_shard"))  # fmt: skip
        else:
            mesh = init_device_mesh("cpu", (setup.world_size,), mesh_dim_names=("dp_shard",))
        yield mesh
    finally:
        try:
            if layout.strategy.is_deepspeed:
                from hf_dist.tracing.zero import release_groups

                release_groups()
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------- the steps


# True: the optimizer state comes from a full first step (forward, backward, step), as it did before the state was
# made directly (tests/unit/tracing/test_trace.py compares both)
WARM_UP_BY_STEP = False


def create_optimizer_state(model: Any, optimizer: Any) -> None:
    """The optimizer state a first step leaves, made without its forward and backward: every trainable parameter
    gets a zero gradient of its own shape, dtype and placement (what backward gives it: FSDP2's sharded gradients
    are cast to the shards' dtype), ``optimizer.step()`` creates the state as it does on any first step, and the
    gradients go again. Run in fake mode before the tracker starts: the first step's forward and backward hold less
    than the measured step's, which has the state on top, so they never decided the peak and cost half the trace."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    with _skip_fused_updates():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _skip_fused_updates():
    """The fused optimizers' in-place update skipped, as the tracker skips it (fake mode's kernel copies every state)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    skipped = inplace_fused_optimizer_ops()

    class Skip(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in skipped:  # before DTensor's sharding propagation, which is quadratic in the tensors of a call
                return None
            if any(t is DTensor for t in types):
                return NotImplemented  # DTensor first: its local ops then come here
            return func(*args, **(kwargs or {}))

    with Skip():
        yield


def _train_steps(model: Any, optimizer: Any, setup: TraceSetup, vocab_size: int, on_phase: Any, tracker: Any) -> None:
    """One full step of up to two micro-batches (a second one is what gradient accumulation adds: gradients alive
    during forward), on top of the optimizer state (:func:`create_optimizer_state`; with :data:`WARM_UP_BY_STEP`, a
    one-micro-batch step first instead)."""
    import torch

    ids = torch.randint(0, vocab_size, (setup.micro_batch_size, setup.seq_len))
    accumulation = setup.gradient_accumulation_steps
    for micro_batches in ((1,) if WARM_UP_BY_STEP else ()) + (min(accumulation, 2),):
        for index in range(micro_batches):
            with _sync(model, index == micro_batches - 1 or setup.sync_each_batch):
                on_phase("forward")
                loss = model(input_ids=ids, labels=ids).loss
                on_phase("backward")
                (loss / accumulation).backward()
                del loss
            tracker.reset_mod_stats()  # per-module statistics are per forward; the peak is kept
        on_phase("optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _sync(model: Any, sync: bool):
    """accelerate's ``no_sync`` for a non-final micro-batch: DDP's ``no_sync``, FSDP2's gradient sync off. The
    Trainer syncs every micro-batch with ``sync_each_batch`` (transformers ``Trainer._inner_training_loop``)."""
    if sync:
        yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


_DDP_NOTE = (
    "DDP's Reducer reads raw storage and cannot run on fake tensors: its buckets (one flat copy of the trainable "
    "gradients, allocated at construction) are counted in buffers, and the all-reduce, in place on them, adds nothing"
)


def trace_here(
    config: Any, setup: TraceSetup, *, time_limit_s: float = 300.0, trust_remote_code: bool = False
) -> TraceResult:
    """Trace ``setup`` for ``config`` in this process (no process group may be initialised here); the config's
    ``auto_map`` classes are imported only with ``trust_remote_code=True``.

    Raises :class:`TraceUnsupported` for a layout that cannot be traced (naming why), :class:`TraceTimeout`
    (with ``partial``) past ``time_limit_s``, :class:`TraceError` when the model fails under the layout.
    """
    check_traceable(setup, config)
    from hf_dist.tracing import prepare
    from hf_dist.tracing.liger import liger_applied

    start = time.monotonic()
    deadline = start + time_limit_s
    optimizer = prepare.trainer_optimizer(setup)  # before the fake group: no launch warnings
    run = None
    try:
        with (
            fake_world(setup) as mesh,
            liger_applied(setup.use_liger_kernel, config) as apply_liger,
            _engine_process(setup),
            warnings.catch_warnings(),
        ):
            warnings.filterwarnings("ignore", message=FSDP_VIEW_OUTPUT, category=UserWarning)
            run = _Run(config, setup, mesh, optimizer, deadline, trust_remote_code, apply_liger)
            run.steps()
    except (TraceError, TraceUnsupported):
        raise
    except UnknownScalarRead as exc:  # a DeepSpeed version whose checks moved: refused, never traced down a guess
        raise TraceUnsupported(f"cannot trace {setup.layout.describe()}: {exc}; the analytic estimate stands") from exc
    except Exception as exc:  # the model or a library failed under this layout
        if time.monotonic() > deadline and run is not None:  # a library re-raised the time limit as its own error
            run.complete = False
        else:
            raise TraceError(
                f"the model failed under {setup.layout.describe()} while tracing ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); the analytic estimate stands"
            ) from exc
    result = run.result(time.monotonic() - start)
    if not run.complete:
        raise TraceTimeout(
            f"the trace of {setup.layout.describe()} ran past its {time_limit_s:g} s limit (peak so far "
            f"{result.peak_bytes / 1024**3:.2f} GiB, in {result.peak_phase or 'set-up'}); the analytic estimate stands",
            partial=result,
        )
    return result


def _engine_process(setup: TraceSetup) -> Any:
    """What the engine's process has: rank 0's launcher variables and DeepSpeed's log level for DeepSpeed."""
    if not setup.layout.strategy.is_deepspeed:
        return contextlib.nullcontext()
    from hf_dist.tracing.zero import rank_zero

    return rank_zero(setup)


def _engine_name(setup: TraceSetup) -> str:
    if not setup.layout.strategy.is_deepspeed:
        return ""
    from hf_dist.tracing.zero_shims import installed_version

    return f"DeepSpeed {installed_version()}"


def _deepspeed_note(answered: dict[str, int]) -> str:
    reads = ", ".join(f"{name} x{count}" for name, count in sorted(answered.items())) or "none"
    return (
        "DeepSpeed's engine ran unchanged but for its module.to, which kept the fake module in place, and its reads "
        f"of tensor values ({reads}), answered as a healthy step reads them: no overflow, a finite gradient norm, "
        "every rank agreeing"
    )


def _engine_states(engine: Any) -> tuple[list, list, list]:
    from hf_dist.tracing.zero import state_tensors

    states = state_tensors(engine)
    return states["params"], states["optimizer"], states["grads"]


class _Run:
    """One traced run: the model prepared and materialised, its optimizer, the tracker, the peak's phase."""

    def __init__(self, config: Any, setup: TraceSetup, mesh: Any, optimizer: tuple, deadline: float,
                 trust_remote_code: bool = False, apply_liger: Any = None) -> None:  # fmt: skip
        from torch._subclasses.fake_tensor import FakeTensorMode

        from hf_dist.tracing import prepare

        self.setup, self.complete, self.phase, self.peak_phase, self.peak_seen = setup, True, "", "", 0
        self.notes: list[str] = []
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = text.vocab_size
        self.tracker, self.log = None, AllocationLog()
        self.streams: list[str] = []  # the engine's streams the replay separates (DeepSpeed's, zero_shims)
        model = prepare.build_model(config, setup, trust_remote_code=trust_remote_code)
        model = apply_liger(model) if apply_liger else model  # the Trainer's __init__, before accelerate's prepare
        model = prepare.enable_checkpointing(model, setup)
        model = prepare.shard(model, setup, mesh)
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.engine = None
        with self.fake:
            self.model = prepare.autocast_forward(prepare.materialize(model), setup)
            if setup.layout.strategy.is_deepspeed:
                self._start_deepspeed(optimizer, deadline)
                return
            self.buckets = prepare.ddp_buckets(self.model, setup)
            cls, kwargs = optimizer
            self.optimizer = cls([p for p in self.model.parameters() if p.requires_grad], **kwargs)
            if not WARM_UP_BY_STEP:
                create_optimizer_state(self.model, self.optimizer)
            self.tracker = new_tracker(self.model, self.optimizer, deadline, self.log)
            if self.buckets:
                self.tracker.track_external(*self.buckets)

    def _start_deepspeed(self, optimizer: tuple, deadline: float) -> None:
        """The DeepSpeed engine started on the fake-materialised model under the tracker, so every buffer it makes
        at start is counted (as buffers, unless it holds parameters, gradients or optimizer state); the peak is
        taken from the first step on (the tracker restarts it when the steps enter it), as on a GPU, where DeepSpeed
        builds its flat buffers after moving the module's parameters to the host. The allocation log restarts there
        too: the storages alive after the start are the replay's set-up, and the start's own transients (the fake
        module kept in place beside the flat buffers) are not replayed."""
        from hf_dist.tracing import zero
        from hf_dist.tracing.zero_shims import healthy_scalar_reads

        self.buckets = []
        self.optimizer = zero.trainer_optimizer(self.model, optimizer)
        self.tracker = new_tracker(self.model, self.optimizer, deadline, self.log, grad_hooks=False)
        with self.tracker, healthy_scalar_reads():
            self.engine = zero.initialize(self.model, self.optimizer, self.setup)
        self.streams = zero.name_streams(self.engine)
        self.tracker.relabel("ACT", "OTH")
        self._label_engine_states()
        self.log.restart(self.tracker.live())

    def _label_engine_states(self) -> None:
        for category, tensors in zip(("PARAM", "OPT", "GRAD"), _engine_states(self.engine), strict=True):
            self.tracker.label(tensors, category)

    def steps(self) -> None:
        from hf_dist.tracing.cuda_attention import cuda_attention
        from hf_dist.tracing.prepare import cuda_dropout

        with self.fake, self.tracker, cuda_dropout(), cuda_attention():
            try:
                if self.engine is None:
                    _train_steps(self.model, self.optimizer, self.setup, self.vocab_size, self.on_phase, self.tracker)
                else:
                    self._deepspeed_steps()
            except TraceTimeout:
                self.complete = False
        self.on_phase("")

    def _deepspeed_steps(self) -> None:
        from hf_dist.tracing import zero
        from hf_dist.tracing.zero_shims import healthy_scalar_reads, traced_streams

        def after_backward() -> None:
            self.tracker.reset_mod_stats()
            self._label_engine_states()  # gradient partitions DeepSpeed creates in the first backward

        reads = healthy_scalar_reads()
        with reads, traced_streams():
            zero.train_steps(self.engine, self.setup, self.vocab_size, self.on_phase, after_backward)
        self.notes.append(_deepspeed_note(reads.answered))

    def on_phase(self, name: str) -> None:
        total = snapshot(self.tracker, "peak").get("Total", 0)
        if total > self.peak_seen:
            self.peak_phase, self.peak_seen = self.phase, total
        self.phase = name
        self.log.phase(name)

    def result(self, seconds: float) -> TraceResult:
        if self.tracker is None:  # stopped before anything ran
            peak, rest = {}, dict.fromkeys(TERM_ORDER, 0)
        else:
            peak, rest = snapshot(self.tracker, "peak"), as_terms(snapshot(self.tracker, "current"))
        reserved = self.log.reserved_bytes()[0] if self.tracker is not None and self.complete else 0
        return TraceResult(
            setup=self.setup, peak_bytes=peak.get("Total", 0), terms=as_terms(peak),
            categories={k: v for k, v in peak.items() if k != "Total" and v},
            states={"params": rest["params"], "optimizer": rest["optimizer"]}, seconds=round(seconds, 2),
            complete=self.complete, peak_phase=self.peak_phase,
            notes=([_DDP_NOTE] if self.buckets else []) + self.notes, engine=_engine_name(self.setup),
            reserved_bytes=reserved, streams=list(self.streams) if reserved else [],
        )  # fmt: skip
