"""The Trainer's own checkpoint, written in the background: its files are staged to host memory, then a thread writes.

The HF Trainer saves synchronously: every rank waits while ``checkpoint-N/`` reaches the disk. ``BackgroundWriter``
keeps the Trainer's code and layout and moves only the writes off the training thread. Inside
:meth:`BackgroundWriter.intercept` (hf_dist wraps ``Trainer._save_checkpoint`` with it,
:class:`hf_dist.callbacks.resume.AsyncCheckpointCallback`), the three writers the Trainer and accelerate call
stage their input and return at once:

- ``torch.distributed.checkpoint.save`` (accelerate's FSDP2 ``pytorch_model_fsdp_0/`` and ``optimizer_0/``): the
  state dict is staged (DCP's ``StateDictStager``: a host copy of every local shard, buffers reused from save to
  save, pinned on CUDA) and ``dcp.save`` runs on the writer thread over a gloo group of its own, as DCP's
  ``async_save`` does;
- ``torch.save`` to a path (``optimizer.pt``, ``scheduler.pt``, ``rng_state_R.pth``, ``training_args.bin``): staged,
  then written;
- safetensors' ``save_file`` as ``save_pretrained`` calls it (``model.safetensors``): staged, then written.

What stays synchronous: staging itself (a copy to host memory: the stall left), the small files written by other
means (``config.json``, ``generation_config.json``, ``trainer_state.json``, tokenizer files), and
DeepSpeed, whose engine writes its checkpoint itself (``engine.save_checkpoint``). Every file is written to a
temporary name and renamed when whole; one writer thread runs the writes in the order they were made, so DCP's
collectives match on every rank. The caller waits for one save before starting the next (staging buffers are
reused) and marks the checkpoint complete only when every rank's writes finished (:func:`all_ranks_done`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hf_dist.atomic_io import atomic_path
from hf_dist.planning.dtypes import GIB
from hf_dist.runtime import dist as _dist

logger = logging.getLogger(__name__)


class AsyncSaveError(RuntimeError):
    """A background write of a checkpoint failed on some rank; the checkpoint stays unmarked."""


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors (local shards of DTensors) in a nested dict / list / tuple."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class BackgroundWriter:
    """Stages what the Trainer saves and writes it on one background thread; see the module docstring.

    Create it on every rank at the same point (it makes a gloo group, a collective); :meth:`close` at the end.
    """

    def __init__(self) -> None:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        self._stager = StateDictStager(pin_memory=torch.cuda.is_available())
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hf_dist-checkpoint-writer", initializer=_lowest_cpu_priority
        )
        self._futures: list[Future] = []
        self._owner = threading.get_ident()
        self.staged_bytes = 0  # of the save under way (host memory held by the stager)
        # DCP's own collectives run on the writer thread: they need a group the training thread never uses.
        self._group = None
        if _dist.is_distributed():
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")

    # ---- the writers the Trainer calls, replaced inside intercept() ----

    @contextlib.contextmanager
    def intercept(self) -> Iterator[None]:
        """Within the block, the training thread's checkpoint writes are staged and queued (module docstring)."""
        import safetensors.torch
        import torch.distributed.checkpoint as dcp
        import transformers.modeling_utils as modeling_utils

        originals = {
            (dcp, "save"): dcp.save,
            (torch, "save"): torch.save,
            (modeling_utils, "safe_save_file"): modeling_utils.safe_save_file,
        }
        queued = {
            (dcp, "save"): self._queue_dcp(dcp.save),
            (torch, "save"): self._queue_file(torch.save),
            (modeling_utils, "safe_save_file"): self._queue_file(safetensors.torch.save_file),
        }
        self.staged_bytes = 0
        try:
            for (module, name), replacement in queued.items():
                setattr(module, name, replacement)
            yield
        finally:
            for (module, name), original in originals.items():
                setattr(module, name, original)

    def _on_owner_thread(self) -> bool:
        return threading.get_ident() == self._owner

    def _stage(self, obj: Any) -> Any:
        self.staged_bytes += tensor_bytes(obj)
        return self._stager.stage(obj)

    def _queue_dcp(self, save: Callable) -> Callable:
        def dcp_save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None, **kw):
            if not self._on_owner_thread():
                return save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                            process_group=process_group, **kw)  # fmt: skip
            staged = self._stage(state_dict)
            folder = Path(checkpoint_id).parent if checkpoint_id is not None else None
            self._submit(_into_existing(folder, save), staged, checkpoint_id=checkpoint_id,
                         storage_writer=storage_writer, planner=planner, process_group=self._group, **kw)  # fmt: skip
            return None

        return dcp_save

    def _queue_file(self, write: Callable) -> Callable:
        """``write(obj, path, ...)``, staged and queued when ``path`` is a file name (an open file is written now)."""

        def queued(obj, path, *args, **kwargs):
            if not self._on_owner_thread() or not isinstance(path, str | os.PathLike):
                return write(obj, path, *args, **kwargs)
            staged = self._stage(obj)
            return self._submit(_write_atomically, write, staged, Path(path), *args, **kwargs)

        return queued

    def _submit(self, fn: Callable, *args: Any, **kwargs: Any) -> Future:
        future = self._executor.submit(fn, *args, **kwargs)
        self._futures.append(future)
        return future

    def after_writes(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the writer thread once every write queued so far ended (the manifest's hashes of this
        rank's files: read back from the page cache, off the training thread); its result, or error, via the
        returned future (an error is reported by :meth:`wait` like a failed write)."""
        return self._submit(fn)

    # ---- state of the queued writes ----

    def done(self) -> bool:
        """True when every queued write ended (well or not); never blocks."""
        return all(f.done() for f in self._futures)

    def wait(self) -> str | None:
        """Wait for every queued write; the first error on this rank as text, or None. Clears the queue."""
        errors = []
        for future in self._futures:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
                errors.append(f"{type(exc).__name__}: {exc}")
        self._futures = []
        return errors[0] if errors else None

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        self._stager.close()


def _lowest_cpu_priority() -> None:
    """The writer thread yields the CPU to training wherever they compete (Linux: a thread's own nice value)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: the default priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _write_atomically(write: Callable, obj: Any, path: Path, *args: Any, **kwargs: Any) -> None:
    _check_folder(path.parent)
    with atomic_path(path, create_parent=False) as tmp:
        write(obj, str(tmp), *args, **kwargs)


def _into_existing(folder: Path | None, save: Callable) -> Callable:
    """``save`` (DCP's), run only while the checkpoint folder it writes into still exists."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if folder is not None:
            _check_folder(folder)
        return save(*args, **kwargs)

    return run


def _check_folder(folder: Path) -> None:
    """A checkpoint folder removed while its save was pending (by the Trainer's rotation, a user) is not recreated:
    the write fails, and the save stays without a manifest."""
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} was removed while its files were being written in the background; not recreating it "
            "(a folder rebuilt from part of a save would look like a checkpoint)"
        )


def all_ranks_done(writer: BackgroundWriter, *, block: bool) -> tuple[bool, list[str]]:
    """Collective: whether every rank's queued writes ended, and the errors of any rank ("rank R: ...").

    ``block=False`` asks without waiting (one small all-gather); ``block=True`` waits for this rank's writes first.
    When every rank is done, each one's queue is cleared and its errors are gathered.
    """
    local_done = True if block else writer.done()
    error = writer.wait() if block else None
    done = all(bool(flag) for (flag,) in _dist.gather_floats([float(local_done)]))
    if not done:
        return False, []
    if not block:
        error = writer.wait()  # every write ended: this does not block
    errors = [f"rank {r}: {e}" for r, e in enumerate(_dist.gather_objects(error)) if e]
    return True, errors


def staging_bytes(model: Any, optimizer: Any, *, writes_weights: bool) -> int:
    """Host memory this rank's staging copy takes: the weights and optimizer state it writes.

    Before the first step the optimizer's state may not exist yet (torch creates Adam's moments lazily): it is
    then counted as the moments Adam-family optimizers create, two tensors like each trainable parameter (one
    for momentum SGD). A rank that writes no weights (DDP's ranks other than the first) stages only its RNG state.
    """
    from torch.distributed.tensor import DTensor

    params = list(model.parameters()) if model is not None else []
    sharded = any(isinstance(p, DTensor) for p in params)
    if not (writes_weights or sharded):
        return 0
    weights = sum(tensor_bytes(p) for p in params)
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    state = getattr(torch_optimizer, "state", None)
    if state:
        return weights + tensor_bytes(list(state.values()))
    moments = 1 if type(torch_optimizer).__name__ == "SGD" else 2
    return weights + moments * sum(tensor_bytes(p) for p in params if p.requires_grad)


def staging_refusal(per_rank: list[tuple[str, int, int]]) -> str | None:
    """Why the staging copies do not fit, or None. ``per_rank``: (host, staging bytes, host's available bytes)."""
    hosts: dict[str, tuple[int, int, list[int]]] = {}
    for rank, (host, need, available) in enumerate(per_rank):
        total, _, ranks = hosts.get(host, (0, available, []))
        hosts[host] = (total + need, available, [*ranks, rank])
    for host, (need, available, ranks) in sorted(hosts.items()):
        if need > available:
            return (
                f"async_save stages each checkpoint in host memory before writing it: {need / GIB:.2f} GiB on host "
                f"{host} (ranks {', '.join(map(str, ranks))}: their weights and optimizer state), but only "
                f"{available / GIB:.2f} GiB is available there.\n"
                "Train without async_save (synchronous saves need no staging copy), or free host memory"
            )
    return None


def check_staging_fits(model: Any, optimizer: Any, *, writes_weights: bool) -> int:
    """Collective: refuse (ValueError on every rank) when some node's staging copies exceed its available memory;
    returns this rank's staging bytes."""
    import socket

    import psutil  # accelerate's dependency

    need = staging_bytes(model, optimizer, writes_weights=writes_weights)
    per_rank = _dist.gather_objects((socket.gethostname(), need, psutil.virtual_memory().available))
    refusal = staging_refusal(per_rank)
    if refusal:
        raise ValueError(refusal)
    return need
