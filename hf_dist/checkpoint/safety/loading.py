"""Every unpickle hf_dist performs or drives is torch's own ``weights_only`` unpickler: the check is the load.

A checkpoint file is only ever unpickled by ``torch.load(weights_only=True)`` with the allowlist below
(``torch.serialization.safe_globals``): tensors, containers and the few non-tensor types the libraries write. A
global outside it is refused by torch's parser while it parses, so there is no second parser to disagree with (a
zip read two ways, a legacy tar or TorchScript archive: torch refuses those under ``weights_only`` itself).

- :func:`safe_load`: hf_dist's own reads (``convert``, ``verify``, the ZeRO-Infinity repair).
- :func:`guarded_loads`: while hf_dist drives a library over a checkpoint (DeepSpeed's ``load_checkpoint`` and
  ``ds_to_universal``, accelerate's FSDP/DCP loads, the Trainer's resume files, DCP's byte payloads), every
  ``torch.load`` it makes, ``weights_only=False`` included, is redirected to the same safe load, every file it
  opens must resolve inside the checkpoint (:mod:`hf_dist.checkpoint.safety.paths`), and DCP's ``.metadata``
  (a protocol-4 pickle that torch's unpickler does not parse) is read by the one restricted unpickler of
  :mod:`hf_dist.checkpoint.safety.dcp_metadata` instead of ``pickle.load``.
- :func:`check_loadable`: the same load, earlier (``auto_resume``, ``reshard``): a refusal before a Trainer is built.

The allowlist was found by listing the globals of the files each library writes (torch 2.13, transformers 5.x,
accelerate 1.10-1.15, DeepSpeed 0.17-0.19; ``tests/unit/checkpoint/safety/test_loading.py`` loads such files):
numpy's RNG state (the Trainer's ``rng_state_R.pth``) and four DeepSpeed types (ZeRO stage, loss scalers, the
bf16 optimizer's fragment addresses). hf_dist's readers get inert stand-ins for the DeepSpeed types, so reading a
checkpoint needs neither DeepSpeed nor trust; a library load gets the real classes, which it uses.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.safety.errors import CorruptCheckpointError, OpaqueObject, UnsafePickleError
from hf_dist.checkpoint.safety.paths import PathEscapeError, check_tree_confined, confined

__all__ = [
    "CorruptCheckpointError",
    "PathEscapeError",
    "UnsafePickleError",
    "check_loadable",
    "guarded_loads",
    "safe_load",
]


class LossScalerStub(OpaqueObject):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler."""


class FragmentAddressStub(OpaqueObject):
    """deepspeed.utils.tensor_fragment.fragment_address (a dataclass of numel/start)."""


class ZeroStageStub(int):
    """deepspeed.runtime.zero.config.ZeroStageEnum: an IntEnum pickled as ``ZeroStageEnum(stage)``."""


# (stand-in, dotted name as written in the pickle): the DeepSpeed types found in ZeRO-1/2/3 checkpoints
DEEPSPEED_GLOBALS: list[tuple[Any, str]] = [
    (ZeroStageStub, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScalerStub, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerStub, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddressStub, "deepspeed.utils.tensor_fragment.fragment_address"),
]
# Files a checkpoint may hold that some loader unpickles (safetensors are not pickles). training_args.bin is not
# among them: no resume path reads it (it holds a whole TrainingArguments object, which no allowlist admits).
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
NEVER_LOADED = ("training_args.bin",)
TRUST_HINT = "pass --trust-pickles (trust_pickles=True) only if you trust this file"


def numpy_globals() -> list[Any]:
    """numpy's RNG state as the Trainer pickles it (``rng_state_R.pth``), under numpy 2's and numpy 1's names."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def deepspeed_globals(*, real: bool) -> list[Any]:
    """DeepSpeed's checkpoint types: the real classes for DeepSpeed's own loads, else the inert stand-ins."""
    if not real:
        return list(DEEPSPEED_GLOBALS)
    import importlib

    found = []
    for _, dotted in DEEPSPEED_GLOBALS:
        module, name = dotted.rsplit(".", 1)
        found.append(getattr(importlib.import_module(module), name))
    return found


def allowlist(*, library: bool) -> list[Any]:
    """What ``torch.load`` admits beyond torch's own weights-only set; ``library``: a library's load is driven
    (real DeepSpeed classes, once DeepSpeed is imported), else hf_dist's own read (stand-ins)."""
    return numpy_globals() + deepspeed_globals(real=library and "deepspeed" in sys.modules)


