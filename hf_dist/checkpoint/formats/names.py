"""The one place that names a checkpoint's files: every file name, pattern and glob (per-rank files, DeepSpeed tags,
DCP shards and metadata, the Trainer's state, hf_dist's markers, the ``checkpoint-N`` folders of an output_dir,
what only a training run writes). The layout reader (:mod:`hf_dist.checkpoint.formats.contents`), the readers,
writers, markers, resume, reshard and the output-path check ask this module instead of spelling names of their own.
"""

from __future__ import annotations

import re
from pathlib import Path

from hf_dist.checkpoint.safety.paths import ConfinedFolder

DCP_DIR_PATTERN = "pytorch_model_fsdp_*"
FSDP_FULL_NAMES = ("pytorch_model_fsdp.bin",)
HF_WEIGHT_NAMES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
SHARDED_OPTIMIZER_DIR = "hf_dist_optimizer"  # written by hf_dist.checkpoint.lifecycle.sharded_state
UNIVERSAL_SUFFIX = "_universal"
LATEST = "latest"  # DeepSpeed: names the tag folder of the newest save
LATEST_UNIVERSAL = "latest_universal"
TRAINER_STATE = "trainer_state.json"  # the Trainer writes it after every other file of a save
DCP_METADATA = ".metadata"  # DCP writes it once every rank wrote its .distcp files
MANIFEST_NAME = "hf_dist_complete.json"  # the manifest (hf_dist.checkpoint.lifecycle.manifest): every file of one save
OUTPUT_LOCK = "hf_dist_lock.json"  # in an output_dir: the live job writing it (output.lock)
OUTPUT_MARKER = "hf_dist_output.json"  # in a folder hf_dist wrote as an output (convert, reshard, a recipe's export)
RUN_JOURNAL = "hf_dist_run.json"  # in an output_dir: the run writing it now (hf_dist.checkpoint.output.runs)
WRITING_NAME = "hf_dist_writing.json"  # ... and: a background thread is still writing it (async_save)
PIPELINE_LAYER_GLOB = "layer_*"  # DeepSpeed pipeline parallelism's per-layer files (not read by hf_dist)
# Files and folders that only a training run writes: a folder holding one of them is a checkpoint or a run.
TRAINING_FILES = (TRAINER_STATE, MANIFEST_NAME, LATEST, LATEST_UNIVERSAL, "optimizer.pt", "scheduler.pt",
                  "training_args.bin", *FSDP_FULL_NAMES, "zero_to_fp32.py", OUTPUT_LOCK,
                  RUN_JOURNAL)  # fmt: skip
TRAINING_NAME_RE = re.compile(
    r"^(checkpoint-\d+|global_step\d+.*|pytorch_model_fsdp_\d+|optimizer_\d+|rng_state.*\.pth)$"
)
CHECKPOINT_DIR_RE = re.compile(r"^checkpoint-(\d+)$")  # the Trainer's checkpoint-N folders in an output_dir

# The file names, once: group 1 of the ZeRO optimizer file is the dtype prefix, 2 the data-parallel rank,
# 3 (named "mp") the tensor-parallel rank of DeepSpeed AutoTP; every pattern names its rank group "rank".
OPTIM_FILE_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
ZERO3_MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
TP_MODEL_FILE_RE = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")  # ZeRO-1/2: one per tensor-parallel rank
DCP_SHARD_FILE_RE = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp$")
RNG_STATE_FILE_RE = re.compile(r"^rng_state_(?P<rank>\d+)\.pth$")
STEP_RE = re.compile(r"(?:global_step|checkpoint-|step_?)(\d+)$")

RNG_STATE = "rng state"
ZERO_OPTIM = "DeepSpeed optimizer shard"
ZERO3_MODEL = "DeepSpeed ZeRO-3 model shard"
DCP_MODEL = "FSDP model shard"
DCP_OPTIM = "FSDP optimizer shard"
SHARDED_OPTIM = "sharded optimizer shard (hf_dist)"
# Per-rank files: kind -> (the folder they sit in, relative to the checkpoint root; their file name).
# When one rank's file of a kind exists, every rank's must.
RANK_FILES = {
    RNG_STATE: (re.compile(r"^$"), RNG_STATE_FILE_RE),
    ZERO_OPTIM: (re.compile(r"^global_step\d+$"), OPTIM_FILE_RE),
    ZERO3_MODEL: (re.compile(r"^global_step\d+$"), ZERO3_MODEL_FILE_RE),
    DCP_MODEL: (re.compile(r"^pytorch_model_fsdp_\d+$"), DCP_SHARD_FILE_RE),
    DCP_OPTIM: (re.compile(r"^optimizer_\d+$"), DCP_SHARD_FILE_RE),
    SHARDED_OPTIM: (re.compile(rf"^{SHARDED_OPTIMIZER_DIR}$"), DCP_SHARD_FILE_RE),
}


