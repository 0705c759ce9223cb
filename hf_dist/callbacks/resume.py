"""Complete-checkpoint markers and ``auto_resume``: resume only from checkpoints every rank finished.

The Trainer writes ``checkpoint-N/`` from every rank without a final barrier, and rank 0 can be
done long before the others. A job killed in that window leaves a folder that looks finished
(``trainer_state.json`` is there) but lacks another rank's optimizer shard or RNG state.
``CompleteCheckpointCallback`` waits for every rank after the save and only then has rank 0
write ``hf_dist_complete.json`` (atomically) listing every file and its size.
``auto_resume(output_dir)`` returns the newest checkpoint whose marker exists and whose files
still match it, so ``trainer.train(resume_from_checkpoint=auto_resume(out))`` is always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_dist.callbacks import _dist

logger = logging.getLogger(__name__)

MARKER_NAME = "hf_dist_complete.json"
MARKER_VERSION = 1
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")

# Per-rank files a checkpoint can hold; when one rank's file of a kind exists, all ranks' must.
_RANK_PATTERNS = {
    "rng state": re.compile(r"^rng_state_(\d+)\.pth$"),
    "DeepSpeed optimizer shard": re.compile(
        r"^global_step\d+/(?:\w+_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$"
    ),
    "DeepSpeed ZeRO-3 model shard": re.compile(r"^global_step\d+/zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$"),
    "FSDP model shard": re.compile(r"^pytorch_model_fsdp_\d+/__(\d+)_\d+\.distcp$"),
    "FSDP optimizer shard": re.compile(r"^optimizer_\d+/__(\d+)_\d+\.distcp$"),
}

# Strategy name -> checkpoint layout the Trainer writes for it (and can read back).
_FAMILY = {
    "ddp": "full",
    "zero1": "zero12",
    "zero2": "zero12",
    "zero3": "zero3",
    "fsdp_full_shard": "fsdp",
    "fsdp_shard_grad_op": "fsdp",
    "hsdp": "fsdp",
}
_FAMILY_TEXT = {
    "full": "full weights + optimizer.pt (DDP)",
    "zero12": "DeepSpeed ZeRO-1/2 shards",
    "zero3": "DeepSpeed ZeRO-3 shards",
    "fsdp": "FSDP distributed checkpoint (DCP)",
}


@dataclass(frozen=True)
class CheckpointLayout:
    """What a ``checkpoint-N`` folder holds: its layout family and how many ranks wrote it."""

    family: str  # "full" | "zero12" | "zero3" | "fsdp"
    world_size: int | None  # None when the files do not tell (e.g. save_only_model)


def _relative_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MARKER_NAME)


def checkpoint_layout(checkpoint_dir: str | os.PathLike) -> CheckpointLayout:
    """Detect the layout of a Trainer checkpoint folder from its file names (no file is opened)."""
    files = _relative_files(Path(checkpoint_dir))
    ranks: dict[str, set[int]] = {}
    for kind, pattern in _RANK_PATTERNS.items():
        ranks[kind] = {int(m.group(1)) for f in files if (m := pattern.match(f))}
    if ranks["DeepSpeed ZeRO-3 model shard"]:
        family, kind = "zero3", "DeepSpeed ZeRO-3 model shard"
    elif ranks["DeepSpeed optimizer shard"]:
        family, kind = "zero12", "DeepSpeed optimizer shard"
    elif (
        ranks["FSDP model shard"]
        or ranks["FSDP optimizer shard"]
        or any(f.startswith("pytorch_model_fsdp") for f in files)
    ):
        family, kind = "fsdp", "FSDP model shard"
    else:
        family, kind = "full", "rng state"
    found = ranks[kind]
    if found:
        world = max(found) + 1
    elif family == "full" and "rng_state.pth" in files:
        world = 1
    else:
        world = None
    return CheckpointLayout(family=family, world_size=world)


def missing_rank_files(checkpoint_dir: str | os.PathLike, world_size: int) -> list[str]:
    """Per-rank files absent for some rank, e.g. ``['rng state of rank 1']``; empty when all ranks wrote."""
    files = _relative_files(Path(checkpoint_dir))
    missing = []
    for kind, pattern in _RANK_PATTERNS.items():
        found = {int(m.group(1)) for f in files if (m := pattern.match(f))}
        if found:
            missing += [f"{kind} of rank {r}" for r in range(max(world_size, max(found) + 1)) if r not in found]
    return missing


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_marker(
    checkpoint_dir: str | os.PathLike,
    *,
    world_size: int = 1,
    strategy: str | None = None,
    step: int | None = None,
    checksums: bool = False,
) -> dict:
    """Write ``hf_dist_complete.json`` atomically into ``checkpoint_dir``; call only after every rank saved.

    Raises RuntimeError (and writes nothing) when a rank's files are missing.
    """
    folder = Path(checkpoint_dir)
    missing = missing_rank_files(folder, world_size)
    if missing:
        raise RuntimeError(
            f"{folder} is not complete: missing {', '.join(missing)} (world size {world_size}); "
            "not marking it complete, so auto_resume will skip it"
        )
    entries = {}
    for rel in _relative_files(folder):
        entry: dict[str, Any] = {"size": (folder / rel).stat().st_size}
        if checksums:
            entry["sha256"] = _sha256(folder / rel)
        entries[rel] = entry
    marker = {
        "version": MARKER_VERSION,
        "step": step,
        "world_size": world_size,
        "strategy": strategy,
        "layout": checkpoint_layout(folder).family,
        "time": time.time(),
        "files": entries,
    }
    _atomic_write_json(folder / MARKER_NAME, marker)
    return marker


def _atomic_write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())  # the marker must never be on disk before its content
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def incomplete_reasons(checkpoint_dir: str | os.PathLike, *, checksums: bool = False) -> list[str]:
    """Why ``checkpoint_dir`` cannot be trusted; an empty list means it is complete."""
    folder = Path(checkpoint_dir)
    marker_path = folder / MARKER_NAME
    if not marker_path.is_file():
        return [f"no {MARKER_NAME} (the save did not finish on every rank)"]
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError) as exc:
        return [f"unreadable {MARKER_NAME}: {exc}"]
    problem = _malformed_marker(marker)
    if problem:
        return [f"malformed {MARKER_NAME}: {problem}"]
    reasons = []
    for rel, entry in marker["files"].items():
        path = folder / rel
        if not path.is_file():
            reasons.append(f"{rel} is missing")
        elif path.stat().st_size != entry["size"]:
            reasons.append(f"{rel} has {path.stat().st_size} bytes, the marker says {entry['size']}")
        elif checksums and "sha256" in entry and _sha256(path) != entry["sha256"]:
            reasons.append(f"{rel} checksum differs from the marker")
    # the marker's list is not trusted to be whole: every rank's files must be on disk
    reasons += [f"{what} is missing" for what in missing_rank_files(folder, marker.get("world_size") or 1)]
    if not marker["files"] and _relative_files(folder):
        reasons.append(f"{MARKER_NAME} lists no files but the folder holds {len(_relative_files(folder))}")
    return reasons


def _malformed_marker(marker: Any) -> str | None:
    """What is wrong with a parsed marker's structure, or None."""
    if not isinstance(marker, dict):
        return f"expected a JSON object, got {type(marker).__name__}"
    files = marker.get("files")
    if not isinstance(files, dict):
        return f'"files" must be an object of path -> {{"size": bytes}}, got {type(files).__name__}'
    world = marker.get("world_size", 1)
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        return f'"world_size" must be a positive integer, got {world!r}'
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"the entry of {rel} has no integer size ({entry!r})"
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"the entry {rel!r} points outside the checkpoint"
    return None