# ---------------------------------------------------------------- hf_dist's own loads


def safe_load(
    path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    trust_pickles: bool = False,
    mmap: bool = True,
    meta: bool = False,
) -> Any:
    """``torch.load`` one file on CPU, ``weights_only`` with the allowlist; mmap so tensors page in when sliced.

    ``root``: the checkpoint the file belongs to; a file resolving outside it is refused. ``meta=True`` reads no
    tensor data: tensors come back on the meta device, each storage carrying ``_checkpoint_offset``.
    """
    import torch

    path = Path(path)
    if root is not None:
        confined(path, root)
    _check_file(path)
    where = {"map_location": "meta"} if meta else {"map_location": "cpu", "mmap": mmap and _is_zip(path)}
    if trust_pickles:
        return _original_load()(path, weights_only=False, **where)
    with _translated_errors(path), torch.serialization.safe_globals(allowlist(library=False)):
        return _original_load()(path, weights_only=True, **where)


def check_loadable(root: str | os.PathLike, *, trust_pickles: bool = False) -> list[Path]:
    """Every file of checkpoint ``root`` that a resume unpickles, loaded now exactly as it will be (tensors on the
    meta device, nothing read but the pickles), and every link under it confined: the refusal comes before a
    Trainer is built. Returns the files loaded. Safety does not rest on it: :func:`guarded_loads` loads them."""
    root = Path(root)
    _check_confined(root)
    if trust_pickles:
        return []
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if _unpickled_on_resume(p))
    for file in files:
        safe_load(file, meta=True)
    for metadata in sorted(root.rglob(".metadata")) if root.is_dir() else []:
        _load_dcp_values(metadata.parent)
    return files


def _load_dcp_values(folder: Path) -> None:
    """DCP's metadata and its non-tensor values, loaded as a ``dcp.load`` under the guard loads them."""
    import io

    import torch

    from hf_dist.checkpoint.safety.dcp_metadata import byte_payloads

    for _, file, offset, length in byte_payloads(folder):
        with open(file, "rb") as handle:
            handle.seek(offset)
            data = io.BytesIO(handle.read(length))
        source = f"a value stored in {file}"
        with _translated_errors(source), torch.serialization.safe_globals(allowlist(library=False)):
            _original_load()(data, map_location="meta", weights_only=True)


def _check_confined(root: Path) -> None:
    """No link under ``root`` leads out, and DeepSpeed's ``latest`` names a folder inside it."""
    from hf_dist.checkpoint.formats.contents import check_tags_confined

    folder = root if root.is_dir() else root.parent
    check_tree_confined(folder)
    check_tags_confined(folder)


def _unpickled_on_resume(path: Path) -> bool:
    return path.is_file() and path.suffix in PICKLE_SUFFIXES and path.name not in NEVER_LOADED


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    if path.stat().st_size == 0:
        raise CorruptCheckpointError(f"checkpoint file {path} is empty (0 bytes); the save was interrupted")


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as handle:  # torch's own dispatch: the first bytes decide (mmap needs the zip format)
        return handle.read(4) == b"PK\x03\x04"


