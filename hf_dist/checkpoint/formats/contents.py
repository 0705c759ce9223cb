"""What a checkpoint holds, read from its file names alone: the one model of checkpoint layouts.

:func:`read_contents` answers for the converter (``hf-dist convert``/``verify``: which reader opens it),
for ``hf-dist reshard`` (how many ranks wrote a ZeRO checkpoint, is there a universal copy) and for
resuming (the :class:`~hf_dist.planning.layout.CheckpointFamily` a strategy must match, and which rank's
files are missing). No file is opened; the readers fill in what only the files tell (exact ZeRO stage,
training dtype).

Every file name, pattern and glob it reads is in :mod:`hf_dist.checkpoint.formats.names`.

Accepted layouts (any of them given directly, or the Trainer ``checkpoint-N/`` folder around them):

* DeepSpeed ZeRO-1/2/3: ``latest`` + ``global_stepN/`` holding ``*_model_states.pt`` and
  ``[bf16_|fp16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (the tag folder itself is accepted too);
  ZeRO-3 adds one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank. DeepSpeed AutoTP writes the same files
  once per tensor-parallel rank M (``mp_rank_0M``): ``tp_size`` > 1, per-rank files keyed by global rank.
* FSDP2/FSDP1 sharded DCP: a folder with ``.metadata`` and ``__R_0.distcp`` (``pytorch_model_fsdp_0/``,
  with ``optimizer_0/`` beside it in a Trainer checkpoint).
* FSDP full state dict: ``pytorch_model_fsdp.bin`` (a torch pickle, read with the safe loader).
* Hugging Face: ``model.safetensors[.index.json]``, ``pytorch_model.bin[.index.json]`` or a PEFT
  ``adapter_model.safetensors``.

A Trainer checkpoint also holds one ``rng_state_R.pth`` per rank; one of a model sharded at load time (tensor
parallelism) holds ``model.safetensors`` and hf_dist's optimizer DCP ``hf_dist_optimizer/``
(:mod:`hf_dist.checkpoint.lifecycle.sharded_state`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from hf_dist.checkpoint.formats.names import (
    DCP_DIR_PATTERN,
    DCP_METADATA,
    DCP_MODEL,
    DCP_OPTIM,
    FSDP_FULL_NAMES,
    HF_WEIGHT_NAMES,
    LATEST,
    LATEST_UNIVERSAL,
    OPTIM_FILE_RE,
    RANK_FILES,
    RNG_STATE,
    STEP_RE,
    TP_MODEL_FILE_RE,
    TRAINER_STATE,
    UNIVERSAL_SUFFIX,
    ZERO3_MODEL,
    ZERO3_MODEL_FILE_RE,
    ZERO_OPTIM,
)
from hf_dist.checkpoint.formats.trainer_state import saved_step
from hf_dist.checkpoint.safety.paths import ConfinedFolder, PathEscapeError, checked_tag
from hf_dist.planning.layout import CheckpointFamily

FORMATS = ("deepspeed", "dcp", "fsdp_full", "hf")  # which reader opens the tensors
# The per-rank kinds that tell how many ranks wrote a checkpoint of each family.
_WORLD_KIND = {
    CheckpointFamily.ZERO3: ZERO3_MODEL,
    CheckpointFamily.ZERO12: ZERO_OPTIM,
    CheckpointFamily.DCP: DCP_MODEL,
    CheckpointFamily.FULL: RNG_STATE,
}
# The kinds a folder given directly holds, whatever its name.
_OWN_KINDS = {"deepspeed": (ZERO_OPTIM, ZERO3_MODEL), "dcp": (DCP_MODEL,)}


@dataclass(frozen=True)
class CheckpointContents:
    """What was found at a path, never changed once read. ``path`` is the folder (or file) holding the tensors,
    ``root`` the Trainer ``checkpoint-N`` folder around it (or ``path`` itself).

    ``rank_files``: per-rank file kind -> rank -> its files. ``stage``, ``train_dtype`` and ``world_size`` are refined
    once a reader opened the files: :func:`hf_dist.checkpoint.conversion.convert.open_reader` returns a new contents
    with what the reader found (``Reader.found``).
    """

    format: str | None  # one of FORMATS; None: no weights (a Trainer folder of optimizer/RNG files only)
    path: Path
    root: Path
    family: CheckpointFamily = CheckpointFamily.FULL
    world_size: int | None = None  # ranks that wrote it, from the file names; None when they do not tell
    stage: int | None = None  # ZeRO stage: 3 from the file names, 1 or 2 only once the reader read it
    step: int | None = None
    tag: str | None = None  # DeepSpeed tag folder, e.g. "global_step500"
    universal_tag: str | None = None  # DeepSpeed universal copy made by `hf-dist reshard`, when one exists
    train_dtype: str | None = None
    config_dir: Path | None = None
    is_adapter: bool = False
    files: list[Path] = field(default_factory=list)
    rank_files: dict[str, dict[int, list[Path]]] = field(default_factory=dict)
    num_params: int | None = None
    tp_size: int = 1  # DeepSpeed AutoTP: tensor-parallel ranks (mp_rank_XX files); world_size counts every rank
    unread: str | None = None  # read_contents(strict=False) of a folder it could not read: why

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"unknown checkpoint format {self.format!r}; expected one of {FORMATS}")

    def missing_rank_files(self, world_size: int) -> list[str]:
        """Per-rank files absent for some rank, e.g. ``['rng state of rank 1']``; empty when all ranks wrote."""
        missing = []
        for kind, ranks in self.rank_files.items():
            if ranks:
                top = max(world_size, max(ranks) + 1)
                missing += [f"{kind} of rank {r}" for r in range(top) if r not in ranks]
        return missing

    def describe(self) -> str:
        if self.stage is not None:
            head = f"{self.format} ZeRO-{self.stage}"
        elif self.family is CheckpointFamily.ZERO12:
            head = f"{self.format} ZeRO-1/2"
        else:
            head = self.format or self.family.text
        parts = [head]
        for label, value in (
            ("world size", self.world_size),
            ("AutoTP size", self.tp_size if self.tp_size > 1 else None),
            ("step", self.step),
            ("tag", self.tag),
            ("universal copy", self.universal_tag),
            ("training dtype", self.train_dtype),
            ("parameters", f"{self.num_params:,}" if self.num_params is not None else None),
        ):
            if value is not None:
                parts.append(f"{label} {value}")
        if self.is_adapter:
            parts.append("PEFT adapter")
        return ", ".join(parts) + f" at {self.path}"


def read_contents(path: str | Path, *, tag: str | None = None, strict: bool = True) -> CheckpointContents:
    """The layout at ``path``; raise with what was found and what is accepted.

    ``strict=False`` (for the resume bookkeeping, which must answer for any ``checkpoint-N`` folder, even a
    half-written one or one not written yet) never raises for a folder: one without readable weights gets
    ``format=None`` and the family its per-rank files imply; a path that does not exist holds nothing.
    """
    path = Path(path).expanduser()
    if not path.exists():
        if strict:
            raise FileNotFoundError(
                f"checkpoint path {path} does not exist; pass a Trainer checkpoint-N folder, a DeepSpeed or DCP "
                "checkpoint folder, or a weights file (.safetensors, .bin)"
            )
        return CheckpointContents(None, path, path, unread=f"checkpoint path {path} does not exist")
    if path.is_file():
        layout = _detect_file(path)
    else:
        try:
            layout = _detect_dir(path, tag)
            if layout is None:
                raise ValueError(_unknown_layout_message(path))
        except PathEscapeError:
            raise  # never "no layout": a path leading out is refused whatever the caller tolerates
        except (ValueError, FileNotFoundError) as exc:
            if strict:
                raise
            layout = CheckpointContents(None, path, path, unread=str(exc))
    return _with_rank_files(layout, path.is_dir())


def _with_rank_files(layout: CheckpointContents, is_dir: bool) -> CheckpointContents:
    """``layout`` with what its per-rank files, tags and the folders around it tell."""
    layout = replace(layout, rank_files=_rank_files(layout))
    family = _family(layout)
    world_ranks = layout.rank_files.get(_WORLD_KIND[family])
    world_size = layout.world_size
    if world_ranks:
        world_size = max(world_ranks) + 1
    elif family is CheckpointFamily.FULL and ConfinedFolder(layout.root).is_file("rng_state.pth"):
        world_size = 1
    layout = replace(
        layout, family=family, world_size=world_size, stage=3 if family is CheckpointFamily.ZERO3 else layout.stage,
        universal_tag=_universal_tag(layout.root) if family.is_zero else None,
    )  # fmt: skip
    layout = replace(layout, step=_find_step(layout), config_dir=_find_config_dir(layout))
    if is_dir and not layout.is_adapter:
        adapter = any(ConfinedFolder(d).is_file("adapter_config.json") for d in _nearby_dirs(layout))
        layout = replace(layout, is_adapter=adapter)
    return layout


def _detect_file(path: Path) -> CheckpointContents:
    if path.suffix == ".safetensors" or path.name.endswith(".index.json"):
        return CheckpointContents("hf", path.parent, path.parent, files=[path])
    if path.suffix in (".bin", ".pt", ".pth"):
        return CheckpointContents("fsdp_full", path, path.parent, files=[path])
    raise ValueError(f"cannot read checkpoint file {path}: expected .safetensors, .bin, .pt or a folder")


def _detect_dir(path: Path, tag: str | None) -> CheckpointContents | None:
    folder = ConfinedFolder(path)
    if folder.is_file(DCP_METADATA):
        return CheckpointContents("dcp", path, _outer(path), files=sorted(path.glob("*.distcp")))
    if any(path.glob("*_model_states.pt")) or any(path.glob("*_optim_states.pt")):
        if tag is not None and tag != path.name:
            raise ValueError(f"--tag {tag!r} does not match the DeepSpeed tag folder given ({path.name}); drop --tag")
        return _deepspeed_layout(path, path.parent)
    tag_dirs = sorted(
        d.name
        for d in path.iterdir()
        if d.is_dir()
        and not d.name.endswith(UNIVERSAL_SUFFIX)
        and (any(d.glob("*_model_states.pt")) or any(d.glob("*_optim_states.pt")))
    )
    if tag_dirs or folder.is_file(LATEST):
        return _deepspeed_layout(folder.path(_choose_tag(path, tag, tag_dirs)), path)
    dcp_dirs = sorted(d for d in path.glob(DCP_DIR_PATTERN) if folder.folder(d.name).is_file(DCP_METADATA))
    if dcp_dirs:
        return CheckpointContents("dcp", dcp_dirs[0], path, files=sorted(dcp_dirs[0].glob("*.distcp")))
    for name in FSDP_FULL_NAMES:
        if folder.is_file(name):
            return CheckpointContents("fsdp_full", folder.path(name), path, files=[folder.path(name)])
    for name in HF_WEIGHT_NAMES:
        if folder.is_file(name):
            adapter = name.startswith("adapter_")
            return CheckpointContents("hf", path, path, files=[folder.path(name)], is_adapter=adapter)
    return None


def _choose_tag(root: Path, tag: str | None, tag_dirs: list[str]) -> str:
    folder = ConfinedFolder(root)
    if tag is None and folder.is_file(LATEST):
        tag = latest_tag(root)
        if tag not in tag_dirs and not folder.is_dir(tag):
            raise FileNotFoundError(
                f"{root}/latest names tag {tag!r} but {folder.path(tag)} is missing or has no *_model_states.pt "
                f"(available tags: {tag_dirs or 'none'}); pass --tag with one of them"
            )
        return tag
    if tag is None:
        if len(tag_dirs) == 1:
            return tag_dirs[0]
        raise ValueError(f"{root} has no 'latest' file and several tags {tag_dirs}; pass --tag with one of them")
    if tag not in tag_dirs:
        raise ValueError(f"tag {tag!r} not found in {root}; available tags: {tag_dirs or 'none'}")
    return tag


def _deepspeed_layout(tag_dir: Path, root: Path) -> CheckpointContents:
    optim_files = sorted(
        (p for p in tag_dir.iterdir() if OPTIM_FILE_RE.match(p.name)),
        key=lambda p: (int(OPTIM_FILE_RE.match(p.name)["rank"]), int(OPTIM_FILE_RE.match(p.name)["mp"])),
    )
    prefixes = {OPTIM_FILE_RE.match(p.name).group(1) or "" for p in optim_files}
    if len(prefixes) > 1:
        raise ValueError(
            f"{tag_dir} mixes optimizer files with prefixes {sorted(prefixes)} from different runs; "
            "keep only the files of one run"
        )
    prefix = prefixes.pop() if prefixes else ""
    return CheckpointContents(
        "deepspeed",
        tag_dir,
        _outer(root) if root == tag_dir else root,
        tag=tag_dir.name,
        train_dtype={"bf16_": "bf16", "fp16_": "fp16"}.get(prefix),
        files=optim_files + sorted(tag_dir.glob("*_model_states.pt")),
        tp_size=_tp_size(tag_dir, optim_files),
    )


def _tp_size(tag_dir: Path, optim_files: list[Path]) -> int:
    """The AutoTP ranks that wrote a tag folder: every ``mp_rank`` any of its files names (a rank whose optimizer
    files are gone still left its model states, so the reader names what is missing instead of merging fewer)."""
    ranks = {OPTIM_FILE_RE.match(p.name)["mp"] for p in optim_files}
    for p in tag_dir.iterdir():
        if m := (TP_MODEL_FILE_RE.match(p.name) or ZERO3_MODEL_FILE_RE.match(p.name)):
            ranks.add(m["mp"])
    return len(ranks) or 1


def _rank_files(layout: CheckpointContents) -> dict[str, dict[int, list[Path]]]:
    """Per-rank files of the checkpoint: in the root, in its known subfolders and in the folder given itself."""
    scans: dict[Path, set[str]] = {}
    if layout.root.is_dir():
        for folder in [layout.root, *sorted(d for d in layout.root.iterdir() if d.is_dir())]:
            name = "" if folder == layout.root else folder.name
            scans[folder] = {kind for kind, (where, _) in RANK_FILES.items() if where.match(name)}
    if layout.path.is_dir():
        scans.setdefault(layout.path, set()).update(_OWN_KINDS.get(layout.format or "", ()))
    found: dict[str, dict[int, list[Path]]] = {kind: {} for kind in RANK_FILES}
    for folder, kinds in scans.items():
        if not kinds:
            continue
        files = sorted(folder.iterdir())
        for kind in kinds:
            matches = [(m, f) for f in files if (m := RANK_FILES[kind][1].match(f.name)) and f.is_file()]
            # DeepSpeed AutoTP names files by data-parallel and tensor-parallel rank; its (dp, tp) mesh puts
            # global rank = dp * tp_size + tp
            tp_size = len({m["mp"] for m, _ in matches if "mp" in m.re.groupindex}) or 1
            for m, f in matches:
                tp = int(m["mp"]) if "mp" in m.re.groupindex else 0
                found[kind].setdefault(int(m["rank"]) * tp_size + tp, []).append(f)
    return found


def _family(layout: CheckpointContents) -> CheckpointFamily:
    ranks = layout.rank_files
    if ranks[ZERO3_MODEL]:
        return CheckpointFamily.ZERO3
    if layout.format == "deepspeed" or ranks[ZERO_OPTIM]:
        return CheckpointFamily.ZERO12
    if layout.format in ("dcp", "fsdp_full") or ranks[DCP_MODEL] or ranks[DCP_OPTIM]:
        return CheckpointFamily.DCP
    return CheckpointFamily.FULL


def _universal_tag(root: Path) -> str | None:
    folder = ConfinedFolder(root)
    if not folder.is_file(LATEST_UNIVERSAL):
        return None
    tag = checked_tag(root, folder.read_text(LATEST_UNIVERSAL), LATEST_UNIVERSAL)
    return tag if folder.is_dir(tag) else None


def check_tags_confined(root: Path) -> None:
    """Refuse ``root`` when its DeepSpeed ``latest`` / ``latest_universal`` names anything but a folder inside it."""
    folder = ConfinedFolder(root)
    for name in (LATEST, LATEST_UNIVERSAL):
        if folder.is_file(name):
            checked_tag(root, folder.read_text(name), name)


def latest_tag(root: Path) -> str:
    """The tag DeepSpeed's ``latest`` file in ``root`` names, refused unless it is a folder name inside ``root``."""
    return checked_tag(root, ConfinedFolder(root).read_text(LATEST), LATEST)


