"""``hf_dist.convert``: any supported training checkpoint -> an HF folder, a PEFT adapter folder or DCP.

Flow: detect -> reader (specs, then tensors in bounded batches) -> plan (names, merges, checks
against the config) -> writer (shard by shard into a temporary folder renamed at the end).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.conversion import conversion_plan, transform
from hf_dist.checkpoint.conversion.gathered import checked_reader, verification_notes
from hf_dist.checkpoint.formats.checkpoint_folder import CheckpointFolder, open_checkpoint
from hf_dist.checkpoint.formats.contents import CheckpointContents
from hf_dist.checkpoint.formats.hf import config_dir, side_file
from hf_dist.checkpoint.formats.names import MANIFEST_NAME
from hf_dist.checkpoint.formats.reader import Reader, TensorSpec
from hf_dist.checkpoint.lifecycle.manifest import require_match
from hf_dist.checkpoint.output.paths import check_output_path
from hf_dist.checkpoint.safety.paths import ConfinedFolder, check_tree_confined, confined

TARGETS = ("hf", "dcp")
# Bytes of source tensors read per batch: bounds resident memory independently of --max-shard-size.
BATCH_BYTES = 64 * 1024**2


@dataclass
class ConversionReport:
    """What was read and what was written."""

    source: CheckpointContents
    dst: Path
    to: str
    kind: str
    dtype: str
    num_tensors: int
    num_params: int
    total_bytes: int
    files: list[str] = field(default_factory=list)
    dropped_tied: list[str] = field(default_factory=list)
    seconds: float = 0.0
    unverified: str = ""  # why the content read could not be shown to be what the run wrote (no manifest)
    checked: str = ""  # what the content read was compared with instead (gathered weights beside the rank files)

    def summary(self) -> str:
        lines = [
            f"read:  {self.source.describe()}",
            f"wrote: {self.kind} {self.to.upper()} folder {self.dst}: {self.num_tensors} tensors, "
            f"{self.num_params:,} parameters, {self.total_bytes / 1e9:.3f} GB {self.dtype}, "
            f"{len(self.files)} file(s) in {self.seconds:.1f} s",
        ]
        if self.dropped_tied:
            lines.append(f"tied:  {', '.join(self.dropped_tied)} written once (tied to its source)")
        if self.checked:
            lines.append(f"checked: {self.checked}")
        if self.unverified:
            lines.append(f"note:  {self.unverified}")
        return "\n".join(lines)


def open_reader(
    checkpoint: CheckpointFolder, *, config: Path | None = None, trust_pickles: bool = False
) -> tuple[CheckpointContents, Reader]:
    """The reader of the checkpoint's format, once no link in it leads outside it (every file a reader opens is then
    inside: the names come from listing the folder, DeepSpeed's ``latest`` and DCP's metadata are confined where they
    are read) and it matches its manifest, and its layout refined by what the reader found (``Reader.found``;
    ``config``: the model config folder the user named, in place of the one found beside the checkpoint)."""
    info = checkpoint.contents if config is None else replace(checkpoint.contents, config_dir=config)
    if info.path.is_file():
        confined(info.path, checkpoint.root)
    else:  # the Trainer checkpoint around the folder holds it (swap files, DeepSpeed tags)
        check_tree_confined(checkpoint.root)
        require_match(checkpoint)  # a checkpoint with a manifest is read only as it was written
    reader = _reader(replace(checkpoint, contents=info), trust_pickles)
    return replace(info, **reader.found), reader


def _reader(checkpoint: CheckpointFolder, trust_pickles: bool) -> Reader:
    info = checkpoint.contents
    if info.format == "deepspeed" and info.tp_size > 1:
        from hf_dist.checkpoint.formats.autotp import AutoTPReader

        return AutoTPReader(checkpoint, trust_pickles=trust_pickles)
    if info.format == "deepspeed":
        from hf_dist.checkpoint.formats.deepspeed import DeepSpeedReader

        return DeepSpeedReader(checkpoint, trust_pickles=trust_pickles)
    if info.format == "dcp":
        from hf_dist.checkpoint.formats.dcp import DCPReader

        return DCPReader(checkpoint, trust_pickles=trust_pickles)
    from hf_dist.checkpoint.formats.hf import HFReader, TorchFileReader

    cls = TorchFileReader if info.format == "fsdp_full" else HFReader
    return cls(checkpoint, trust_pickles=trust_pickles)


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str = "auto",
    max_shard_size: int | str = "5GB",
    model_config: str | Path | None = None,
    tokenizer: str | Path | None = None,
    tag: str | None = None,
    adapter: bool = False,
    merge_adapter: bool = False,
    overwrite: bool = False,
    to: str = "hf",
    trust_pickles: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> ConversionReport:
    """Convert the checkpoint at ``src`` into ``dst`` (see ``hf-dist convert --help``).

    ``trust_remote_code=True`` lets the model config's ``auto_map`` classes be imported to learn the expected
    tensor names; without it they never are (:func:`~hf_dist.checkpoint.conversion.conversion_plan.expected_specs`).
    """
    start = time.perf_counter()
    _check_arguments(dtype, to, adapter, merge_adapter)
    dst = check_output_path(dst, sources=[src], overwrite=overwrite)
    checkpoint = open_checkpoint(src, tag=tag)
    sources = (src, checkpoint.contents.path, checkpoint.root)
    check_output_path(dst, sources=sources, overwrite=overwrite)
    config = config_dir(model_config) if model_config is not None else None
    info, reader = open_reader(checkpoint, config=config, trust_pickles=trust_pickles)
    try:
        specs = reader.specs()
        info = replace(info, num_params=sum(s.numel for s in specs.values()))
        conversion = _plan(
            info, specs, adapter=adapter, merge_adapter=merge_adapter, trust_remote_code=trust_remote_code
        )
        out_specs = _output_specs(conversion, reader.train_dtype, dtype)
        if unverified := _unverified(checkpoint):
            reader = checked_reader(checkpoint, reader, _unchanged_sources(conversion), trust_pickles=trust_pickles)
        if to == "dcp":
            from hf_dist.checkpoint.write.dcp import write_dcp

            files = write_dcp(dst, out_specs, _tensor_stream(reader, conversion, out_specs), overwrite=overwrite,
                              sources=sources)  # fmt: skip
        else:
            files = _write_hf(info, reader, conversion, out_specs, dst, max_shard_size, tokenizer, overwrite, progress)
    finally:
        reader.close()
    report = _report(info, dst, to, conversion, out_specs, files, time.perf_counter() - start)
    report.checked, report.unverified = verification_notes(reader, unverified, report.num_tensors)
    return report


def _unchanged_sources(conversion: Any) -> dict[str, str]:
    """The source of each output tensor built from one source tensor without a merge -> the output's name."""
    return {t.sources[0]: out for out, t in conversion.tensors.items() if t.merge is None and len(t.sources) == 1}


