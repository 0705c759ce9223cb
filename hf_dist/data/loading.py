"""Local datasets for the recipes: JSONL, JSON, Parquet, CSV files or a ``save_to_disk`` folder.

Errors are raised before any model is built: a missing path, an unknown file type and missing
columns (listing the columns found and the ones a recipe accepts) each say what to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# file suffix -> `datasets` builder name
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

# recipe kind -> accepted column sets, in order of preference
EXPECTED_COLUMNS = {
    "chat": (("messages",), ("prompt", "completion")),
    "text": (("text",),),
}


def load_local_dataset(path: str | Path, *, split: str = "train") -> Any:
    """A ``datasets.Dataset`` (``split``) from a local file, a folder of such files or a saved dataset folder."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"dataset {str(path)!r} does not exist; pass a .jsonl/.json/.parquet/.csv file, a folder of them, "
            "or a folder written by datasets' save_to_disk"
        )
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"saved dataset {str(path)!r} has splits {list(loaded)}, not {split!r}")
            return loaded[split]
        return loaded
    files = sorted(p for p in path.iterdir() if p.suffix in BUILDERS) if path.is_dir() else [path]
    suffixes = {p.suffix for p in files}
    if not files or len({BUILDERS.get(s) for s in suffixes}) != 1 or None in {BUILDERS.get(s) for s in suffixes}:
        raise ValueError(
            f"dataset {str(path)!r}: cannot infer the format from {sorted(suffixes) or 'an empty folder'}; "
            f"supported: {sorted(BUILDERS)} (one kind per folder) or a datasets save_to_disk folder"
        )
    builder = BUILDERS[files[0].suffix]
    return datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")


def matching_columns(column_names: list[str], kind: str) -> tuple[str, ...]:
    """The first accepted column set for ``kind`` present in ``column_names``, else a ValueError listing both."""
    if kind not in EXPECTED_COLUMNS:
        raise ValueError(f"kind={kind!r} is not one of {sorted(EXPECTED_COLUMNS)}")
    for columns in EXPECTED_COLUMNS[kind]:
        if all(c in column_names for c in columns):
            return columns
    wanted = " or ".join(repr(list(cols)) for cols in EXPECTED_COLUMNS[kind])
    tokenized = ""
    if "input_ids" in column_names:  # pre-tokenized (or packed) rows: the recipe tokenizes and packs text itself
        state = "packed" if "position_ids" in column_names else "tokenized"
        tokenized = (
            f" (this one is already {state}: the recipe renders, tokenizes and packs the text itself; for rows you "
            "tokenized, use hf_dist.data.pack and PackedCollator in your own script, docs/recipes.md)"
        )
    raise ValueError(f"dataset has columns {sorted(column_names)}; this recipe expects {wanted}{tokenized}")


def to_messages(example: dict[str, Any], columns: tuple[str, ...]) -> list[dict[str, str]]:
    """An example's conversation, from a ``messages`` column or a ``prompt``/``completion`` pair."""
    if columns == ("messages",):
        return example["messages"]
    return [{"role": "user", "content": example["prompt"]}, {"role": "assistant", "content": example["completion"]}]


def split_eval(dataset: Any, eval_fraction: float, *, seed: int) -> tuple[Any, Any]:
    """(train, eval) by holding out ``eval_fraction`` of the rows (at least 1, at most 1000)."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")
    if len(dataset) < 2:
        raise ValueError(f"dataset has {len(dataset)} rows; at least 2 are needed to hold one out for eval")
    num_eval = min(1000, max(1, int(len(dataset) * eval_fraction)))
    parts = dataset.train_test_split(test_size=num_eval, seed=seed, shuffle=True)
    return parts["train"], parts["test"]