SWAP_RANK_DIR_RE = re.compile(r"^rank(?P<rank>\d+)$")  # ZeRO-Infinity: offloaded_tensors/rankNN/*.tensor.swp
SCHEDULER_FILES = ("scheduler.pt",)  # the Trainer's LR scheduler
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")  # the Trainer's optimizer of unsharded runs
SHARDED_SCHEDULER = "hf_dist_scheduler.json"  # hf_dist's scheduler of a model sharded at load (sharded_state)


def owner_rank(rel: str) -> int | None:
    """The rank a checkpoint file's name says wrote it (``rng_state_3.pth``, ``zero_pp_rank_3_...``, ``__3_0.distcp``,
    ``offloaded_tensors/rank03/...``), else None."""
    parts = Path(rel).parts
    for pattern in (RNG_STATE_FILE_RE, OPTIM_FILE_RE, ZERO3_MODEL_FILE_RE, DCP_SHARD_FILE_RE):
        if match := pattern.match(parts[-1]):
            return int(match["rank"])
    for part in parts[:-1]:
        if match := SWAP_RANK_DIR_RE.match(part):
            return int(match["rank"])
    return None


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder in ``output_dir``, newest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), str(p)) for p in root.iterdir() if p.is_dir() and (m := CHECKPOINT_DIR_RE.match(p.name))
    ]
    return sorted(found, reverse=True)


def is_checkpoint_dir(path: Path) -> bool:
    """True for a Trainer ``checkpoint-N`` folder itself (by its name, marker or trainer state), not a run's output_dir."""
    folder = ConfinedFolder(path)
    return bool(CHECKPOINT_DIR_RE.match(path.name)) or folder.is_file(MANIFEST_NAME) or folder.is_file(TRAINER_STATE)


def is_training_state(name: str) -> bool:
    """True when a file or folder called ``name`` is one only a training run writes (:data:`TRAINING_FILES`)."""
    return name in TRAINING_FILES or bool(TRAINING_NAME_RE.match(name))


def dcp_folders_without_metadata(folder: Path) -> list[Path]:
    """Every folder under ``folder`` holding ``.distcp`` files but no ``.metadata`` (DCP did not finish it)."""
    subs = sorted({p.parent for p in folder.rglob("*.distcp")})
    return [sub for sub in subs if not ConfinedFolder(sub, folder).is_file(DCP_METADATA)]


def dcp_shard_name(index: int) -> str:
    """The name of the ``index``-th ``.distcp`` file of a DCP folder (what ``DCP_SHARD_FILE_RE`` reads back)."""
    return f"__{index}_0.distcp"


def rng_state_name(rank: int, world_size: int) -> str:
    """The Trainer's RNG-state file of ``rank``: one per rank (``RNG_STATE_FILE_RE``), or one for a single process."""
    return f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth"


def tp_model_file(tag_dir: Path, mp_rank: int) -> Path:
    """The ZeRO-1/2 model-states file of tensor-parallel rank ``mp_rank`` (``TP_MODEL_FILE_RE``) in ``tag_dir``."""
    return ConfinedFolder(tag_dir).path(f"mp_rank_{mp_rank:02d}_model_states.pt")


def optim_file(tag_dir: Path, rank: int, mp_rank: int = 0) -> Path | None:
    """The ZeRO optimizer file of data-parallel ``rank`` and tensor-parallel ``mp_rank`` in ``tag_dir``, if any."""
    for path in tag_dir.iterdir():
        match = OPTIM_FILE_RE.match(path.name)
        if match and int(match["rank"]) == rank and int(match["mp"]) == mp_rank:
            return path
    return None
