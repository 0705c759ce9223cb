"""Which checkpoint is this? Format detection from file names, plus the facts a converter reports.

Accepted layouts (any of them given directly, or the Trainer ``checkpoint-N/`` folder around them):

* DeepSpeed ZeRO-1/2/3: ``latest`` + ``global_stepN/`` holding ``*_model_states.pt`` and
  ``[bf16_|fp16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (the tag folder itself is accepted too).
* FSDP2/FSDP1 sharded DCP: a folder with ``.metadata`` and ``*.distcp`` (``pytorch_model_fsdp_0/``).
* FSDP full state dict: ``pytorch_model_fsdp.bin`` (a torch pickle, read with the safe loader).
* Hugging Face: ``model.safetensors[.index.json]``, ``pytorch_model.bin[.index.json]`` or a PEFT
  ``adapter_model.safetensors``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = ("deepspeed", "dcp", "fsdp_full", "hf")
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
OPTIM_FILE_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO3_MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
STEP_RE = re.compile(r"(?:global_step|checkpoint-|step_?)(\d+)$")


@dataclass
class CheckpointInfo:
    """What was found at a path. ``path`` is the folder (or file) holding the tensors."""

    format: str
    path: Path
    root: Path
    stage: int | None = None
    world_size: int | None = None
    step: int | None = None
    tag: str | None = None
    train_dtype: str | None = None
    config_dir: Path | None = None
    is_adapter: bool = False
    files: list[Path] = field(default_factory=list)
    num_params: int | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown checkpoint format {self.format!r}; expected one of {FORMATS}")

    def describe(self) -> str:
        parts = [self.format if self.stage is None else f"{self.format} ZeRO-{self.stage}"]
        for label, value in (
            ("world size", self.world_size),
            ("step", self.step),
            ("tag", self.tag),
            ("training dtype", self.train_dtype),
            ("parameters", f"{self.num_params:,}" if self.num_params is not None else None),
        ):
            if value is not None:
                parts.append(f"{label} {value}")
        if self.is_adapter:
            parts.append("PEFT adapter")
        return ", ".join(parts) + f" at {self.path}"


def detect_format(path: str | Path, *, tag: str | None = None) -> CheckpointInfo:
    """Detect the checkpoint format at ``path``; raise with what was found and what is accepted."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if path.is_file():
        return _detect_file(path)
    info = _detect_dir(path, tag)
    if info is None:
        raise ValueError(_unknown_layout_message(path))
    info.step = info.step if info.step is not None else _find_step(info)
    info.config_dir = _find_config_dir(info)
    info.is_adapter = info.is_adapter or any((d / "adapter_config.json").is_file() for d in _nearby_dirs(info))
    return info


def _detect_file(path: Path) -> CheckpointInfo:
    if path.suffix == ".safetensors" or path.name.endswith(".index.json"):
        return _finish(CheckpointInfo("hf", path.parent, path.parent, files=[path]))
    if path.suffix in (".bin", ".pt", ".pth"):
        return _finish(CheckpointInfo("fsdp_full", path, path.parent, files=[path]))
    raise ValueError(f"cannot read checkpoint file {path}: expected .safetensors, .bin, .pt or a folder")


def _finish(info: CheckpointInfo) -> CheckpointInfo:
    info.step = _find_step(info)
    info.config_dir = _find_config_dir(info)
    return info


def _detect_dir(path: Path, tag: str | None) -> CheckpointInfo | None:
    if (path / ".metadata").is_file():
        return CheckpointInfo("dcp", path, _outer(path), files=sorted(path.glob("*.distcp")))
    if any(path.glob("*_model_states.pt")) or any(path.glob("*_optim_states.pt")):
        if tag is not None and tag != path.name:
            raise ValueError(f"--tag {tag!r} does not match the DeepSpeed tag folder given ({path.name}); drop --tag")
        return _deepspeed_info(path, path.parent)
    tag_dirs = sorted(d.name for d in path.iterdir() if d.is_dir() and any(d.glob("*_model_states.pt")))
    if tag_dirs or (path / "latest").is_file():
        return _deepspeed_info(path / _choose_tag(path, tag, tag_dirs), path)
    dcp_dirs = sorted(d for d in path.glob(DCP_DIR_PATTERN) if (d / ".metadata").is_file())
    if dcp_dirs:
        return CheckpointInfo("dcp", dcp_dirs[0], path, files=sorted(dcp_dirs[0].glob("*.distcp")))
    for name in FSDP_FULL_NAMES:
        if (path / name).is_file():
            return CheckpointInfo("fsdp_full", path / name, path, files=[path / name])
    for name in HF_WEIGHT_NAMES:
        if (path / name).is_file():
            return CheckpointInfo("hf", path, path, files=[path / name], is_adapter=name.startswith("adapter_"))
    return None


