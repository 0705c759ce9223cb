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
from dataclasses import dataclass, field
from typing import Any

from hf_dist.tracing.allocations import AllocationLog
from hf_dist.tracing.setup import TraceSetup, TraceUnsupported, check_traceable
from hf_dist.tracing.zero_shims import UnknownScalarRead

# the trackers' categories as the memory model names its terms (hf_dist.planning.memory.MemoryEstimate)
TERMS = {
    "Parameter": "params", "Sharded Param": "params",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Buffer": "buffers", "Unsharded Param": "buffers", "All Gather": "buffers", "Reduce Scatter": "buffers",
    "Other": "buffers",  # DDP's Reducer buckets (prepare.ddp_buckets)
    "Inputs": "inputs",
}  # fmt: skip
TERM_ORDER = ("params", "grads", "optimizer", "activations", "temporaries", "buffers", "inputs")


class TraceError(RuntimeError):
    """The trace could not run to the end; the message says where, and that the analytic estimate stands."""


class TraceTimeout(TraceError):
    """The trace ran past its time limit; ``partial`` holds the peak of what ran."""

    def __init__(self, message: str, partial: TraceResult | None = None) -> None:
        super().__init__(message)
        self.partial = partial


@dataclass(frozen=True)
class TraceResult:
    """Rank 0's traced memory for one layout.

    ``peak_bytes``: the largest sum of live tensors (what ``torch.cuda.max_memory_allocated`` reports);
    ``terms``: that peak by memory-model term (params, grads, optimizer, activations, temporaries — gradients of
    activations and other backward/step intermediates —, buffers — gathered FSDP units, communication buffers,
    module buffers —, inputs); ``categories``: the tracker's own names; ``states``: params and optimizer state
    after the step, the model states at rest; ``reserved_bytes``: what the caching allocator reserves for the traced
    allocations over the run's steps (``max_memory_reserved``; 0 when the trace was cut short). ``complete`` is False when the time limit stopped the trace: the
    peak is then of what ran.
    """

    setup: TraceSetup
    peak_bytes: int
    terms: dict[str, int]
    categories: dict[str, int]
    states: dict[str, int]
    seconds: float
    complete: bool = True
    peak_phase: str = ""
    notes: list[str] = field(default_factory=list)
    reserved_bytes: int = 0
    engine: str = ""  # what ran besides torch: "DeepSpeed 0.19.8" for ZeRO layouts
    # the engine's streams whose allocations the replay served from their own pools (DeepSpeed's reduction and
    # all-gather streams, tracing/zero_shims.py); empty: one stream, the collectives' streams from the memory model
    streams: list[str] = field(default_factory=list)

    def checked(self) -> str:
        """What the trace ran, in a few words: ``rank 0 of 64 ranks, DeepSpeed 0.19.8's engine``."""
        what = f"rank 0 of {self.setup.world_size} ranks"
        return what + (f", {self.engine}'s engine" if self.engine else "") + " under fake tensors"

    def device_total(self, estimate: Any) -> int:
        """Device memory in use at the peak: what the caching allocator reserves for the traced allocations, replayed
        over the run's steps (``reserved_bytes``, :mod:`hf_dist.tracing.allocations`), plus what the memory model adds
        outside it (the CUDA context, and the blocks the collectives' streams cache:
        :func:`~hf_dist.planning.transients.comm_stream_reserve_bytes`, unless the replay served the engine's
        streams from pools of their own: ``streams``, a DeepSpeed trace). A trace cut short has no replay: its peak
        plus the model's reserve."""
        if not self.reserved_bytes:
            return self.peak_bytes + estimate.total - estimate.allocated
        comm = 0 if self.streams else estimate.comm_reserve
        return self.reserved_bytes + comm + estimate.overhead

    def to_dict(self) -> dict[str, Any]:
        return {
            "setup": self.setup.to_dict(), "peak_bytes": self.peak_bytes, "terms": self.terms,
            "categories": self.categories, "states": self.states, "seconds": self.seconds,
            "complete": self.complete, "peak_phase": self.peak_phase, "notes": list(self.notes),
            "reserved_bytes": self.reserved_bytes, "engine": self.engine, "streams": list(self.streams),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceResult:
        return cls(**{**data, "setup": TraceSetup.from_dict(data["setup"])})

    def compare(self, estimate: Any) -> str:
        """Traced against modelled memory per term, for ``Plan.explain()`` and ``hf-dist plan --verify``."""
        from hf_dist.planning.plan_result import format_bytes

        modelled = {
            "params": estimate.params, "grads": estimate.grads, "optimizer": estimate.optimizer,
            "activations": estimate.activations + estimate.logits, "temporaries": estimate.step,
            "buffers": estimate.buffers,
        }  # fmt: skip
        rows = [("term", "traced at the peak", "modelled")]
        rows += [(t, format_bytes(self.terms.get(t, 0)), format_bytes(modelled[t]) if t in modelled else "-")
                 for t in TERM_ORDER if self.terms.get(t, 0) or modelled.get(t, 0)]  # fmt: skip
        ratio = self.peak_bytes / estimate.allocated if estimate.allocated else float("nan")
        rows.append(("allocated", format_bytes(self.peak_bytes), f"{format_bytes(estimate.allocated)} "
                     f"(traced/modelled {ratio:.3f})"))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        state = "" if self.complete else " (stopped at its time limit: the peak of what ran)"
        head = f"traced rank 0 in {self.seconds:.1f} s{state}; the modelled activations include the logits:"
        return "\n".join([head, *lines, *(f"  note: {n}" for n in self.notes)])


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


# ---------------------------------------------------------------- trackers


def _tracker(
    model: Any, optimizer: Any, deadline: float, log: AllocationLog | None = None, grad_hooks: bool = True
) -> Any:
    """The tracker for the model, stopping at ``deadline`` (checked at every operator, so a trace never hangs),
    writing every storage it sees made or freed to ``log`` in order. ``grad_hooks=False``: a parameter's ``.grad``
    is not counted as a gradient (DeepSpeed copies each into its reduce bucket and points ``.grad`` into it; the
    engine's own gradient buffers are labelled instead)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType
    from torch.distributed.fsdp import FSDPModule

    fsdp = isinstance(model, FSDPModule)
    base = FSDPMemTracker if fsdp else MemTracker

    inplace_fused = _inplace_fused_optimizer_ops()

    class Tracker(base):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if time.monotonic() > deadline:
                raise TraceTimeout("time limit")
            if func in inplace_fused:
                # the fused kernel updates in place and allocates nothing on the device; fake mode's kernel builds
                # out-of-place copies of every state instead (19.5 GiB on a 1B model), and fake values never matter
                return None
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # MemTracker hooks every parameter's gradient, which fails on frozen ones (a LoRA base)
            params = buffers = 0
            for param in module.parameters():
                params += sum(w.mem_consumed for w in self._update_and_maybe_create_winfos(param, _MemRefType.PARAM))
                if param.grad is not None:
                    self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)
                hook = install_grad_hooks and grad_hooks and param.requires_grad
                if hook and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._grad_hook),
                        param.register_post_accumulate_grad_hook(lambda p: self._grad_hook(p.grad)),
                    )
            for buffer in module.buffers():
                buffers += sum(
                    w.mem_consumed for w in self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
                )
            return params, buffers

        def _update_peak_stats(self, peak_state):
            # only the global peak: MemTracker also keeps every module's own peak, walking all modules at every
            # operator (O(operators x modules): 52 s instead of 10 s for a 1B LoRA model), which the trace never reads
            for device, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snap["Total"]:
                    self._peak_mem[device] = snap["Total"]
                    self._peak_mem_snap[device] = dict(snap)

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            if log is not None:
                log.record(u_type, winfo, getattr(winfo.reftype, "value", None) in ("Optstate", "OptState"))
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

        def _grad_hook(self, grad):
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
            return _with_stats(self, fsdp_mod, super()._fsdp_param_group_pre_backward(fsdp_mod, orig))

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
            return _with_stats(self, fsdp_mod, super()._fsdp_param_group_post_backward(fsdp_mod, orig))

        def label(self, tensors, category: str) -> None:
            """Count the storages of ``tensors`` under ``category`` (a ``_MemRefType`` name) from now on."""
            reftype = _MemRefType[category]
            for tensor in tensors:
                if tensor.untyped_storage().nbytes():
                    self._update_and_maybe_create_winfos(tensor, reftype)

        def relabel(self, old: str, new: str) -> None:
            """Every storage counted under ``old`` counts under ``new`` from now on."""
            old_type, new_type = _MemRefType[old], _MemRefType[new]
            for winfo, _ in list(self._WINFO.values()):
                if winfo.reftype == old_type:
                    winfo.reftype = new_type
                    self._update_snap(_UpdateType.REF, winfo, old_reftype=old_type)

        def live(self) -> list:
            """The tracker's record of every storage alive now."""
            return [winfo for winfo, _ in list(self._WINFO.values())]

    tracker = Tracker(model, optimizer) if fsdp else Tracker()
    if not fsdp:
        tracker.track_external(model, optimizer)
    return tracker


def _with_stats(tracker: Any, fsdp_mod: Any, hook: Any) -> Any:
    """``FSDPMemTracker``'s backward ``hook`` of ``fsdp_mod``, given the per-module statistics the tracker makes only
    in the module's own forward. A unit can reach backward without its module's forward: accelerate's tail unit
    (final norm and ``lm_head``) under Liger, whose loss reads ``lm_head.weight`` directly; the tracker would fail on
    the missing key (these statistics are not the peak)."""
    import functools

    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModMemStats

    @functools.wraps(hook)
    def call(*args: Any, **kwargs: Any) -> Any:
        if fsdp_mod not in tracker.memory_tracking:
            name = tracker._mod_tracker.get_known_fqn(fsdp_mod) or type(fsdp_mod).__name__
            tracker.memory_tracking[fsdp_mod] = _FSDPModMemStats(name)
        return hook(*args, **kwargs)

    return call


def _inplace_fused_optimizer_ops() -> frozenset:
    import torch

    ops = []
    for name in ("_fused_adamw_", "_fused_adam_", "_fused_sgd_", "_fused_adagrad_"):
        packet = getattr(torch.ops.aten, name, None)
        ops += [getattr(packet, overload) for overload in (packet.overloads() if packet else ())]
    return frozenset(ops)


def _snapshot(tracker: Any, kind: str) -> dict[str, int]:
    snap = tracker.get_tracker_snapshot(kind)
    merged: dict[str, int] = {}
    for device, per_device in snap.items():
        if getattr(device, "type", device) == "meta":  # shape bookkeeping of TP styles, never allocated
            continue
        for key, value in per_device.items():
            name = getattr(key, "value", key)
            merged[name] = merged.get(name, 0) + int(value)
    return merged


def _terms(categories: dict[str, int]) -> dict[str, int]:
    out = dict.fromkeys(TERM_ORDER, 0)
    for name, value in categories.items():
        if name in TERMS:
            out[TERMS[name]] += value
    return out


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

    skipped = _inplace_fused_optimizer_ops()

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
        ):
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
            self.tracker = _tracker(self.model, self.optimizer, deadline, self.log)
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
        self.tracker = _tracker(self.model, self.optimizer, deadline, self.log, grad_hooks=False)
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
        total = _snapshot(self.tracker, "peak").get("Total", 0)
        if total > self.peak_seen:
            self.peak_phase, self.peak_seen = self.phase, total
        self.phase = name
        self.log.phase(name)

    def result(self, seconds: float) -> TraceResult:
        if self.tracker is None:  # stopped before anything ran
            peak, rest = {}, dict.fromkeys(TERM_ORDER, 0)
        else:
            peak, rest = _snapshot(self.tracker, "peak"), _terms(_snapshot(self.tracker, "current"))
        reserved = self.log.reserved_bytes()[0] if self.tracker is not None and self.complete else 0
        return TraceResult(
            setup=self.setup, peak_bytes=peak.get("Total", 0), terms=_terms(peak),
            categories={k: v for k, v in peak.items() if k != "Total" and v},
            states={"params": rest["params"], "optimizer": rest["optimizer"]}, seconds=round(seconds, 2),
            complete=self.complete, peak_phase=self.peak_phase,
            notes=([_DDP_NOTE] if self.buckets else []) + self.notes, engine=_engine_name(self.setup),
            reserved_bytes=reserved, streams=list(self.streams) if reserved else [],
        )  # fmt: skip