def _outer(path: Path) -> Path:
    """The Trainer ``checkpoint-N`` folder around an inner checkpoint folder, when there is one."""
    parent = ConfinedFolder(path.parent)
    if parent.is_file(TRAINER_STATE) or parent.is_file("config.json"):
        return parent.root
    return path


def _nearby_dirs(layout: CheckpointContents) -> list[Path]:
    dirs = [layout.path if layout.path.is_dir() else layout.path.parent, layout.root, layout.root.parent]
    return list(dict.fromkeys(dirs))


def _find_config_dir(layout: CheckpointContents) -> Path | None:
    for directory in _nearby_dirs(layout):
        if ConfinedFolder(directory).is_file("config.json"):
            return directory
    return None


def _find_step(layout: CheckpointContents) -> int | None:
    step = saved_step(layout.root)
    if step is not None:
        return step
    for name in (layout.tag, layout.root.name, layout.path.name):
        match = STEP_RE.search(name or "")
        if match:
            return int(match.group(1))
    return None


def _unknown_layout_message(path: Path) -> str:
    children = sorted(p.name for p in path.iterdir())
    hint = ""
    nested = sorted(p.name for p in path.iterdir() if p.is_dir() and p.name.startswith("checkpoint-"))
    if nested:
        hint = f"; this looks like a Trainer output_dir, pass one of its checkpoints, e.g. {path}{os.sep}{nested[-1]}"
    return (
        f"no supported checkpoint found in {path} (contents: {children[:12]}{' ...' if len(children) > 12 else ''}). "
        "Expected a DeepSpeed checkpoint (latest + global_stepN/), a DCP folder (.metadata), "
        f"pytorch_model_fsdp.bin, or an HF folder (model.safetensors){hint}"
    )
