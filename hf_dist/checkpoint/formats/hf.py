"""HF folders and single torch files as sources, and the non-weight files an HF folder carries."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.checkpoint_folder import CheckpointFolder
from hf_dist.checkpoint.formats.contents import CheckpointContents
from hf_dist.checkpoint.formats.reader import Reader, TensorSpec
from hf_dist.checkpoint.safety.loading import CorruptCheckpointError, safe_load
from hf_dist.checkpoint.safety.paths import ConfinedFolder

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
MODEL_FILES = ("generation_config.json",)


class HFReader(Reader):
    """Safetensors (single or sharded, read lazily with ``safe_open``) or ``pytorch_model*.bin``."""

    def __init__(self, checkpoint: CheckpointFolder, *, trust_pickles: bool = False) -> None:
        super().__init__()
        self._data = checkpoint.data
        self.folder = self._data.root
        self.trust_pickles = trust_pickles
        self._file_of: dict[str, Path] = {}
        for path in self._weight_files(checkpoint.contents):
            for name, spec in self._file_specs(path).items():
                self._file_of[name] = path
                self._specs[name] = spec
        self.train_dtype = None

    def _weight_files(self, info: CheckpointContents) -> list[Path]:
        given = info.files[0]
        if given.name.endswith(".index.json"):
            weight_map = read_weight_map(given)
            files = sorted({self._data.path(f, named_in=given) for f in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{given} lists shard files that are missing: {missing}")
            return files
        return [given]

    def _file_specs(self, path: Path) -> dict[str, TensorSpec]:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(path, framework="pt") as handle:
                    specs = {}
                    for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                        sl = handle.get_slice(name)
                        specs[name] = TensorSpec(tuple(sl.get_shape()), _torch_dtype(sl.get_dtype()))
                    return specs
            except Exception as exc:  # safetensors raises its own error types
                raise CorruptCheckpointError(f"cannot read {path}: {exc}") from None
        state = self._torch_state(path)
        return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state.items()}

    def _torch_state(self, path: Path) -> dict:
        state = safe_load(path, trust_pickles=self.trust_pickles)
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds a {type(state).__name__}, expected a state dict of tensors")
        return state

    def read(self, names: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._file_of[name], []).append(name)
        for path, file_names in by_file.items():
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(path, framework="pt") as handle:
                    for name in file_names:
                        out[name] = handle.get_tensor(name)
            else:
                state = self._torch_state(path)
                for name in file_names:
                    out[name] = state[name].clone()
        return {name: out[name] for name in names}


class TorchFileReader(HFReader):
    """An FSDP full state dict (``pytorch_model_fsdp.bin``): one torch pickle, memory-mapped."""

    def __init__(self, checkpoint: CheckpointFolder, *, trust_pickles: bool = False) -> None:
        Reader.__init__(self)
        info = checkpoint.contents
        self._data = checkpoint.data
        self.folder = self._data.root
        self.trust_pickles = trust_pickles
        self._file_of = {}
        for name, spec in self._file_specs(info.path).items():
            self._file_of[name] = info.path
            self._specs[name] = spec


def _torch_dtype(name: str):
    import torch

    table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}  # fmt: skip
    return table[name]


def read_json(path: Path) -> dict:
    """A JSON object from ``path``, or a ValueError naming the file and what is wrong with it."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path} ({exc.strerror}); fix its permissions or replace it") from None
    if not text.strip():
        raise ValueError(f"{path} is empty; restore it from the training run or delete it")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); restore it from the training run") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, expected an object; restore it")
    return data


def read_weight_map(index: Path) -> dict[str, str]:
    """An HF index's ``weight_map`` (tensor name -> shard file name), or a ValueError naming the file and the fix."""
    weight_map = read_json(index).get("weight_map")
    fix = "restore the index written with the weights"
    if not isinstance(weight_map, dict) or not weight_map:
        shown = "none" if weight_map is None else f"a {type(weight_map).__name__}"
        raise ValueError(f'{index} has no "weight_map" object of tensor name -> shard file (got {shown}); {fix}')
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ValueError(f"{index}: weight_map maps {name!r} to {shard!r}, not a shard file name; {fix}")
    return weight_map


def load_config_dict(config_dir: Path) -> dict:
    """``config_dir/config.json`` (a link only when its target is inside ``config_dir``)."""
    return read_json(ConfinedFolder(Path(config_dir)).path("config.json"))


@dataclass(frozen=True)
class SideFile:
    """A non-weight file the output carries: its name there, and the file inside its folder it is copied from."""

    name: str
    source: Path


def side_file(folder: Path, name: str) -> SideFile | None:
    """``folder/name`` when it is there; a link is followed only to a target inside ``folder`` (else
    :class:`~hf_dist.checkpoint.safety.paths.PathEscapeError` naming the link and its target); JSON is checked."""
    source = ConfinedFolder(Path(folder)).path(name)
    if not source.is_file():
        return None
    if name.endswith(".json"):
        read_json(source)  # an empty/broken file would break from_pretrained on the output
    return SideFile(name, source)


def side_files(config_dir: Path | None, tokenizer_dir: Path | None) -> list[SideFile]:
    """The generation config (from ``config_dir``) and tokenizer files (from ``tokenizer_dir``) an output carries,
    each checked before anything is written."""
    found = [side_file(config_dir, name) for name in MODEL_FILES] if config_dir is not None else []
    found += [side_file(tokenizer_dir, name) for name in TOKENIZER_FILES] if tokenizer_dir is not None else []
    return [f for f in found if f is not None]


def write_side_files(out_dir: Path, files: list[SideFile], config: dict | None, dtype: Any) -> list[str]:
    """config.json (``config`` with its dtype updated, when given) and ``files``; returns the names written."""
    written, out = [], ConfinedFolder(Path(out_dir))
    if config is not None:
        config = {**config, "dtype": str(dtype).replace("torch.", "")}
        config.pop("torch_dtype", None)
        out.path("config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
    for file in files:
        shutil.copy2(file.source, out.path(file.name))
        written.append(file.name)
    return written


def config_dir(model_config: str | Path) -> Path:
    """The folder of ``--model-config`` (a folder or its config.json); FileNotFoundError when it has no config.json."""
    path = Path(model_config)
    path = path.parent if path.name == "config.json" else path
    if not ConfinedFolder(path).is_file("config.json"):
        raise FileNotFoundError(f"--model-config {model_config}: no config.json there; pass the model's config folder")
    return path
