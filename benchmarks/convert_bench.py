"""Checkpoint conversion, side by side: hf-dist vs DeepSpeed's zero_to_fp32.py vs accelerate merge-weights.

Usage:
    python benchmarks/convert_bench.py --work /tmp/convert-bench            # ~150M and ~500M Llama
    python benchmarks/convert_bench.py --work /tmp/cb --sizes 150M --runs 1 # quick look

For each size it trains a Llama for 1 step on 2 CPU ranks and saves (a) a ZeRO-3 checkpoint with
deepspeed directly and (b) an FSDP2 sharded DCP checkpoint (accelerate's layout). Each is then
converted to fp32 safetensors by:

* ``hf-dist convert SRC DST --dtype fp32``
* ZeRO-3: ``python SRC/zero_to_fp32.py SRC DST --safe_serialization`` (the script DeepSpeed ships
  into every checkpoint); FSDP2: ``accelerate merge-weights SRC DST``
* the floor no converter can beat: ``cp -r`` of the hf-dist output + ``python -c "import torch, safetensors"``

Wall time and peak RSS (``/usr/bin/time -f %M``, the whole process) are medians of ``--runs`` runs
with the page cache warm (one unmeasured run first). Ratios are against the other tool and the floor.
Files are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "distributed" / "scripts"
SIZES = {  # name -> (hidden, intermediate, layers); vocab 32000, untied, head_dim 64: 148M and 494M params
    "150M": (768, 2048, 14),
    "500M": (1536, 4096, 14),
}


def make_checkpoints(work: Path, size: str) -> tuple[Path, Path]:
    from hf_dist.testing import torchrun

    hidden, inter, layers = SIZES[size]
    shape = ["--hidden", hidden, "--intermediate", inter, "--layers", layers, "--steps", 1, "--no-reference"]
    ds_root = work / f"ds-{size}"
    if not (ds_root / "z3" / "ds" / "latest").is_file():
        torchrun(SCRIPTS / "convert_make_deepspeed.py", [ds_root, "z3:3:fp32", *shape], timeout=3000)
    fsdp_root = work / f"fsdp-{size}"
    if not (fsdp_root / "checkpoint-1").is_dir():
        torchrun(SCRIPTS / "convert_make_fsdp.py", [fsdp_root, *shape], timeout=3000)
    return ds_root / "z3" / "ds", fsdp_root / "checkpoint-1"


def measure(cmd: list[str] | str, out: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS GB) of one run; ``out`` is removed before."""
    shutil.rmtree(out, ignore_errors=True)
    out.unlink(missing_ok=True) if out.is_file() else None
    shell = isinstance(cmd, str)
    timed = ["/usr/bin/time", "-f", "%M", "--", *(["bash", "-c", cmd] if shell else cmd)]
    start = time.perf_counter()
    proc = subprocess.run(timed, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    peak_kb = int(proc.stderr.strip().splitlines()[-1])
    return wall, peak_kb / 1024**2


def median_of(cmd, out: Path, runs: int) -> tuple[float, float]:
    measure(cmd, out)  # warm the page cache and the import caches
    results = [measure(cmd, out) for _ in range(runs)]
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def bench_size(work: Path, size: str, runs: int) -> list[dict]:
    ds_ckpt, fsdp_ckpt = make_checkpoints(work, size)
    py = sys.executable
    rows = []
    for label, src, tool_name, tool_cmd in (
        ("ZeRO-3", ds_ckpt, "zero_to_fp32.py", [py, str(ds_ckpt / "zero_to_fp32.py"), str(ds_ckpt), "{out}",
                                                 "--safe_serialization"]),
        ("FSDP2 DCP", fsdp_ckpt, "accelerate merge-weights", [py, "-m", "accelerate.commands.accelerate_cli",
                                                              "merge-weights", str(fsdp_ckpt / "pytorch_model_fsdp_0"), "{out}"]),
    ):  # fmt: skip
        ours_out, tool_out, floor_out = work / "out-ours", work / "out-tool", work / "out-floor"
        ours = median_of([py, "-m", "hf_dist.cli.main", "convert", str(src), str(ours_out), "--dtype", "fp32",
                          "--no-progress"], ours_out, runs)  # fmt: skip
        tool = median_of([a.replace("{out}", str(tool_out)) for a in tool_cmd], tool_out, runs)
        shutil.rmtree(ours_out, ignore_errors=True)
        convert_once = [
            py,
            "-m",
            "hf_dist.cli.main",
            "convert",
            str(src),
            str(ours_out),
            "--dtype",
            "fp32",
            "--no-progress",
        ]
        subprocess.run(convert_once, check=True, capture_output=True)
        floor = median_of(f"cp -r {ours_out} {floor_out} && {py} -c 'import torch, safetensors'", floor_out, runs)
        out_gb = sum(p.stat().st_size for p in ours_out.iterdir()) / 1e9
        rows.append(
            dict(size=size, format=label, tool=tool_name, ours=ours, tool_result=tool, floor=floor, out_gb=out_gb)
        )
        for path in (ours_out, tool_out, floor_out):
            shutil.rmtree(path, ignore_errors=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        "| checkpoint | output | hf-dist | other tool | floor | hf-dist / tool (time, RSS) | hf-dist / floor (time) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        (ot, orss), (tt, trss), (ft, frss) = r["ours"], r["tool_result"], r["floor"]
        print(f"| {r['format']} {r['size']} | {r['out_gb']:.2f} GB fp32 | {ot:.1f} s, {orss:.2f} GB | "
              f"{r['tool']}: {tt:.1f} s, {trss:.2f} GB | {ft:.1f} s, {frss:.2f} GB | "
              f"{ot / tt:.2f}x, {orss / trss:.2f}x | {ot / ft:.2f}x |")  # fmt: skip
    by_format: dict[str, list[dict]] = {}
    for r in rows:
        by_format.setdefault(r["format"], []).append(r)
    for fmt, items in by_format.items():
        if len(items) >= 2:
            small, large = items[0], items[-1]
            print(f"hf-dist peak RSS growth {fmt} {small['size']} -> {large['size']}: "
                  f"{large['ours'][1] / small['ours'][1]:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf-dist-convert-bench"))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep checkpoints and outputs")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for size in args.sizes:
            rows += bench_size(args.work, size, args.runs)
            print_table(rows)
            sys.stdout.flush()
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    print(f"\ncommand: python benchmarks/convert_bench.py --sizes {' '.join(args.sizes)} --runs {args.runs}")


if __name__ == "__main__":
    main()
