"""Load training-checkpoint pickles without executing foreign code.

Every ``.pt``/``.bin`` file goes through ``torch.load(weights_only=True, mmap=True)``. The few
non-tensor classes DeepSpeed writes into its checkpoints are mapped to inert stand-ins (found by
listing the GLOBAL opcodes of real ZeRO-1/2/3 checkpoints from deepspeed 0.19), so reading them
needs neither deepspeed installed nor trust in the file. Anything else is refused with the file
and the type named, unless the caller passes ``trust_pickles=True``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any


class OpaqueObject:
    """Stand-in for a class we never need to behave: keeps the pickled attributes, runs no code."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__!r})"


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


class UnsafePickleError(RuntimeError):
    """A checkpoint file holds a type outside the allowlist."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file cannot be read (truncated, not a torch archive)."""


def safe_load(path: str | os.PathLike, *, trust_pickles: bool = False, mmap: bool = True, meta: bool = False) -> Any:
    """``torch.load`` one file on CPU with the allowlist; mmap so tensors are paged in only when sliced.

    ``meta=True`` reads no tensor data: tensors come back on the meta device, each storage carrying
    ``_checkpoint_offset``, the byte offset of its data in the file.
    """
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    if path.stat().st_size == 0:
        raise CorruptCheckpointError(f"checkpoint file {path} is empty (0 bytes); the save was interrupted")
    try:
        where = {"map_location": "meta"} if meta else {"map_location": "cpu", "mmap": mmap}
        if trust_pickles:
            return torch.load(path, weights_only=False, **where)
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
            return torch.load(path, weights_only=True, **where)
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Unsupported global" in str(exc) or "allowlisted" in str(exc):
            raise UnsafePickleError(
                f"refusing to unpickle {path}: {_first_line_naming_type(str(exc))}. Only tensors, containers and "
                "DeepSpeed's checkpoint metadata types are allowed; pass --trust-pickles (trust_pickles=True) "
                "only if you trust this file"
            ) from None
        raise CorruptCheckpointError(f"cannot read checkpoint file {path}: {exc}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"cannot read checkpoint file {path} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "it is truncated or corrupt, re-copy it or convert an earlier checkpoint"
        ) from None


def _first_line_naming_type(message: str) -> str:
    match = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"(?:got|function) (<class '[^']+'>|\S+)", message)
    return f"it contains the type {match.group(1)}" if match else message.strip().splitlines()[-1][:200]
