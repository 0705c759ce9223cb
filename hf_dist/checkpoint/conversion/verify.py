"""``hf_dist.verify``: compare two checkpoints of any supported format, tensor by tensor.

Names are mapped the way the converter maps them (wrapper prefixes removed, tied copies dropped
when a config is known), values compared in fp32 in bounded batches. ``logits=True`` also builds
both models from the config, one after the other (each filled batch by batch, so peak memory is one
fp32 model plus one batch), and compares their logits on a fixed input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.conversion import conversion_plan, transform
from hf_dist.checkpoint.conversion.convert import BATCH_BYTES, open_reader
from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint
from hf_dist.checkpoint.formats.contents import CheckpointContents
from hf_dist.checkpoint.formats.hf import config_dir
from hf_dist.checkpoint.formats.reader import Reader


@dataclass
class VerifyReport:
    a: str
    b: str
    atol: float
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    shape_mismatches: list[str] = field(default_factory=list)
    diffs: dict[str, float] = field(default_factory=dict)  # name -> max abs diff (fp32) over finite positions
    # name -> {"A": (nan count, inf count), "B": (...)} for tensors with a NaN/Inf on either side
    nonfinite: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    logits_max_diff: float | None = None
    logits_skipped: str | None = None  # why logits=True compared no logits

    @property
    def max_abs_diff(self) -> float:
        return max(self.diffs.values(), default=0.0)

    @property
    def ok(self) -> bool:
        """No missing tensor, no shape difference, no NaN/Inf anywhere (they never compare equal), diffs <= atol."""
        return (
            not self.only_in_a
            and not self.only_in_b
            and not self.shape_mismatches
            and not self.nonfinite
            and self.max_abs_diff <= self.atol
            and (self.logits_max_diff is None or self.logits_max_diff <= self.atol)  # NaN logits fail here
        )

    def summary(self) -> str:
        lines = [f"{'OK' if self.ok else 'MISMATCH'}: {self.a} vs {self.b} ({len(self.diffs)} tensors compared)"]
        if self.only_in_a:
            lines.append(f"  only in A, missing from B ({len(self.only_in_a)}): {self.only_in_a[:10]}")
        if self.only_in_b:
            lines.append(f"  only in B, missing from A ({len(self.only_in_b)}): {self.only_in_b[:10]}")
        lines += [f"  shape: {m}" for m in self.shape_mismatches[:10]]
        if len(self.shape_mismatches) > 10:
            lines.append(f"  shape: ... and {len(self.shape_mismatches) - 10} more")
        if self.nonfinite:
            lines.append(f"  non-finite values in {len(self.nonfinite)} tensor(s) (never equal):")
            for name, sides in list(self.nonfinite.items())[:10]:
                lines.append("    " + name + ": " + "; ".join(
                    f"{side} {nan} NaN, {inf} Inf" for side, (nan, inf) in sides.items()))  # fmt: skip
        worst = sorted(self.diffs.items(), key=lambda kv: -kv[1])[:5]
        lines.append(f"  max abs diff {self.max_abs_diff:.3g} (atol {self.atol:g})"
                     + ("; worst: " + ", ".join(f"{k}={v:.3g}" for k, v in worst) if worst else ""))  # fmt: skip
        if self.logits_max_diff is not None:
            lines.append(f"  logits max abs diff {self.logits_max_diff:.3g}")
        if self.logits_skipped:
            lines.append(f"  logits not compared: {self.logits_skipped}")
        return "\n".join(lines)


class _Side:
    """One checkpoint: its reader and the mapping HF name -> source name."""

    info: CheckpointContents
    reader: Reader

    def __init__(self, path: str | Path, trust_pickles: bool) -> None:
        self.info, self.reader = open_reader(open_checkpoint(path), trust_pickles=trust_pickles)
        self.names: dict[str, str] = {}

    def map_names(self, config_dir: Path | None, other: set[str] | None = None, *, trust_remote_code: bool) -> None:
        """HF name -> source name: as the converter maps them with a config, else matched to ``other``'s names."""
        specs = self.reader.specs()
        if config_dir is not None and not conversion_plan.is_peft(specs):
            expected, tied = conversion_plan.expected_specs(config_dir, trust_remote_code=trust_remote_code)
            outer = transform.choose_outer_prefix(specs, set(expected))
            self.names = {transform.rename(n, outer): n for n in specs}
            for target, source in tied.items():  # a tied copy is written once, as the converter does
                if target in self.names and source in self.names:
                    del self.names[target]
        else:
            outer = transform.choose_outer_prefix(specs, other) if other else ""
            self.names = {transform.rename(n, outer): n for n in specs}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.specs()[self.names[name]].shape

    def read(self, names: list[str]) -> dict[str, Any]:
        tensors = self.reader.read([self.names[n] for n in names])
        self.reader.release()
        return {n: tensors[self.names[n]] for n in names}


