"""The memory tracker of a trace: torch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2), stopping at a deadline, logging
every storage made or freed (:mod:`hf_dist.tracing.allocations`), skipping the fused optimizers' in-place updates,
and able to label the engine's own tensors; its snapshots read as the memory model's terms."""

from __future__ import annotations

import time
from typing import Any

from hf_dist.tracing.allocations import AllocationLog
from hf_dist.tracing.result import TERM_ORDER, TERMS, TraceTimeout


def new_tracker(
    model: Any, optimizer: Any, deadline: float, log: AllocationLog | None = None, grad_hooks: bool = True
) -> Any:
    """The tracker for the model, stopping at ``deadline`` (checked at every operator, so a trace never hangs),
    writing every storage it sees made or freed to ``log`` in order. ``grad_hooks=False``: a parameter's ``.grad``
    is not counted as a gradient (DeepSpeed copies each into its reduce bucket and points ``.grad`` into it; the
    engine's own gradient buffers are labelled instead)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    fsdp = isinstance(model, FSDPModule)
    settings = {"deadline": deadline, "log": log, "grad_hooks": grad_hooks, "skipped": inplace_fused_optimizer_ops()}
    cls = type("Tracker", (_Tracking, FSDPMemTracker if fsdp else MemTracker), {"_hf_dist": settings})
    tracked = cls(model, optimizer) if fsdp else cls()
    if not fsdp:
        tracked.track_external(model, optimizer)
    return tracked


class _Tracking:
    """What a trace adds to torch's tracker (the class it is mixed into): the deadline, the allocation log, frozen
    parameters, the global peak only, FSDP2 units reached in backward alone, and labels for the engine's tensors.
    ``_hf_dist``: the settings :func:`new_tracker` gives the class."""

    _hf_dist: dict[str, Any]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if time.monotonic() > self._hf_dist["deadline"]:
            raise TraceTimeout("time limit")
        if func in self._hf_dist["skipped"]:
            # the fused kernel updates in place and allocates nothing on the device; fake mode's kernel builds
            # out-of-place copies of every state instead (19.5 GiB on a 1B model), and fake values never matter
            return None
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        # MemTracker hooks every parameter's gradient, which fails on frozen ones (a LoRA base)
        from torch.distributed._tools.mem_tracker import _MemRefType

        params = buffers = 0
        for param in module.parameters():
            params += sum(w.mem_consumed for w in self._update_and_maybe_create_winfos(param, _MemRefType.PARAM))
            if param.grad is not None:
                self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)
            hook = install_grad_hooks and self._hf_dist["grad_hooks"] and param.requires_grad
            if hook and param not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(self._grad_hook),
                    param.register_post_accumulate_grad_hook(lambda p: self._grad_hook(p.grad)),
                )
        for buffer in module.buffers():
            buffers += sum(w.mem_consumed for w in self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER))
        return params, buffers

    def _update_peak_stats(self, peak_state):
        # only the global peak: MemTracker also keeps every module's own peak, walking all modules at every
        # operator (O(operators x modules): 52 s instead of 10 s for a 1B LoRA model), which the trace never reads
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap["Total"]:
                self._peak_mem[device] = snap["Total"]
                self._peak_mem_snap[device] = dict(snap)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        log = self._hf_dist["log"]
        if log is not None:
            log.record(u_type, winfo, getattr(winfo.reftype, "value", None) in ("Optstate", "OptState"))
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def _grad_hook(self, grad):
        from torch.distributed._tools.mem_tracker import _MemRefType

        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
        return _with_stats(self, fsdp_mod, super()._fsdp_param_group_pre_backward(fsdp_mod, orig))

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
        return _with_stats(self, fsdp_mod, super()._fsdp_param_group_post_backward(fsdp_mod, orig))

    def label(self, tensors, category: str) -> None:
        """Count the storages of ``tensors`` under ``category`` (a ``_MemRefType`` name) from now on."""
        from torch.distributed._tools.mem_tracker import _MemRefType

        reftype = _MemRefType[category]
        for tensor in tensors:
            if tensor.untyped_storage().nbytes():
                self._update_and_maybe_create_winfos(tensor, reftype)

    def relabel(self, old: str, new: str) -> None:
        """Every storage counted under ``old`` counts under ``new`` from now on."""
        from torch.distributed._tools.mem_tracker import _MemRefType, _UpdateType

        old_type, new_type = _MemRefType[old], _MemRefType[new]
        for winfo, _ in list(self._WINFO.values()):
            if winfo.reftype == old_type:
                winfo.reftype = new_type
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old_type)

    def live(self) -> list:
        """The tracker's record of every storage alive now."""
        return [winfo for winfo, _ in list(self._WINFO.values())]


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


def inplace_fused_optimizer_ops() -> frozenset:
    import torch

    ops = []
    for name in ("_fused_adamw_", "_fused_adam_", "_fused_sgd_", "_fused_adagrad_"):
        packet = getattr(torch.ops.aten, name, None)
        ops += [getattr(packet, overload) for overload in (packet.overloads() if packet else ())]
    return frozenset(ops)


def snapshot(tracker: Any, kind: str) -> dict[str, int]:
    snap = tracker.get_tracker_snapshot(kind)
    merged: dict[str, int] = {}
    for device, per_device in snap.items():
        if getattr(device, "type", device) == "meta":  # shape bookkeeping of TP styles, never allocated
            continue
        for key, value in per_device.items():
            name = getattr(key, "value", key)
            merged[name] = merged.get(name, 0) + int(value)
    return merged


def as_terms(categories: dict[str, int]) -> dict[str, int]:
    out = dict.fromkeys(TERM_ORDER, 0)
    for name, value in categories.items():
        if name in TERMS:
            out[TERMS[name]] += value
    return out