def _choose_tag(root: Path, tag: str | None, tag_dirs: list[str]) -> str:
    if tag is None and (root / "latest").is_file():
        tag = (root / "latest").read_text().strip()
        if tag not in tag_dirs:
            raise FileNotFoundError(
                f"{root}/latest names tag {tag!r} but {root / tag} is missing or has no *_model_states.pt "
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


def _deepspeed_info(tag_dir: Path, root: Path) -> CheckpointInfo:
    optim_files = sorted((p for p in tag_dir.iterdir() if OPTIM_FILE_RE.match(p.name)), key=_rank_of)
    zero3_models = [p for p in tag_dir.iterdir() if ZERO3_MODEL_FILE_RE.match(p.name)]
    prefixes = {OPTIM_FILE_RE.match(p.name).group(1) or "" for p in optim_files}
    if len(prefixes) > 1:
        raise ValueError(
            f"{tag_dir} mixes optimizer files with prefixes {sorted(prefixes)} from different runs; "
            "keep only the files of one run"
        )
    prefix = prefixes.pop() if prefixes else ""
    return CheckpointInfo(
        "deepspeed",
        tag_dir,
        _outer(root) if root == tag_dir else root,
        stage=3 if zero3_models else None,  # 1 vs 2 is read from the optimizer file by the reader
        tag=tag_dir.name,
        train_dtype={"bf16_": "bf16", "fp16_": "fp16"}.get(prefix),
        files=optim_files + sorted(tag_dir.glob("*_model_states.pt")),
    )


def _rank_of(path: Path) -> int:
    return int(OPTIM_FILE_RE.match(path.name).group(2))


def _outer(path: Path) -> Path:
    """The Trainer ``checkpoint-N`` folder around an inner checkpoint folder, when there is one."""
    parent = path.parent
    if (parent / "trainer_state.json").is_file() or (parent / "config.json").is_file():
        return parent
    return path


def _nearby_dirs(info: CheckpointInfo) -> list[Path]:
    dirs = [info.path if info.path.is_dir() else info.path.parent, info.root, info.root.parent]
    return list(dict.fromkeys(dirs))


def _find_config_dir(info: CheckpointInfo) -> Path | None:
    for directory in _nearby_dirs(info):
        if (directory / "config.json").is_file():
            return directory
    return None


def _find_step(info: CheckpointInfo) -> int | None:
    state = info.root / "trainer_state.json"
    if state.is_file():
        try:
            return int(json.loads(state.read_text())["global_step"])
        except (ValueError, KeyError, TypeError):
            pass
    for name in (info.tag, info.root.name, info.path.name):
        match = STEP_RE.search(name or "")
        if match:
            return int(match.group(1))
    return None


def _unknown_layout_message(path: Path) -> str:
    children = sorted(p.name for p in path.iterdir())
    hint = ""
    nested = sorted(p.name for p in path.iterdir() if p.is_dir() and p.name.startswith("checkpoint-"))
    if nested:
        hint = f"; this looks like a Trainer output_dir, pass one of its checkpoints, e.g. {path / nested[-1]}"
    return (
        f"no supported checkpoint found in {path} (contents: {children[:12]}{' ...' if len(children) > 12 else ''}). "
        "Expected a DeepSpeed checkpoint (latest + global_stepN/), a DCP folder (.metadata), "
        f"pytorch_model_fsdp.bin, or an HF folder (model.safetensors){hint}"
    )
