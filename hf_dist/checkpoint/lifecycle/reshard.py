"""Resume a Trainer checkpoint on a different number of ranks.

- **FSDP2** checkpoints (``checkpoint-N/pytorch_model_fsdp_0/`` + ``optimizer_0/``) are DCP folders. accelerate
  loads them with ``torch.distributed.checkpoint.load`` into the live DTensor state dict, which reshards to
  whatever mesh the new run has, model and optimizer alike. Nothing to convert.
- **DeepSpeed ZeRO** checkpoints store one optimizer partition per data-parallel rank, and DeepSpeed refuses a
  different count ("The checkpoint being loaded used a DP world size of X but the current world size is Y").
  :func:`prepare_resume` converts such a checkpoint once to DeepSpeed's *universal* format
  (``deepspeed.checkpoint.ds_to_universal``: one fp32 file per parameter with its Adam moments), writes it next
  to the original as ``<tag>_universal/`` + ``latest_universal``, and switches ``checkpoint.load_universal`` on
  in the run's DeepSpeed config so ``trainer.train(resume_from_checkpoint=...)`` loads it.

Usage, before building the Trainer (all ranks call it; global rank 0 converts, the others wait)::

    args = TrainingArguments(..., deepspeed=ds_config)
    ckpt = hf_dist.checkpoint.lifecycle.reshard.prepare_resume("out/checkpoint-500", training_args=args)
    Trainer(model, args, ...).train(resume_from_checkpoint=ckpt)

or offline: ``hf-dist reshard out/checkpoint-500`` (then set ``"checkpoint": {"load_universal": true}``).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

from hf_dist.atomic_io import atomic_dir, atomic_write_text
from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint
from hf_dist.checkpoint.formats.contents import CheckpointContents
from hf_dist.checkpoint.formats.names import LATEST_UNIVERSAL, UNIVERSAL_SUFFIX, ZERO_OPTIM
from hf_dist.checkpoint.lifecycle.manifest import require_match, write_manifest
from hf_dist.checkpoint.lifecycle.resume_checks import check_autotp_matches, check_strategy_matches, gate_checkpoint
from hf_dist.checkpoint.safety.paths import ConfinedFolder, PathEscapeError


def inspect_checkpoint(checkpoint_dir: str | Path) -> CheckpointContents:
    """The layout of ``checkpoint_dir`` (a Trainer ``checkpoint-N`` folder), checked for resharding.

    A ZeRO checkpoint must hold its optimizer partitions: without them there is nothing to reshard.
    """
    path = Path(checkpoint_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist; pass a Trainer checkpoint-N folder")
    try:
        checkpoint = open_checkpoint(path)
    except PathEscapeError:
        raise
    except ValueError as exc:
        raise ValueError(f"{path} is not a Trainer checkpoint: {exc}") from None
    require_match(checkpoint)  # a checkpoint with a manifest is resharded only as it was written
    layout = checkpoint.contents
    if layout.family.is_zero and not layout.rank_files[ZERO_OPTIM]:
        raise ValueError(
            f"{layout.path} holds no ZeRO optimizer files (zero_pp_rank_*_optim_states.pt); it was saved without "
            "optimizer state, so it can only be resumed as weights (hf-dist convert)"
        )
    return layout


def to_universal(
    checkpoint_dir: str | Path, *, workers: int = 1, overwrite: bool = False, trust_pickles: bool = False
) -> Path:
    """Convert a DeepSpeed ZeRO checkpoint folder to DeepSpeed's universal format, in place.

    Writes ``<tag>_universal/`` and ``latest_universal`` inside ``checkpoint_dir`` (the original files are
    kept) and returns the universal folder. The folder appears atomically: it is built under a temporary name
    and renamed, and ``latest_universal`` is written last, so a crash leaves no half-converted checkpoint. The copy
    carries a manifest of its own (a derived copy: the checkpoint's manifest, of what the run saved, leaves it out;
    :func:`hf_dist.checkpoint.lifecycle.manifest.incomplete_reasons` checks it against its own).
    DeepSpeed unpickles the tag folder with ``weights_only=False``: it runs under
    :func:`hf_dist.checkpoint.safety.loading.guarded_loads`, so each of those loads is torch's ``weights_only``
    load with hf_dist's allowlist, confined to the checkpoint (``trust_pickles``: DeepSpeed's own loads, confined).
    """
    from hf_dist.checkpoint.safety.loading import check_loadable

    layout = inspect_checkpoint(checkpoint_dir)
    if layout.tp_size > 1:
        raise ValueError(
            f"{layout.describe()} is a DeepSpeed AutoTP checkpoint; hf_dist reshards data-parallel ZeRO checkpoints "
            f"only: resume it on {layout.world_size} ranks with autotp_size {layout.tp_size}, or export the weights "
            "with hf-dist convert and start a new run from them"
        )
    if not layout.family.is_zero:
        raise ValueError(
            f"{layout.describe()} is not a DeepSpeed ZeRO checkpoint; only those need a universal conversion "
            "(FSDP/DCP checkpoints reshard on load as they are)"
        )
    if layout.universal_tag and not overwrite:
        return ConfinedFolder(layout.root).path(layout.universal_tag)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    final = ConfinedFolder(layout.root).path(f"{layout.tag}{UNIVERSAL_SUFFIX}")
    check_loadable(layout.root, trust_pickles=trust_pickles)  # an early refusal; the loads below are guarded
    with atomic_dir(final, overwrite=True) as tmp:
        _run_ds_to_universal(layout.path, tmp, workers, layout.root, trust_pickles)
        write_manifest(tmp, hashed={}, world_size=1, step=layout.step)  # the copy's own: read only as written
    atomic_write_text(ConfinedFolder(layout.root).path(LATEST_UNIVERSAL), final.name)
    return final


def reshard(
    src: str | Path,
    dst: str | Path | None = None,
    *,
    workers: int = 1,
    overwrite: bool = False,
    trust_pickles: bool = False,
) -> Path:
    """Make the checkpoint folder ``src`` resumable on any world size; return the folder to resume from.

    DeepSpeed ZeRO: adds the universal conversion (in place, or in a copy at ``dst`` when given, leaving
    ``src`` untouched). FSDP/DCP and unsharded checkpoints already reshard on load: returned (or copied) as is.
    ``dst`` passes :func:`hf_dist.checkpoint.output.paths.check_output_path`: never ``src``, a folder around or
    inside it; ``overwrite`` replaces only a folder that holds no training state. ``src`` is loaded as its resume
    will load it first (:func:`hf_dist.checkpoint.safety.loading.check_loadable`), and DeepSpeed's loads are
    guarded (:func:`to_universal`).
    """
    from hf_dist.checkpoint.output.paths import check_output_path, make_parent, mark_output
    from hf_dist.checkpoint.safety.loading import check_loadable

    src_path = Path(src).expanduser()
    layout = inspect_checkpoint(src_path)
    if dst is None:
        if layout.family.is_zero:
            to_universal(src_path, workers=workers, overwrite=overwrite, trust_pickles=trust_pickles)
        return src_path
    dst_path = check_output_path(dst, sources=[src_path], overwrite=overwrite)
    check_loadable(src_path, trust_pickles=trust_pickles)
    make_parent(dst_path)
    with atomic_dir(dst_path, overwrite=overwrite) as tmp:
        shutil.copytree(src_path, tmp, ignore=shutil.ignore_patterns(".*.tmp-*"), symlinks=True, dirs_exist_ok=True)
        if layout.family.is_zero:
            to_universal(tmp, workers=workers, overwrite=overwrite, trust_pickles=trust_pickles)
        mark_output(tmp, "hf-dist reshard", source=src_path)
    return dst_path


def _run_ds_to_universal(src: Path, dst: Path, workers: int, root: Path, trust_pickles: bool) -> None:
    """DeepSpeed's converter over ``src``, every load it makes guarded (its worker processes too)."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    from hf_dist.checkpoint.safety.loading import PathEscapeError, UnsafePickleError, guarded_loads, guarded_pool

    args = Namespace(
        input_folder=str(src),
        # the trailing separator makes DeepSpeed write its ``latest_universal`` (naming the folder it wrote) inside
        # ``dst`` rather than beside it: the checkpoint's own names the universal folder only once it exists under
        # its final name (to_universal writes it), never the temporary one, which other ranks wait on and readers
        # refuse (os.path.split in ds_to_universal.main)
        output_folder=os.path.join(str(dst), ""),
        num_extract_workers=workers,
        num_merge_workers=max(1, workers // 2),
        keep_temp_folder=False,
        strict=True,
        # HF models carry no UNIVERSAL_CHECKPOINT_INFO (a Megatron notion); the defaults are right for them
        inject_missing_state=True,
    )
    log = io.StringIO()
    pool = guarded_pool(ds_to_universal.ProcessPoolExecutor, root, trust_pickles)
    try:
        with (
            contextlib.redirect_stdout(log),
            guarded_loads(root, trust_pickles=trust_pickles),
            _patched(ds_to_universal, "ProcessPoolExecutor", pool),
        ):
            ds_to_universal.main(args)
        ConfinedFolder(dst).path(LATEST_UNIVERSAL).unlink(missing_ok=True)
    except (UnsafePickleError, PathEscapeError):
        raise
    except Exception as exc:
        raise RuntimeError(
            f"DeepSpeed's universal conversion of {src} failed ({type(exc).__name__}: {exc}); its log:\n"
            f"{log.getvalue()[-2000:]}"
        ) from exc


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def prepare_resume(
    checkpoint_dir: str | Path,
    world_size: int | None = None,
    *,
    training_args: Any = None,
    deepspeed_config: dict | None = None,
    timeout_s: float = 3600.0,
    trust_pickles: bool = False,
    gated: bool = False,
) -> str:
    """Make ``checkpoint_dir`` resumable at ``world_size`` ranks and return the path to resume from.

    ``world_size`` defaults to ``$WORLD_SIZE``. FSDP/DCP and unsharded checkpoints are returned as they are
    (they reshard on load). A DeepSpeed checkpoint saved by a different number of ranks is converted to the
    universal format (global rank 0 converts; other ranks wait for ``latest_universal``), and
    ``checkpoint.load_universal`` is switched on in ``training_args``' DeepSpeed config and/or the
    ``deepspeed_config`` dict, in place. Call it before constructing the ``Trainer``.

    A checkpoint of another strategy family than ``training_args`` asks for raises (as
    :func:`hf_dist.checkpoint.lifecycle.resume_checks.check_resume_compatible`), and it is loaded now as its resume
    will load it (:func:`~hf_dist.checkpoint.lifecycle.resume_checks.gate_checkpoint`), so a refusal comes before
    the Trainer is built; the Trainer's own loads are guarded by :func:`hf_dist.callbacks.attach`. ``gated=True``: the
    caller loaded it so already (``auto_resume``, which skips a checkpoint that fails there).
    """
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    layout = inspect_checkpoint(checkpoint_dir)
    check_strategy_matches(layout, training_args)
    check_autotp_matches(layout, training_args, world_size)
    if not gated:
        gate_checkpoint(layout.root, trust_pickles=trust_pickles)
    if not layout.family.is_zero or layout.world_size == world_size:
        return str(layout.root)
    if training_args is None and deepspeed_config is None:
        raise ValueError(
            f"{layout.describe()} is resumed on {world_size} rank(s): pass training_args= (or deepspeed_config=) "
            "so prepare_resume can switch on DeepSpeed's universal checkpoint loading"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        to_universal(layout.root, trust_pickles=trust_pickles)
    else:
        _wait_for(ConfinedFolder(layout.root).path(LATEST_UNIVERSAL), timeout_s)
    for config in _deepspeed_config_dicts(training_args, deepspeed_config):
        config.setdefault("checkpoint", {})["load_universal"] = True
    return str(layout.root)


def _deepspeed_config_dicts(training_args: Any, deepspeed_config: dict | None) -> list[dict]:
    """Every live copy of the DeepSpeed config the Trainer will read (TrainingArguments keeps two)."""
    found: list[dict] = [deepspeed_config] if deepspeed_config is not None else []
    if training_args is not None:
        hf_config = getattr(training_args, "hf_deepspeed_config", None)
        plugin = getattr(training_args, "deepspeed_plugin", None)
        if hf_config is None:
            raise ValueError(
                "training_args has no DeepSpeed config (TrainingArguments(deepspeed=...) was not set) but the "
                "checkpoint is a DeepSpeed one; pass the same deepspeed= config the checkpoint was trained with"
            )
        found.append(hf_config.config)
        if plugin is not None:
            found += [plugin.deepspeed_config, plugin.hf_ds_config.config]
    unique: dict[int, dict] = {id(c): c for c in found}
    return list(unique.values())


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"waited {timeout_s:.0f}s for rank 0 to write {path}; check rank 0's log, and that all nodes "
                "see the same checkpoint folder (a shared filesystem)"
            )
        time.sleep(0.5)


def untie_optimizer_steps(optimizer: Any) -> int:
    """Give every optimizer state its own ``step`` tensor; return how many were shared.

    DeepSpeed's ZeRO-3 universal loader assigns one ``step`` tensor object to every parameter sub-group, and
    torch's Adam increments ``step`` in place, so after resuming each step counted once per sub-group and
    Adam's bias correction drifted (measured: counter 9 instead of 6 after 3 steps with 2 sub-groups).
    """
    import torch

    while hasattr(optimizer, "optimizer"):  # accelerate / DeepSpeed wrappers hold the torch optimizer
        optimizer = optimizer.optimizer
    seen: set[int] = set()
    shared = 0
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
                shared += 1
            seen.add(id(step))
    return shared


def reshard_callback() -> Any:
    """A ``TrainerCallback`` that repairs what resharded loads leave behind; add it when resuming.

    ``Trainer(..., callbacks=[hf_dist.checkpoint.lifecycle.reshard.reshard_callback()])``. It runs once at train start, after the
    checkpoint was loaded, and calls :func:`untie_optimizer_steps`.
    """
    from transformers import TrainerCallback

    class ReshardCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            if optimizer is not None:
                untie_optimizer_steps(optimizer)

    return ReshardCallback()
