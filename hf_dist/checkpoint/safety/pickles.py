"""Load training-checkpoint pickles without executing foreign code.

Every ``.pt``/``.bin`` file goes through ``torch.load(weights_only=True, mmap=True)``. The few
non-tensor classes DeepSpeed writes into its checkpoints are mapped to inert stand-ins (found by
listing the GLOBAL opcodes of real ZeRO-1/2/3 checkpoints from deepspeed 0.19), so reading them
needs neither deepspeed installed nor trust in the file. Anything else is refused with the file
and the type named, unless the caller passes ``trust_pickles=True``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.safety.dcp_metadata import DCP_MODULES, DCP_NAMES, OTHER_GLOBALS, byte_payloads
from hf_dist.checkpoint.safety.errors import CorruptCheckpointError, OpaqueObject, UnsafePickleError


class LossScalerStub(OpaqueObject):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler."""


class FragmentAddressStub(OpaqueObject):
    """deepspeed.utils.tensor_fragment.fragment_address (a dataclass of numel/start)."""


class ZeroStageStub(int):
    """deepspeed.runtime.zero.config.ZeroStageEnum: an IntEnum pickled as ``ZeroStageEnum(stage)``."""


# (stand-in, dotted name as written in the pickle)
DEEPSPEED_GLOBALS: list[tuple[Any, str]] = [
    (ZeroStageStub, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScalerStub, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerStub, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddressStub, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def safe_load(path: str | os.PathLike, *, trust_pickles: bool = False, mmap: bool = True, meta: bool = False) -> Any:
    """``torch.load`` one file on CPU with the allowlist; mmap so tensors are paged in only when sliced.

    ``meta=True`` reads no tensor data: tensors come back on the meta device, each storage carrying
    ``_checkpoint_offset``, the byte offset of its data in the file.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    if path.stat().st_size == 0:
        raise CorruptCheckpointError(f"checkpoint file {path} is empty (0 bytes); the save was interrupted")
    try:
        if not trust_pickles:
            with open(path, "rb") as handle:
                _check_container(handle, path)
        where = {"map_location": "meta"} if meta else {"map_location": "cpu", "mmap": mmap}
        if trust_pickles:
            return torch.load(path, weights_only=False, **where)
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
            return torch.load(path, weights_only=True, **where)
    except UnsafePickleError:
        raise
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Unsupported global" in str(exc) or "allowlisted" in str(exc):
            raise UnsafePickleError(
                f"refusing to unpickle {path}: {_first_line_naming_type(str(exc))}. Only tensors, containers and "
                "DeepSpeed's checkpoint metadata types are allowed; pass --trust-pickles (trust_pickles=True) "
                "only if you trust this file"
            ) from None
        raise CorruptCheckpointError(f"cannot read checkpoint file {path}: {exc}") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        raise CorruptCheckpointError(
            f"cannot read checkpoint file {path} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "it is truncated or corrupt, re-copy it or convert an earlier checkpoint"
        ) from None


def _first_line_naming_type(message: str) -> str:
    match = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"(?:got|function) (<class '[^']+'>|\S+)", message)
    return f"it contains the type {match.group(1)}" if match else message.strip().splitlines()[-1][:200]


# ---------------------------------------------------------------- the loading gate
#
# Libraries we hand checkpoints to unpickle some files with ``weights_only=False`` (DeepSpeed's engine and
# ds_to_universal) or plain ``pickle.load`` (DCP's FileSystemReader for ``.metadata``). ``check_pickles`` runs
# every pickle of a checkpoint through an unpickler that resolves each global against the allowlist and
# replaces it by an inert record, so nothing in the file is ever called; a file naming anything else is refused
# before any library opens it.

# A file is a pickle when its name ends like this (safetensors are not; a .distcp file holds tensors, which DCP loads
# with weights_only=True, and torch.save archives of non-tensor values, which it loads with weights_only=False:
# those are checked through the .metadata that lists them).
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
PICKLE_NAMES = (".metadata",)
# What the Trainer pickles besides tensors: rng_state*.pth holds numpy's RNG state, training_args.bin the
# TrainingArguments object (found by listing the globals of files written by transformers 5 / accelerate 1).
TRAINER_GLOBALS = {
    "numpy.dtype", "numpy.ndarray", "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
    "transformers.training_args.TrainingArguments", "transformers.training_args_seq2seq.Seq2SeqTrainingArguments",
    "transformers.trainer_pt_utils.AcceleratorConfig", "accelerate.state.PartialState",
    "accelerate.utils.dataclasses.DistributedType", "torch.device",
}  # fmt: skip
# Classes of these packages (TrainingArguments' enums, accelerate's DeepSpeedPlugin/FSDP plugin dataclasses, the
# Trainer's HfTrainerDeepSpeedConfig, all pickled inside training_args.bin) are allowed by kind: classes only,
# never functions, and the gate itself only ever builds inert records.
_ENUM_PACKAGES = ("transformers.", "accelerate.", "trl.", "peft.")


def is_pickle_file(path: Path) -> bool:
    """True for the files of a checkpoint that a library may unpickle."""
    return path.name in PICKLE_NAMES or path.suffix in PICKLE_SUFFIXES


def check_pickles(path: str | os.PathLike, *, trust_pickles: bool = False) -> list[Path]:
    """The loading gate: refuse ``path`` (a checkpoint folder or one file) if any pickle in it names a foreign type.

    Every pickle file (see :func:`is_pickle_file`) is unpickled with each global mapped to an inert record: no
    tensor data is read and no code from the file runs. Raises :class:`UnsafePickleError` naming the file and
    the type, :class:`CorruptCheckpointError` for a file that is not a pickle. Returns the files checked.
    ``trust_pickles=True`` checks nothing.
    """
    path = Path(path)
    if trust_pickles:
        return []
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and is_pickle_file(p))
    for file in files:
        _check_pickle_file(file)
    return files


def _check_pickle_file(path: Path, region: tuple[int, int] | None = None) -> None:
    """Check one file, or with ``region`` (offset, length) one ``torch.save`` archive inside it (a DCP payload)."""
    where = "" if region is None else f" at byte {region[0]}"
    try:
        with open(path, "rb") as handle:
            if region is not None:
                handle.seek(region[0])
                handle = io.BytesIO(handle.read(region[1]))
            _check_stream(handle, path)
        if region is None and path.name in PICKLE_NAMES:
            _check_dcp_payloads(path.parent)
    except UnsafePickleError:
        raise
    except Exception as exc:  # anything else the bytes make pickle raise: not a readable checkpoint file
        if path.stat().st_size == 0:
            raise CorruptCheckpointError(
                f"checkpoint file {path} is empty (0 bytes); the save was interrupted"
            ) from None
        raise CorruptCheckpointError(
            f"cannot read checkpoint file {path}{where} ({type(exc).__name__}: {str(exc)[:200]}); it is truncated, "
            "corrupt or not a checkpoint file; re-copy it or remove it"
        ) from None


def _check_stream(handle: Any, path: Path) -> None:
    """Check what ``torch.load(..., weights_only=False)`` would unpickle from ``handle``."""
    if _check_container(handle, path) == "zip":  # torch.save's format: the pickle is <archive>/data.pkl
        with zipfile.ZipFile(handle) as archive:
            for entry in archive.infolist():  # every entry, duplicates included: the loader may pick any
                if entry.filename.endswith(".pkl"):
                    with archive.open(entry) as member:
                        _CheckingUnpickler(member, path).load()
        return
    # a plain pickle (.metadata), or torch's legacy format: five pickles, then raw storage bytes
    for index in range(5):
        try:
            _CheckingUnpickler(handle, path).load()
        except EOFError:
            if index == 0:
                raise
            return


def _check_container(handle: Any, path: Path) -> str:
    """``"zip"`` or ``"stream"``, decided the way ``torch.load`` dispatches (``torch/serialization.py``: ``load``,
    ``_legacy_load``); a TorchScript archive and the legacy tar format, which it loads by running code or
    unpickling with no allowlist, are refused. Reads no pickle; leaves ``handle`` at its start."""
    is_zip = handle.read(4) == b"PK\x03\x04"  # torch's _is_zipfile: only the first bytes count
    handle.seek(0)
    if is_zip:
        with zipfile.ZipFile(handle) as archive:
            torchscript = any(name.rsplit("/", 1)[-1] == "constants.pkl" for name in archive.namelist())
        handle.seek(0)
        if torchscript:  # torch's _is_torchscript_zip
            _refuse_format(path, "a TorchScript archive (torch.load hands it to torch.jit.load, which runs its code)")
        return "zip"
    if _is_tar(handle):
        _refuse_format(
            path, "in torch's legacy tar format (torch < 0.4), which torch.load unpickles with no allowlist"
        )
    return "stream"


def _is_tar(handle: Any) -> bool:
    """torch's own test (``_legacy_load``): a file that ``tarfile`` opens is loaded as the legacy tar format."""
    import tarfile

    try:
        with tarfile.open(fileobj=handle, mode="r:", format=tarfile.PAX_FORMAT):
            return True
    except tarfile.TarError:
        return False
    finally:
        handle.seek(0)


def _refuse_format(path: Path, what: str) -> None:
    raise UnsafePickleError(
        f"refusing to load {path}:\n"
        f"  it is {what};\n"
        "  no training checkpoint is written that way and the loading gate cannot check it, so nothing was loaded.\n"
        "  Remove the file, or pass --trust-pickles (trust_pickles=True) only if you trust it"
    )


def _check_dcp_payloads(folder: Path) -> None:
    """The non-tensor values DCP stored in the ``.distcp`` files of ``folder`` (it unpickles them with
    ``weights_only=False``), each checked like a file of its own."""
    for name, file, offset, length, transformed in byte_payloads(folder):
        if transformed:
            raise UnsafePickleError(
                f"refusing to load {file}:\n"
                f"  the value {name!r} at byte {offset} is stored with a transform (e.g. compression) the loading "
                "gate cannot check.\n"
                "  Pass --trust-pickles (trust_pickles=True) only if you trust this checkpoint"
            )
        _check_pickle_file(file, (offset, length))


class _Inert:
    """What every allowed global becomes while checking: accepts any construction, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


_ALLOWED: frozenset[str] | None = None


def _allowed_globals() -> frozenset[str]:
    """torch's weights_only allowlist + DEEPSPEED_GLOBALS + DCP metadata types + TRAINER_GLOBALS, as dotted names."""
    global _ALLOWED
    if _ALLOWED is None:
        import torch
        from torch import _weights_only_unpickler

        names = set(_weights_only_unpickler._get_allowed_globals())
        names |= {f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals()
                  if isinstance(g, type) or callable(g)}  # fmt: skip
        names |= {dotted for _, dotted in DEEPSPEED_GLOBALS}
        names |= {f"{module}.{name}" for module in DCP_MODULES for name in DCP_NAMES}
        names |= {f"{module}.{name}" for module, name in OTHER_GLOBALS}
        names |= TRAINER_GLOBALS
        _ALLOWED = frozenset(names)
    return _ALLOWED


def _is_allowed(module: str, name: str) -> bool:
    import torch

    if f"{module}.{name}" in _allowed_globals():
        return True
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return True
    if module.startswith(_ENUM_PACKAGES) and name.isidentifier():
        import enum
        import importlib
        import importlib.util

        try:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                return False
            obj = getattr(importlib.import_module(module), name, None)
        except Exception:  # a module that does not import holds no allowed type
            return False
        return isinstance(obj, type) and (issubclass(obj, enum.Enum) or obj.__module__.startswith(_ENUM_PACKAGES))
    return False


class _CheckingUnpickler(pickle.Unpickler):
    """Every global checked by :func:`_is_allowed` and replaced by :class:`_Inert`; persistent ids ignored."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _is_allowed(module, name):
            raise UnsafePickleError(
                f"refusing to load {self.path}:\n"
                f"  it contains the type {module}.{name}, which is not a tensor, a container or a checkpoint "
                "metadata type (DeepSpeed, DCP, Trainer); nothing was loaded.\n"
                "  Remove the file, or pass --trust-pickles (trust_pickles=True) only if you trust it"
            )
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        return None
