"""`hf-dist env`: what hf_dist sees — library versions, devices, bf16, nodes and interconnect hints."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess

EPILOG = """examples:
  hf-dist env
  hf-dist env --json
"""

PACKAGES = (
    "torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "safetensors", "huggingface_hub",
    "bitsandbytes", "trl", "hf_dist",
)  # fmt: skip
NCCL_PREFIXES = ("NCCL_", "FI_", "UCX_", "TORCH_NCCL_")


HELP = "show versions, devices, bf16 support, nodes and interconnect hints"
DESCRIPTION = "Show what hf_dist sees on this machine; paste it into bug reports."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print as JSON")


def versions() -> dict[str, str | None]:
    # package metadata, not imports: importing deepspeed alone costs seconds and may compile ops
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def interconnect(env: dict[str, str] | None = None, sys_ib: str = "/sys/class/infiniband") -> dict:
    env = os.environ if env is None else env
    ib = sorted(os.listdir(sys_ib)) if os.path.isdir(sys_ib) else []
    topo = None
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10)
            topo = done.stdout.strip() if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            topo = None
    nccl = {k: v for k, v in sorted(env.items()) if k.startswith(NCCL_PREFIXES)}
    return {"infiniband_devices": ib, "nccl_env": nccl, "nvidia_smi_topo": topo}


def collect() -> dict:
    from hf_dist.planning.hardware import detect_hardware, nodes_from_env
    from hf_dist.runtime.support import support_status

    hw = detect_hardware()
    installed = versions()
    return {
        "versions": installed,
        "outside_tested_range": {k: v for k, v in support_status(installed).items() if v},
        "hardware": hw.to_dict(),
        "nodes_from_env": nodes_from_env(),
        "interconnect": interconnect(),
    }


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("versions:")
    outside = info["outside_tested_range"]
    for name, version in info["versions"].items():
        note = f"  <- outside the tested range: {outside[name]}" if name in outside else ""
        print(f"  {name:15s} {version or 'not installed'}{note}")
    if outside:
        print("  (tested matrix: docs/testing.md; `make test-min` tests the lowest set)")
    hw = info["hardware"]
    print(f"device:        {hw['device']} x {hw['gpus_per_node']} per node, {hw['nodes']} node(s)")
    print(f"memory:        {hw['gpu_memory_gib']:.1f} GiB per {'GPU' if hw['device'] == 'cuda' else 'process'}")
    print(f"gpu name:      {hw['gpu_name'] or '-'} ({_peak(hw)})")
    print(f"bf16 / fp16:   {hw['bf16']} / {hw['fp16']}")
    print(
        f"nodes (env):   {info['nodes_from_env'] or 'not set (NNODES / WORLD_SIZE+LOCAL_WORLD_SIZE / SLURM_NNODES)'}"
    )
    net = info["interconnect"]
    print(f"infiniband:    {', '.join(net['infiniband_devices']) or 'none found in /sys/class/infiniband'}")
    print("nccl env:      " + (", ".join(f"{k}={v}" for k, v in net["nccl_env"].items()) or "none set"))
    if net["nvidia_smi_topo"]:
        print("nvidia-smi topo -m:\n" + net["nvidia_smi_topo"])
    return 0


def _peak(hw: dict) -> str:
    """The device's dense peak: a GPU's bf16 datasheet figure, or a CPU rank's measured fp32 matmul rate."""
    if hw["device"] == "cpu":
        return f"peak fp32 {hw['peak_tflops'] * 1e3:.0f} GFLOP/s per process, measured"
    return f"peak bf16 {hw['peak_tflops'] or '?'} TFLOPs"