@contextlib.contextmanager
def _translated_errors(source: Any) -> Iterator[None]:
    """torch's refusals and read errors as hf_dist's: one line naming the file and what was refused."""
    try:
        yield
    except (UnsafePickleError, PathEscapeError, CorruptCheckpointError):
        raise
    except pickle.UnpicklingError as exc:
        raise UnsafePickleError(
            f"refusing to load {source}: {_refused(str(exc))}; nothing in it ran; {TRUST_HINT}"
        ) from None
    except RuntimeError as exc:
        text = str(exc)
        if "weights_only" in text and ("TorchScript" in text or "legacy .tar" in text):
            kind = (
                "a TorchScript archive, which torch loads by running its code"
                if "TorchScript" in text
                else "in torch's legacy tar format, which torch unpickles with no allowlist"
            )
            raise UnsafePickleError(
                f"refusing to load {source}: it is {kind}; no training checkpoint is written that way; {TRUST_HINT}"
            ) from None
        raise _corrupt(source, exc) from None
    except (EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        raise _corrupt(source, exc) from None


def _refused(message: str) -> str:
    match = re.search(r"GLOBAL ([\w.]+)", message)
    if match:
        return (
            f"it names the global {match.group(1)}, which is not a tensor, a container or a checkpoint type of "
            "DeepSpeed, DCP or the Trainer"
        )
    detail = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", message, re.S)
    reason = detail.group(1).strip().splitlines()[0][:200] if detail else "unreadable"
    return f"torch's weights-only unpickler refused it ({reason}; not a file torch.save writes)"


def _corrupt(source: Any, exc: BaseException) -> CorruptCheckpointError:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return CorruptCheckpointError(
        f"cannot read checkpoint file {source} ({type(exc).__name__}: {text}); it is truncated or corrupt, re-copy "
        "it or use an earlier checkpoint"
    )


# ---------------------------------------------------------------- the loads hf_dist drives


class _Guard:
    def __init__(self, root: Path, trust_pickles: bool) -> None:
        self.root, self.trust_pickles = root, trust_pickles
        # threads already running at entry, but its own: not hf_dist's loads (a thread started later is guarded)
        self.bystanders = frozenset(threading.enumerate()) - {threading.current_thread()}
        self.reading: str | None = None  # the DCP file being read (its payloads arrive as bytes)
        self.refusals: list[BaseException] = []  # what this guard refused, whatever the library made of it


# hf_dist's own one-line refusals (a payload, a path leading out, a corrupt or crafted file): raised as themselves
_REFUSALS = (UnsafePickleError, PathEscapeError, CorruptCheckpointError)


@contextlib.contextmanager
def _recorded(guard: _Guard) -> Iterator[None]:
    """A refusal raised inside a library is remembered: DCP turns it into the text of an AssertionError."""
    try:
        yield
    except _REFUSALS as exc:
        guard.refusals.append(exc)
        raise


_STACK: list[_Guard] = []
_LOCK = threading.RLock()
_SAVED: dict[str, Any] = {}


def _original_load() -> Any:
    import torch

    return _SAVED.get("torch.load", torch.load)


@contextlib.contextmanager
def guarded_loads(root: str | os.PathLike, *, trust_pickles: bool = False) -> Iterator[None]:
    """While active, every ``torch.load`` of any library is ``weights_only`` with the allowlist and must read
    inside ``root``; DCP reads ``.metadata`` with hf_dist's restricted unpickler and opens files inside ``root``
    only. Links under ``root`` are checked on entry. ``trust_pickles`` keeps the library's own ``weights_only``
    (paths stay confined). Nests; the innermost root applies. It applies to the thread that enters it and to threads
    started while it is active; threads already running (a data loader's, the user's) load as without it."""
    root = Path(root)
    _check_confined(root)
    guard = _Guard(root, trust_pickles)
    with _LOCK:
        if not _STACK:
            _install()
        _STACK.append(guard)
    try:
        yield
    except BaseException as exc:
        if guard.refusals and exc is not guard.refusals[0]:
            raise guard.refusals[0].with_traceback(None) from None
        _raise_refusal_in(exc)
        raise
    finally:
        with _LOCK:
            _STACK.remove(guard)  # another thread's guard may have been entered after this one
            if not _STACK:
                _uninstall()


def _raise_refusal_in(exc: BaseException) -> None:
    """A library that wraps errors (DCP's ``CheckpointException``, a ``RuntimeError`` around the cause) must not
    bury a refusal: the first :data:`_REFUSALS` inside ``exc`` is raised."""
    seen: set[int] = set()
    pending: list[Any] = [exc]
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, _REFUSALS):
            if item is not exc:
                raise item.with_traceback(None) from None
            return
        failures = getattr(item, "failures", None)  # DCP: rank -> (exception, traceback)
        if isinstance(failures, dict):
            pending += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        pending += [getattr(item, "__cause__", None), getattr(item, "__context__", None)]


def guarded_pool(executor_class: Any, root: Path, trust_pickles: bool) -> Any:
    """``executor_class`` (a ``ProcessPoolExecutor``) whose worker processes each run under :func:`guarded_loads`:
    a library's workers load too (DeepSpeed's ``ds_to_universal``), and a spawned worker inherits no patch."""

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["initializer"], kwargs["initargs"] = _enter_in_worker, (str(root), trust_pickles)
        return executor_class(*args, **kwargs)

    return make