def is_complete(checkpoint_dir: str | os.PathLike, *, checksums: bool = False) -> bool:
    """True when every rank finished writing ``checkpoint_dir`` and no listed file changed size since."""
    return not incomplete_reasons(checkpoint_dir, checksums=checksums)


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder in ``output_dir``, newest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), str(p)) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return sorted(found, reverse=True)


def auto_resume(
    output_dir: str | os.PathLike,
    *,
    strategy: Any = None,
    world_size: int | None = None,
    checksums: bool = False,
    training_args: Any = None,
    trust_pickles: bool = False,
) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``, or None; partial checkpoints are skipped.

    ``training_args`` (the run's ``TrainingArguments``, before the Trainer is built) also prepares the
    checkpoint for this run with :func:`hf_dist.reshard.prepare_resume`: a DeepSpeed ZeRO checkpoint saved
    by another number of ranks is converted once to DeepSpeed's universal format and ``load_universal`` is
    switched on in the run's DeepSpeed config; a checkpoint of another strategy raises, naming
    ``hf-dist convert``. Call it on every rank (rank 0 converts, the others wait)::

        args = TrainingArguments(...)
        resume = hf_dist.auto_resume(args.output_dir, training_args=args)
        Trainer(model, args, callbacks=hf_dist.callbacks.default(), ...).train(resume_from_checkpoint=resume)

    ``strategy`` (a strategy name such as ``"fsdp_full_shard"``, or the ``Trainer`` about to run) only
    checks, and raises a RuntimeError naming ``hf-dist convert`` / ``hf-dist reshard`` when the checkpoint
    cannot be loaded by that strategy and world size::

        trainer.train(resume_from_checkpoint=hf_dist.auto_resume(args.output_dir, strategy=trainer))

    Either way the checkpoint's family must match the run (a ZeRO-3 checkpoint for a ZeRO-2 run, or DDP
    weights for an FSDP run, raise), and every pickle in it passes the loading gate (:func:`gate_checkpoint`;
    a foreign type raises :class:`~hf_dist.checkpoint.safe_pickle.UnsafePickleError` unless ``trust_pickles``).
    Malformed markers make a checkpoint "not complete", with the reason in the log.
    """
    _check_output_dir(output_dir)
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        logger.info("auto_resume: no checkpoint-N folder in %s; starting from scratch", output_dir)
    for step, path in checkpoints:
        reasons = incomplete_reasons(path, checksums=checksums)
        if reasons:
            logger.warning("auto_resume: skipping %s: %s", path, "; ".join(reasons))
            continue
        if training_args is not None:
            from hf_dist.reshard import prepare_resume

            path = prepare_resume(path, world_size, training_args=training_args, trust_pickles=trust_pickles)
        else:
            if strategy is not None:
                name, live_world = _strategy_and_world(strategy, world_size)
                check_resume_compatible(path, name, world_size=live_world)
            gate_checkpoint(path, trust_pickles=trust_pickles)
        logger.info("auto_resume: resuming from %s (step %d)", path, step)
        return path
    return None


def gate_checkpoint(path: str | os.PathLike, *, trust_pickles: bool = False) -> None:
    """The loading gate for a checkpoint about to be resumed: every pickle in it is checked before the Trainer,
    accelerate or DeepSpeed unpickles it (DeepSpeed with ``weights_only=False``, DCP's ``.metadata`` with
    plain ``pickle.load``). The completion marker proves only that every rank finished writing, not who
    wrote the files, so this runs whatever the marker says."""
    from hf_dist.checkpoint.safe_pickle import check_pickles

    check_pickles(path, trust_pickles=trust_pickles)


def _check_output_dir(output_dir: str | os.PathLike) -> None:
    root = Path(output_dir)
    if _CHECKPOINT_RE.match(root.name) or (root / MARKER_NAME).is_file() or (root / "trainer_state.json").is_file():
        raise ValueError(
            f"auto_resume got {root}, which is a checkpoint folder itself; pass the run's output_dir that holds "
            f"the checkpoint-N folders ({root.parent}), or pass {root} to trainer.train(resume_from_checkpoint=...) "
            "directly"
        )


def strategy_of_args(training_args: Any) -> str | None:
    """The strategy ``TrainingArguments`` asks for ('ddp', 'zero1/2/3', 'fsdp_full_shard'), before any Trainer.

    None when it cannot tell (a DeepSpeed config without ZeRO).
    """
    ds = getattr(getattr(training_args, "hf_deepspeed_config", None), "config", None)
    if ds is None:
        ds = getattr(training_args, "deepspeed", None)
        if isinstance(ds, (str, os.PathLike)):
            try:
                ds = json.loads(Path(ds).read_text())
            except (OSError, ValueError):
                return None
    if ds:
        stage = ds.get("zero_optimization", {}).get("stage", 0) if isinstance(ds, dict) else 0
        return f"zero{int(stage)}" if str(stage) in ("1", "2", "3") else None
    if getattr(training_args, "fsdp", None):
        return "fsdp_full_shard"
    return "ddp"


def _strategy_and_world(strategy: Any, world_size: int | None) -> tuple[str, int | None]:
    if isinstance(strategy, str):
        return strategy, world_size
    # A Trainer: its accelerator already decided what really runs.
    args = getattr(strategy, "args", None)
    return _dist.live_strategy(args), world_size or getattr(args, "world_size", None)


def check_resume_compatible(
    checkpoint_dir: str | os.PathLike, strategy: str, *, world_size: int | None = None
) -> None:
    """Raise RuntimeError when ``strategy`` on ``world_size`` ranks cannot load ``checkpoint_dir``."""
    if strategy not in _FAMILY:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(_FAMILY)}")
    layout = checkpoint_layout(checkpoint_dir)
    wanted = _FAMILY[strategy]
    if layout.family != wanted:
        raise RuntimeError(
            f"cannot resume a {strategy} run from {checkpoint_dir}: it holds {_FAMILY_TEXT[layout.family]}, "
            f"this run needs {_FAMILY_TEXT[wanted]}. The Trainer would fail or silently drop the optimizer "
            f"state. Either keep the strategy the checkpoint was written with, or export the weights with "
            f"`hf-dist convert {checkpoint_dir} OUT_DIR` and start a new run from OUT_DIR "
            f"(`hf-dist reshard` changes the number of ranks of a same-strategy checkpoint)."
        )
    # FSDP's DCP files reshard on load and full checkpoints are replicated: only ZeRO is tied to its world size,
    # until DeepSpeed's universal checkpoint (``latest_universal``, made by `hf-dist reshard`) exists.
    zero = layout.family in ("zero12", "zero3")
    universal = (Path(checkpoint_dir) / "latest_universal").is_file()
    if zero and not universal and world_size and layout.world_size and layout.world_size != world_size:
        raise RuntimeError(
            f"cannot resume from {checkpoint_dir} on {world_size} ranks: its {_FAMILY_TEXT[layout.family]} were "
            f"written by {layout.world_size} ranks and DeepSpeed refuses another world size. Run "
            f"`hf-dist reshard {checkpoint_dir}` (adds a universal checkpoint; then resume with "
            f'"checkpoint": {{"load_universal": true}}), or call hf_dist.reshard.prepare_resume(...) before '
            f"creating the Trainer, or launch {layout.world_size} ranks."
        )


def init_distributed_for_restarts(backend: str | None = None, *, timeout_s: float = 1800) -> bool:
    """Initialize torch.distributed so a ``torchrun --max-restarts`` restart cannot read the dead attempt's addresses.

    With torchrun's default static rendezvous the agent keeps one TCPStore across restarts, and
    the default process group's keys (gloo peer addresses, NCCL unique id) are not namespaced by
    attempt: a restarted rank can read its dead peer's address and hang or fail in
    ``init_process_group`` (measured: gloo "connectFullMesh failed ... Connection refused").
    Call this first thing in the training script; it prefixes the keys with the restart count.
    accelerate and the Trainer then reuse the initialized group. Returns False (and does nothing)
    outside torchrun or when a process group already exists.
    """
    import datetime

    import torch
    import torch.distributed as dist

    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or dist.is_initialized():
        return False
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True); otherwise rank 0 does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=not agent_store and rank == 0, timeout=timeout)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    prefixed = dist.PrefixStore(f"hf_dist/attempt_{attempt}", store)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    return True


class CompleteCheckpointCallback(TrainerCallback):
    """After each save, waits for every rank, then rank 0 marks the checkpoint complete.

    Must be registered on every rank (as Trainer callbacks always are): it calls a barrier.
    """

    def __init__(self, *, checksums: bool = False) -> None:
        self.checksums = checksums

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and args.save_total_limit == 1:
            logger.warning(
                "save_total_limit=1: the Trainer deletes the previous checkpoint before the new one is complete on "
                "every rank, so a crash during a save leaves nothing to resume from; use save_total_limit >= 2"
            )

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        # on_save runs after _save_checkpoint returned on this rank; the barrier makes it "on every rank".
        _dist.barrier()
        if state.is_world_process_zero and checkpoint.is_dir():
            try:
                write_marker(
                    checkpoint,
                    world_size=max(_dist.world_size(), args.world_size),
                    strategy=_dist.live_strategy(args),
                    step=state.global_step,
                    checksums=self.checksums,
                )
            except RuntimeError as exc:
                logger.error("%s", exc)
        # Later callbacks (export) and the next save must see the marker.
        _dist.barrier()