def _output_specs(conversion: Any, train_dtype: Any, dtype: str) -> dict[str, TensorSpec]:
    """Each output tensor's shape and dtype: floats in ``dtype`` (``auto``: the training dtype), the rest as stored."""
    return {
        name: TensorSpec(t.shape, transform.output_dtype(dtype, train_dtype, t.stored_dtype)
                         if _is_float(t.stored_dtype) else t.stored_dtype)
        for name, t in conversion.tensors.items()
    }  # fmt: skip


def _report(
    info: Any, dst: Path, to: str, conversion: Any, out_specs: dict, files: Any, seconds: float
) -> ConversionReport:
    out_dtypes = sorted({str(s.dtype).replace("torch.", "") for s in out_specs.values()})
    return ConversionReport(
        source=info,
        dst=dst,
        to=to,
        kind=conversion.kind,
        dtype="/".join(out_dtypes),
        num_tensors=len(out_specs),
        num_params=sum(s.numel for s in out_specs.values()),
        total_bytes=sum(s.nbytes for s in out_specs.values()),
        files=files,
        dropped_tied=conversion.dropped_tied,
        seconds=seconds,
    )


def _unverified(checkpoint: CheckpointFolder) -> str:
    """What a sharded checkpoint without hf_dist's manifest leaves unproven: each file's length and header are
    checked, but not that the files are the ones the run wrote (the manifest's hashes would show that)."""
    info = checkpoint.contents
    if info.format not in ("deepspeed", "dcp") or info.path.is_file() or checkpoint.manifest.present:
        return ""  # a manifest: open_reader matched every file to it (or refused it)
    return (
        f"not verified: {info.root} has no {MANIFEST_NAME} (written under hf_dist.callbacks.attach), so nothing shows "
        "its rank files are the ones the run wrote; lengths and headers were checked, but two ranks' files exchanged, "
        "or a partition overwritten with as many other values, convert as read"
    )