_WORKER_GUARD: list[Any] = []  # held, so the worker's guard is not closed when collected


def _enter_in_worker(root: str, trust_pickles: bool) -> None:
    guard = guarded_loads(root, trust_pickles=trust_pickles)
    guard.__enter__()  # for the worker's whole life
    _WORKER_GUARD.append(guard)


def active_root() -> Path | None:
    """The checkpoint the innermost :func:`guarded_loads` confines this thread's loads to, or None outside one."""
    guard = _current_guard()
    return guard.root if guard is not None else None


def _current_guard() -> _Guard | None:
    """The innermost guard that applies to this thread (not one it was a bystander of), or None."""
    thread = threading.current_thread()
    return next((guard for guard in reversed(_STACK[:]) if thread not in guard.bystanders), None)


def _install() -> None:
    import torch
    import torch.serialization

    _SAVED["torch.load"] = torch.load
    torch.load = torch.serialization.load = _redirected_load
    if "torch.distributed.checkpoint" in sys.modules or _has_dcp():
        from torch.distributed.checkpoint import filesystem

        _SAVED["read_metadata"] = filesystem.FileSystemReader.read_metadata
        _SAVED["create_stream"] = filesystem.FileSystem.create_stream
        filesystem.FileSystemReader.read_metadata = _read_metadata
        filesystem.FileSystem.create_stream = _create_stream


def _uninstall() -> None:
    import torch
    import torch.serialization

    torch.load = torch.serialization.load = _SAVED.pop("torch.load")
    if "read_metadata" in _SAVED:
        from torch.distributed.checkpoint import filesystem

        filesystem.FileSystemReader.read_metadata = _SAVED.pop("read_metadata")
        filesystem.FileSystem.create_stream = _SAVED.pop("create_stream")


def _has_dcp() -> bool:
    import torch.distributed

    return torch.distributed.is_available()


def _redirected_load(f: Any, map_location: Any = None, pickle_module: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` under :func:`guarded_loads`: confined, and ``weights_only`` unless the user trusts the file."""
    import torch

    guard = _current_guard()
    load = _original_load()
    if guard is None:
        return load(f, map_location, pickle_module, **kwargs)
    map_location = _without_cpu_index(map_location)
    with _recorded(guard):
        source = _source_of(f, guard)
        if guard.trust_pickles:
            return load(f, map_location, pickle_module, **kwargs)
        kwargs["weights_only"] = True  # pickle_module is dropped: torch refuses one beside weights_only
        with _translated_errors(source), torch.serialization.safe_globals(allowlist(library=True)):
            return load(f, map_location, **kwargs)


def _without_cpu_index(map_location: Any) -> Any:
    """``cpu:0`` as ``cpu``: transformers 5.0 loads a multi-rank resume's ``optimizer.pt`` to ``args.device``, which is
    ``cpu:0`` on CPU ranks launched without ``use_cpu``, and torch cannot restore storages there ("don't know how to
    restore data location"); the CPU has one memory."""
    import torch

    plain = isinstance(map_location, (str, torch.device)) and str(map_location).startswith("cpu:")
    return "cpu" if plain else map_location


def _source_of(f: Any, guard: _Guard) -> str:
    """What ``f`` is read from, confined to the guard's root: a path, an open file's name, or the DCP file whose
    bytes these are."""
    name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
    if isinstance(name, (str, bytes)) and not isinstance(f, int):
        name = os.fsdecode(name)
        confined(name, guard.root)
        return name
    return f"a value stored in {guard.reading}" if guard.reading else f"a value read from {guard.root}"


def _read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``FileSystemReader.read_metadata`` under :func:`guarded_loads`: the restricted unpickler, paths confined."""
    from hf_dist.checkpoint.safety.dcp_metadata import read_reader_metadata

    guard = _current_guard()
    if guard is None:
        return _SAVED["read_metadata"](self, *args, **kwargs)
    with _recorded(guard):
        return read_reader_metadata(self, guard.root, trust_pickles=guard.trust_pickles, rank=kwargs.get("rank"))


def _create_stream(self: Any, path: Any, mode: str) -> Any:
    guard = _current_guard()
    if guard is not None and "r" in mode:
        with _recorded(guard):
            confined(path, guard.root)
        guard.reading = os.fspath(path)
    return _SAVED["create_stream"](self, path, mode)