def verify(
    a: str | Path,
    b: str | Path,
    *,
    logits: bool = False,
    atol: float = 0.0,
    model_config: str | Path | None = None,
    trust_pickles: bool = False,
    trust_remote_code: bool = False,
) -> VerifyReport:
    """Compare checkpoints ``a`` and ``b``; ``report.ok`` is False on any missing key, shape, NaN/Inf or diff > atol.

    Names are mapped with one model config for both sides: ``model_config``, else the config found next to A
    or B. Without any config, sharded checkpoints whose names share nothing with the other side raise,
    asking for ``--model-config``. ``trust_remote_code=True`` lets the config's ``auto_map`` classes be imported
    (name mapping, ``logits``); without it they never are (:mod:`hf_dist.planning.remote_code`).
    """
    if not isinstance(atol, (int, float)) or isinstance(atol, bool) or not math.isfinite(atol) or atol < 0:
        raise ValueError(f"--atol must be a finite number >= 0, got {atol!r}")
    config = config_dir(model_config) if model_config is not None else None
    side_a, side_b = _Side(a, trust_pickles), _Side(b, trust_pickles)
    config = config or side_a.info.config_dir or side_b.info.config_dir
    for side in (side_a, side_b):
        side.info = replace(side.info, config_dir=config)
    trust = {"trust_remote_code": trust_remote_code}
    side_b.map_names(config, **trust)
    side_a.map_names(config, set(side_b.names), **trust)
    if config is None:
        side_b.map_names(None, set(side_a.names), **trust)
        if side_a.names and side_b.names and not set(side_a.names) & set(side_b.names):
            raise ValueError(
                f"{a} and {b} share no tensor name (e.g. {next(iter(side_a.reader.specs()))!r} vs "
                f"{next(iter(side_b.reader.specs()))!r}) and neither has a config.json next to it; pass "
                "--model-config DIR (the trained model's config folder) so both are mapped to HF names"
            )
    report = VerifyReport(str(a), str(b), atol)
    report.only_in_a = sorted(set(side_a.names) - set(side_b.names))
    report.only_in_b = sorted(set(side_b.names) - set(side_a.names))
    common = [n for n in side_a.names if n in side_b.names]
    for name in common:
        if side_a.shape(name) != side_b.shape(name):
            report.shape_mismatches.append(f"{name}: A {side_a.shape(name)} vs B {side_b.shape(name)}")
    comparable = [n for n in common if side_a.shape(n) == side_b.shape(n)]
    for batch in _batches(comparable, side_a):
        ta, tb = side_a.read(batch), side_b.read(batch)
        for name in batch:
            x, y = ta.pop(name), tb.pop(name)
            counts = {"A": _nonfinite_counts(x), "B": _nonfinite_counts(y)}
            if any(sum(c) for c in counts.values()):
                report.nonfinite[name] = counts
            report.diffs[name] = _max_abs_diff(x, y)
    if logits and report.shape_mismatches:  # one config cannot build both models
        report.logits_skipped = (
            f"{len(report.shape_mismatches)} tensor(s) differ in shape (above), so A and B are different models"
        )
    elif logits:
        report.logits_max_diff = _logits_diff(side_a, side_b, trust_remote_code=trust_remote_code)
    side_a.reader.close()
    side_b.reader.close()
    return report


def _nonfinite_counts(x: Any) -> tuple[int, int]:
    if not x.is_floating_point():
        return 0, 0
    import torch

    return int(torch.isnan(x).sum()), int(torch.isinf(x).sum())


def _batches(names: list[str], side: _Side) -> list[list[str]]:
    batches, batch, size = [], [], 0
    for name in names:
        batch.append(name)
        size += side.reader.specs()[side.names[name]].nbytes
        if size >= BATCH_BYTES:
            batches.append(batch)
            batch, size = [], 0
    return batches + ([batch] if batch else [])


def _max_abs_diff(x: Any, y: Any) -> float:
    """Max abs difference over the positions finite on both sides (non-finite ones are counted apart)."""
    if not x.is_floating_point() and not y.is_floating_point():
        return 0.0 if bool((x == y).all()) else float("inf")
    import torch

    x, y = x.detach().float(), y.detach().float()
    finite = torch.isfinite(x) & torch.isfinite(y)
    diff = (x - y).abs()[finite]
    return float(diff.max()) if diff.numel() else 0.0


def _logits_diff(side_a: _Side, side_b: _Side, *, trust_remote_code: bool) -> float:
    import torch

    config_dir = side_a.info.config_dir or side_b.info.config_dir
    if config_dir is None:
        raise ValueError("--logits needs a config.json in A or B; pass --model-config DIR")
    out = []
    for side in (side_a, side_b):
        model = _build_model(config_dir, side, trust_remote_code)
        vocab = model.config.get_text_config().vocab_size
        ids = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, vocab, (2, 16), generator=ids)
        with torch.no_grad():
            out.append(model(input_ids=input_ids).logits.float())
        del model
    return float((out[0] - out[1]).abs().max())


def _check_fits(name: str, tensor: Any, target: Any, side: _Side, config_dir: Path) -> None:
    """Refuse a tensor whose shape is not the one the config's model has, naming it (not torch's bare error)."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"{side.info.path}: tensor {name!r} has shape {tuple(tensor.shape)}, but the config in {config_dir} builds "
            f"it as {tuple(target.shape)}; --logits builds both models from one config: pass --model-config DIR "
            "with the config this checkpoint was trained with, or compare without --logits"
        )


def _build_model(config_dir: Path, side: _Side, trust_remote_code: bool):
    import torch

    from hf_dist.planning.model_source import causal_lm_from_config, load_config

    config = load_config(str(config_dir), trust_remote_code=trust_remote_code)
    model = causal_lm_from_config(config, trust_remote_code=trust_remote_code).float().eval()
    expected = model.state_dict()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for batch in _batches(list(side.names), side):
        state = side.read(batch)
        unexpected += [name for name in batch if name not in expected]
        with torch.no_grad():
            for name in batch:
                if name in expected:
                    _check_fits(name, state[name], expected[name], side, config_dir)
                    expected[name].copy_(state.pop(name))
                    loaded.add(name)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [name for name in expected if name not in loaded and name not in tied]
    if missing or unexpected:
        raise ValueError(f"{side.info.path} does not load into the config's model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")  # fmt: skip
    if tied:
        model.tie_weights()
    return model