def _check_arguments(dtype: str, to: str, adapter: bool, merge_adapter: bool) -> None:
    if dtype not in transform.DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {transform.DTYPES}")
    if to not in TARGETS:
        raise ValueError(f"to={to!r} is not supported; use one of {TARGETS}")
    if adapter and merge_adapter:
        raise ValueError("--adapter and --merge-adapter exclude each other: write the adapter or the merged model")
    if to == "dcp" and adapter:
        raise ValueError("--to dcp writes a full model; drop --adapter (or use --merge-adapter)")


def _is_float(dtype: Any) -> bool:
    return dtype.is_floating_point


def _plan(info: CheckpointContents, specs: dict[str, TensorSpec], *, adapter: bool, merge_adapter: bool,
          trust_remote_code: bool):  # fmt: skip
    peft = conversion_plan.is_peft(specs)
    if (adapter or merge_adapter) and not peft:
        raise ValueError(f"--adapter/--merge-adapter given but {info.path} holds no PEFT/LoRA tensors")
    if peft and not (adapter or merge_adapter):
        raise ValueError(
            f"{info.path} holds a PEFT (LoRA) model; pass --adapter to write the adapter folder or "
            "--merge-adapter to write the merged full model"
        )
    if adapter:
        return conversion_plan.adapter_plan(specs)
    if info.config_dir is None:
        raise ValueError(
            f"no config.json found in or next to {info.path}; pass --model-config DIR (a folder with the "
            "trained model's config.json)"
        )
    expected, tied = conversion_plan.expected_specs(info.config_dir, trust_remote_code=trust_remote_code)
    if merge_adapter:
        return conversion_plan.merged_plan(specs, expected, tied, _adapter_config(info))
    return conversion_plan.model_plan(specs, expected, tied)


def _adapter_config(info: CheckpointContents) -> dict:
    path = _find_adapter_config(info)
    if path is None:
        raise ValueError(f"no adapter_config.json found next to {info.path}; copy the run's adapter_config.json there")
    from hf_dist.checkpoint.formats.hf import read_json

    return read_json(path)


def _find_adapter_config(info: CheckpointContents) -> Path | None:
    near = (info.path if info.path.is_dir() else info.path.parent, info.root, info.root.parent)
    for directory in (*((info.config_dir,) if info.config_dir is not None else ()), *near):
        if side := side_file(directory, "adapter_config.json"):
            return side.source
    return None


def _tensor_stream(reader: Reader, conversion, out_specs: dict[str, TensorSpec], names: list[str] | None = None,
                   *, as_ranges: bool = False) -> Iterator[tuple[str, Any]]:  # fmt: skip
    """Output tensors in ``names`` order, read in batches of at most BATCH_BYTES, cast to the output dtype.

    With ``as_ranges``, a tensor written unchanged whose bytes the reader can locate comes as
    :class:`~hf_dist.checkpoint.write.hf_folder.FileRanges` instead (nothing read; the writer copies the bytes).
    """
    from hf_dist.checkpoint.write.hf_folder import FileRanges

    names = list(out_specs) if names is None else names
    batch: list[str] = []
    size = 0
    for name in names:
        ranges = _unchanged_ranges(reader, conversion.tensors[name], out_specs[name]) if as_ranges else None
        if ranges is not None:
            if batch:
                yield from _read_batch(reader, conversion, out_specs, batch)
                batch, size = [], 0
            yield name, FileRanges(ranges)
            continue
        batch.append(name)
        size += sum(reader.specs()[s].nbytes for s in conversion.tensors[name].sources)
        if size >= BATCH_BYTES:
            yield from _read_batch(reader, conversion, out_specs, batch)
            batch, size = [], 0
    if batch:
        yield from _read_batch(reader, conversion, out_specs, batch)


