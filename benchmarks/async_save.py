"""The training stall per checkpoint save: the Trainer's synchronous save against hf_dist's ``async_save``.

    python benchmarks/async_save.py                       # FSDP2 on 2 CPU ranks, a 551M-parameter Llama, ~6 min
    python benchmarks/async_save.py --strategy ddp --layers 4

Three runs of the same training (``torchrun``, 2 ranks over gloo, one core each): without saves, with the
Trainer's saves, with ``attach(trainer, async_save=True)``; ``--saves`` saves each, one every ``--save-steps``
steps. The stall per save is what a run with saves took longer than the run without, divided by the saves: it
counts the time the training thread was held (the whole save, or async's staging copy) and whatever the
background writes took from the steps after it (cores, disk, memory bandwidth). The table also gives the
time inside ``_save_checkpoint``, the bytes staged per rank and each rank's peak resident memory (ru_maxrss).
The model is large enough that the save dominates a step: fp32 weights and AdamW's two moments, 12 bytes a
parameter, written with fsync (DCP's default; the background writer fsyncs every file it renames into place).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("no saves", "sync", "async")


def worker(opts: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_dist.callbacks import AsyncCheckpointCallback, attach, default
    from hf_dist.runtime.dist import rank, shutdown
    from hf_dist.testing import TokenDataset

    kwargs = {"use_cpu": True}
    if opts.strategy == "fsdp":
        from hf_dist.configs.fsdp import fsdp_config
        from hf_dist.runtime.cpu_fsdp import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
        kwargs.update(fsdp_config("fsdp_full_shard", wrap_classes=["LlamaDecoderLayer"], mixed_precision="no"))
    config = LlamaConfig(hidden_size=1536, intermediate_size=4096, num_hidden_layers=opts.layers,
                         num_attention_heads=12, num_key_value_heads=12, vocab_size=32000)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    steps = (opts.saves + 1) * opts.save_steps - 1  # each save is followed by save_steps - 1 steps or more
    args = TrainingArguments(
        **kwargs, output_dir=opts.out, max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-5,
        save_strategy="no" if opts.mode == "no saves" else "steps", save_steps=opts.save_steps,
        save_total_limit=2, report_to=[], disable_tqdm=True, logging_steps=1, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(64, seq=opts.seq, vocab=32000))
    callbacks = attach(trainer, default(async_save=opts.mode == "async"))
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            time.sleep(opts.host_idle_s)  # the host's wait for a GPU step: cores idle, as on a GPU node

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    trainer.add_callback(StepClock())
    held: list[float] = []
    save = trainer._save_checkpoint  # the async callback wrapped it already; time what the training thread waits

    def timed_save(*a, **k):
        start = time.perf_counter()
        save(*a, **k)
        held.append(time.perf_counter() - start)

    trainer._save_checkpoint = timed_save
    trainer.train()
    background = next((c for c in callbacks if isinstance(c, AsyncCheckpointCallback)), None)
    result = {
        "staged_bytes": background and background.staged_bytes,
        "written_s": background and background.written_s,
        "train_s": times[-1] - times[0],  # from the end of step 1 (warm) to the end of the last step
        "held_s": held,
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": sum(p.numel() for p in model.parameters()),  # a DTensor's numel is the whole parameter's
    }
    Path(opts.out, f"result_{rank()}.json").write_text(json.dumps(result))
    shutdown()


def run(mode: str, opts: argparse.Namespace, root: Path) -> list[dict]:
    out = root / mode.replace(" ", "_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, "--worker",
           "--mode", mode, "--out", str(out), "--strategy", opts.strategy, "--layers", str(opts.layers),
           "--seq", str(opts.seq), "--saves", str(opts.saves), "--save-steps", str(opts.save_steps),
           "--host-idle-s", str(opts.host_idle_s)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"}
    print(f"  {mode} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the {mode!r} run failed (exit code {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"result_{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of hidden 1536 (16: 551M parameters)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=6, help="steps between saves (the writes overlap them)")
    parser.add_argument("--host-idle-s", type=float, default=0.0,
                        help="each step first sleeps this long: the host CPU idle while a GPU would compute")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        return worker(opts)
    with tempfile.TemporaryDirectory(prefix="hf_dist_async_save_") as tmp:
        results = {mode: run(mode, opts, Path(tmp)) for mode in MODES}
    base = max(r["train_s"] for r in results["no saves"])
    params = results["no saves"][0]["params"]
    print(f"{opts.strategy}, 2 CPU ranks, {params / 1e6:.0f}M parameters, {opts.saves} saves "
          f"(one every {opts.save_steps} steps), host idle {opts.host_idle_s} s a step\n")  # fmt: skip
    print(
        f"{'':10} {'train s':>8} {'stall/save s':>13} {'in save s':>10} {'staged GiB/rank':>16} {'peak RSS GiB/rank':>18}"
    )
    stall = {}
    for mode, ranks in results.items():
        train = max(r["train_s"] for r in ranks)
        stall[mode] = (train - base) / opts.saves if mode != "no saves" else 0.0
        held = max(sum(r["held_s"]) for r in ranks) / opts.saves if mode != "no saves" else 0.0
        staged = "-" if ranks[0]["staged_bytes"] is None else f"{max(r['staged_bytes'] for r in ranks) / 2**30:.2f}"
        rss = max(r["maxrss_bytes"] for r in ranks) / 2**30
        print(f"{mode:10} {train:8.1f} {stall[mode]:13.2f} {held:10.2f} {staged:>16} {rss:18.2f}")
    print(f"\nasync stall / sync stall: {stall['async'] / stall['sync']:.3f} (target <= 0.10)")


if __name__ == "__main__":
    main()