def _unchanged_ranges(reader: Reader, out, spec: TensorSpec) -> list[tuple[str, int, int]] | None:
    if out.merge is not None or len(out.sources) != 1:
        return None
    stored = reader.specs()[out.sources[0]]
    if stored.dtype != spec.dtype or stored.shape != spec.shape:
        return None
    return reader.byte_ranges(out.sources[0])


def _read_batch(reader: Reader, conversion, out_specs, batch: list[str]) -> Iterator[tuple[str, Any]]:
    sources = [s for name in batch for s in conversion.tensors[name].sources]
    tensors = reader.read(sources)
    reader.release()
    for name in batch:
        out = conversion.tensors[name]
        if out.merge is not None:
            value = out.merge.merge(*(tensors.pop(s) for s in out.sources))
        else:
            value = tensors.pop(out.sources[0])
        yield name, transform.cast(value, out_specs[name].dtype)


def prefetch(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """Yield ``items`` produced by a background thread up to ``depth`` items ahead.

    Reading the next tensors (file reads, memcpy, casts: all release the GIL) then overlaps with
    writing the current one, so the conversion costs about max(read, write) instead of their sum.
    Memory grows by at most ``depth`` tensors. Errors are re-raised here; if the consumer stops
    early, the producer stops at its next item.
    """
    import queue
    import threading

    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((None, item)):
                    return
            put((None, done))
        except BaseException as exc:  # handed to the consumer, raised there
            put((exc, None))

    thread = threading.Thread(target=produce, name="hf_dist-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            error, item = slots.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        thread.join()


def _write_hf(info, reader, conversion, out_specs, dst, max_shard_size, tokenizer, overwrite, progress) -> list[str]:
    from hf_dist.checkpoint.formats.hf import load_config_dict, side_files, write_side_files
    from hf_dist.checkpoint.write.hf_folder import atomic_output_dir, write_hf_weights

    total = sum(s.nbytes for s in out_specs.values())
    weights_name = "adapter_model.safetensors" if conversion.kind == "adapter" else "model.safetensors"
    bar = _progress_bar(total, progress, f"writing {dst.name}")
    tokenizer_dir = Path(tokenizer) if tokenizer is not None else (info.config_dir or info.root)
    if tokenizer is not None and not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"--tokenizer {tokenizer} is not a folder")
    adapter = conversion.kind == "adapter"
    # every side file checked (links confined to their folder) before anything is written
    side = side_files(None if adapter else info.config_dir, tokenizer_dir)
    config = _adapter_config(info) if adapter else load_config_dict(info.config_dir)
    sources = (info.path, info.root)
    with atomic_output_dir(dst, overwrite=overwrite, needed_bytes=total, sources=sources) as tmp:
        files = write_hf_weights(
            tmp,
            out_specs,
            lambda names: prefetch(_tensor_stream(reader, conversion, out_specs, names, as_ranges=True)),
            max_shard_size=max_shard_size,
            weights_name=weights_name,
            progress=bar.update if bar else None,
        )
        if adapter:
            ConfinedFolder(tmp).path("adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
            files.append("adapter_config.json")
            files += write_side_files(tmp, side, None, None)
        else:
            dtype = next((s.dtype for s in out_specs.values() if s.dtype.is_floating_point), None)
            files += write_side_files(tmp, side, config, dtype)
    if bar:
        bar.close()
    return files


def _progress_bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not sys.stderr.isatty())
