"""Packed chat data against padded, and against TRL's own packing: real tokens/s, steps per epoch, peak RSS.

    nice -n 5 python benchmarks/packing.py

(issue 37, item 6; docs/recipes.md "Packing: measured" records a run). Needs the ``bench`` extra
(``pip install -e .[bench]``: the corpus package ``chitchat-dataset`` and ``trl``).

The corpus is ``chitchat-dataset`` 0.9.0 from PyPI: human two-person conversations of BYU's Chit-Chat Challenge. Each
conversation's first sender is the user, the other the assistant; consecutive messages of one sender are one turn
(joined by newlines), empty texts are dropped and conversations with >= 2 turns kept (4,017). The model is a small
Llama built from a config (no hub) with hf_dist's character-level tokenizer (``hf_dist.data.build_tokenizer``), so a
token is about a character. On 2 CPU ranks (``torchrun --standalone --nproc_per_node 2``), one after another:

- ``recipe packed``: ``recipes/sft.py --dataset chat.jsonl`` (whole conversations packed best-fit-decreasing into
  ``--seq-len`` rows, ``hf_dist.data.PackedCollator``);
- ``recipe padded``: the same with ``--packing false`` (each micro-batch padded to its longest conversation);
- ``TRL packed``: ``trl.SFTTrainer`` with ``SFTConfig(packing=True, packing_strategy="bfd", padding_free=True)`` on
  the same conversations and the same model folder (fp32, as the recipe on CPU; loss on the whole sequence, since
  the template has no generation markers for ``assistant_only_loss``: the computed tokens are the same).

Every run trains ``--steps`` optimizer steps at micro-batch ``--micro-batch`` per rank, no accumulation. Each rank
counts the real (non-pad) tokens of every batch its collator builds (``hf_dist.data.real_tokens``: the ones of the
attention mask, or all but each packed row's padding sequence) and the token slots it computes (``input_ids``), and
stamps the end of every step; real tokens/s is the real tokens of the steps after ``--warmup`` summed over the ranks,
over the slowest rank's wall time for those steps. Steps per epoch come from the rows of each run's own training
dataset (``ceil(rows / (micro-batch x 2 ranks))``); the fill (real / computed tokens) from the data for the whole
epoch and as measured in the timed steps. Peak RSS is each rank's ``ru_maxrss`` at the end of training (the larger
of the two ranks). The table is printed and written with everything else to ``benchmarks/data/packing.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "data" / "packing.json"
RANKS = 2
RUNS = ("recipe packed", "recipe padded", "TRL packed")


# ---------------------------------------------------------------- the corpus


def load_conversations() -> list[list[dict[str, str]]]:
    """chitchat-dataset's conversations with >= 2 turns as ``messages`` lists (user = first sender)."""
    import chitchat_dataset

    path = os.path.join(os.path.dirname(chitchat_dataset.__file__), "dataset.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    conversations = []
    for key in sorted(data):
        turns: list[dict[str, str]] = []
        first = None
        for group in data[key]["messages"]:
            texts = [m["text"].strip() for m in group if isinstance(m.get("text"), str) and m["text"].strip()]
            if not texts:
                continue
            sender = group[0]["sender"]
            first = sender if first is None else first
            role = "user" if sender == first else "assistant"
            if turns and turns[-1]["role"] == role:
                turns[-1]["content"] += "\n" + "\n".join(texts)
            else:
                turns.append({"role": role, "content": "\n".join(texts)})
        if len(turns) >= 2:
            conversations.append(turns)
    return conversations


def data_stats(conversations, tokenizer, seq_len: int, micro_batch: int) -> dict:
    """Token lengths (cut to ``seq_len``, as the recipe cuts) and the fill / steps per epoch they allow."""
    from hf_dist.data import IGNORE_INDEX, fill, tokenize_chat

    lengths, full = [], []
    for messages in conversations:
        enc = tokenize_chat(tokenizer, messages, None)
        full.append(len(enc["input_ids"]))
        if any(t != IGNORE_INDEX for t in enc["labels"][:seq_len]):  # else dropped by the recipe: nothing to learn
            lengths.append(min(len(enc["input_ids"]), seq_len))
    cut = sum(n > seq_len for n in full)
    full.sort()
    f = fill(lengths, seq_len, micro_batch)
    pct = {p: full[min(len(full) - 1, int(p / 100 * len(full)))] for p in (10, 50, 90)}
    return {
        "conversations": len(conversations),
        "kept": len(lengths),
        "cut_to_seq_len": cut,
        "dropped_no_assistant_token": len(conversations) - len(lengths),
        "tokens_p10_p50_p90_untruncated": [pct[10], pct[50], pct[90]],
        "real_tokens": int(f["real_tokens"]),
        "padded_fill": float(f["padded_fill"]),
        "packed_fill": float(f["packed_fill"]),
        "padded_steps_per_epoch": math.ceil(len(lengths) / (micro_batch * RANKS)),
        "packed_steps_per_epoch": math.ceil(f["packed_batches"] * micro_batch / (micro_batch * RANKS)),
    }


# ---------------------------------------------------------------- the ranks (torchrun runs this file with --worker)


class _Counting:
    """A data collator that records each batch's real tokens and computed token slots, in order."""

    def __init__(self, base, record: dict) -> None:
        self.base, self.record = base, record

    def __call__(self, features):
        from hf_dist.data import real_tokens

        batch = self.base(features)
        self.record["real"].append(int(real_tokens(batch)))
        self.record["slots"].append(int(batch["input_ids"].numel()))
        return batch


def _instrument(trainer, out: Path) -> None:
    """Count the batches, stamp the steps, and write this rank's record at the end of training."""
    import resource

    import torch
    from transformers import TrainerCallback

    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "real": [], "slots": [], "step_end": [], "rows": len(trainer.train_dataset)}
    trainer.data_collator = _Counting(trainer.data_collator, record)

    class Stamp(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            record["train_begin"] = time.perf_counter()
            record["bf16"], record["dtype"] = bool(args.bf16), str(next(model.parameters()).dtype)
            record["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
            record["micro_batch"], record["accumulation"] = (
                args.per_device_train_batch_size,
                args.gradient_accumulation_steps,
            )
            record["world"], record["threads"] = args.world_size, torch.get_num_threads()

        def on_step_end(self, args, state, control, **kwargs):
            record["step_end"].append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            record["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps(record))

    trainer.add_callback(Stamp())


def worker_recipe(out: Path, recipe_argv: list[str]) -> None:
    """recipes/sft.py's ``main`` with its Trainer instrumented (nothing else of the recipe changed)."""
    import importlib.util

    import hf_dist.recipe_utils as ru

    make_trainer = ru.make_trainer

    def instrumented(*args, **kwargs):
        trainer = make_trainer(*args, **kwargs)
        _instrument(trainer, out)
        return trainer

    ru.make_trainer = instrumented
    spec = importlib.util.spec_from_file_location("sft_recipe", ROOT / "recipes" / "sft.py")
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    ru.run_recipe(lambda: sft.main(recipe_argv))


def worker_trl(out: Path, model_dir: str, dataset: str, seq_len: int, micro_batch: int, steps: int, run_dir: str):
    """TRL's SFTTrainer with its own best-fit-decreasing packing and padding-free batches."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from hf_dist.runtime.dist import shutdown

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    config = SFTConfig(
        output_dir=run_dir, max_steps=steps, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=1,
        packing=True, packing_strategy="bfd", padding_free=True, max_length=seq_len, assistant_only_loss=False,
        use_cpu=True,  # without it transformers trains each torchrun rank alone on CPU (hf_dist.runtime.cpu_fsdp)
        bf16=False, learning_rate=2e-5, lr_scheduler_type="cosine", warmup_steps=0.03, save_strategy="no",
        eval_strategy="no", logging_steps=steps, report_to="none", seed=42,
    )  # fmt: skip
    train = load_dataset("json", data_files=dataset, split="train")
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    _instrument(trainer, out)
    trainer.train()
    shutdown()


# ---------------------------------------------------------------- the driver


def build_model(folder: Path, seq_len: int, hidden: int, layers: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.data import build_tokenizer
    from hf_dist.embedded.model import tiny_llama_config

    torch.manual_seed(0)
    tokenizer = build_tokenizer(model_max_length=seq_len)
    config = tiny_llama_config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                               num_hidden_layers=layers, max_position_embeddings=seq_len)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"hidden": hidden, "layers": layers, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "intermediate": config.intermediate_size,
            "vocab": len(tokenizer), "params": sum(p.numel() for p in model.parameters())}  # fmt: skip


def launch(name: str, worker_argv: list[str], log: Path) -> float:
    """torchrun on 2 CPU ranks; returns its wall time. Its output goes to ``log``; a failure ends the benchmark."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
           str(Path(__file__).resolve()), *worker_argv]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")  # fmt: skip
    print(f"[packing] {name}: launching (log {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SystemExit(f"[packing] {name} failed (exit {rc}) after {wall:.0f} s; last lines:\n{tail}")
    print(f"[packing] {name}: done in {wall:.0f} s", flush=True)
    return wall


def summarize(out: Path, warmup: int, micro_batch: int) -> dict:
    """Real tokens/s over the steps after ``warmup``, steps per epoch and peak RSS, from the ranks' records."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    steps = min(len(r["step_end"]) for r in ranks)
    if steps <= warmup:
        raise SystemExit(f"[packing] only {steps} steps ran, fewer than --warmup {warmup} + 1")
    real = sum(sum(r["real"][warmup:steps]) for r in ranks)
    slots = sum(sum(r["slots"][warmup:steps]) for r in ranks)
    seconds = max(r["step_end"][steps - 1] - r["step_end"][warmup - 1] if warmup else
                  r["step_end"][steps - 1] - r["train_begin"] for r in ranks)  # fmt: skip
    rows = ranks[0]["rows"]
    return {
        "timed_steps": steps - warmup,
        "seconds": seconds,
        "s_per_step": seconds / (steps - warmup),
        "real_tokens": real,
        "computed_tokens": slots,
        "real_tokens_per_s": real / seconds,
        "computed_tokens_per_s": slots / seconds,
        "measured_fill": real / slots,
        "rows": rows,
        "steps_per_epoch": math.ceil(rows / (micro_batch * RANKS)),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "peak_rss_mib_per_rank": [round(r["peak_rss_mib"]) for r in ranks],
        "dtype": ranks[0]["dtype"],
        "bf16": ranks[0]["bf16"],
        "attn_implementation": ranks[0]["attn_implementation"],
        "micro_batch": ranks[0]["micro_batch"],
        "world": ranks[0]["world"],
        "threads_per_rank": ranks[0]["threads"],
    }


def table(results: dict, stats: dict) -> str:
    head = ("| run | real tokens/s | vs padded | fill (epoch / timed) | steps per epoch | s/step | peak RSS / rank |\n"
            "|---|---|---|---|---|---|---|")  # fmt: skip
    fills = {"recipe packed": stats["packed_fill"], "recipe padded": stats["padded_fill"], "TRL packed": 1.0}
    base = results["recipe padded"]["real_tokens_per_s"]
    lines = [head]
    for name in RUNS:
        r = results[name]
        epoch_fill = r.get("epoch_fill", fills[name])
        lines.append(
            f"| {name} | {r['real_tokens_per_s']:,.0f} | {r['real_tokens_per_s'] / base:.2f}x | "
            f"{epoch_fill:.1%} / {r['measured_fill']:.1%} | {r['steps_per_epoch']:,} | {r['s_per_step']:.1f} | "
            f"{r['peak_rss_mib']:,.0f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        kind, out, rest = argv[1], Path(argv[2]), argv[3:]
        if kind == "recipe":
            worker_recipe(out, rest)
        else:
            model_dir, dataset, seq_len, micro_batch, steps, run_dir = rest
            worker_trl(out, model_dir, dataset, int(seq_len), int(micro_batch), int(steps), run_dir)
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="train on a random sample of this many conversations (seed 0; default 0: all 4,017)",
    )
    parser.add_argument("--seq-len", type=int, default=2048, help="row length: --max_seq_length / max_length")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per rank per step (default 8)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing (default 2)")
    parser.add_argument("--hidden", type=int, default=128, help="model hidden size (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"results JSON (default {RESULTS.relative_to(ROOT)})"
    )
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        parser.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")

    from hf_dist.data import build_tokenizer

    conversations = load_conversations()
    if args.conversations:
        conversations = random.Random(0).sample(conversations, min(args.conversations, len(conversations)))
    tokenizer = build_tokenizer(model_max_length=10**7)
    stats = data_stats(conversations, tokenizer, args.seq_len, args.micro_batch)
    print(f"[packing] {stats['conversations']:,} conversations ({stats['kept']:,} kept), {stats['real_tokens']:,} "
          f"tokens after the cut to {args.seq_len} ({stats['cut_to_seq_len']:,} cut); untruncated p10/p50/p90 "
          f"{stats['tokens_p10_p50_p90_untruncated']}; fill padded {stats['padded_fill']:.1%}, packed "
          f"{stats['packed_fill']:.1%}", flush=True)  # fmt: skip

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="hf-dist-packing-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model", args.seq_len, args.hidden, args.layers)
        with open(tmp / "chat.jsonl", "w", encoding="utf-8") as f:
            for messages in conversations:
                f.write(json.dumps({"messages": messages}) + "\n")
        with open(tmp / "eval.jsonl", "w", encoding="utf-8") as f:  # the recipe's final evaluation: kept small
            for messages in conversations[:8]:
                f.write(json.dumps({"messages": messages}) + "\n")
        common = ["--model_name_or_path", str(tmp / "model"), "--dataset", str(tmp / "chat.jsonl"),
                  "--eval_dataset", str(tmp / "eval.jsonl"), "--max_seq_length", str(args.seq_len),
                  "--per_device_train_batch_size", str(args.micro_batch), "--per_device_eval_batch_size",
                  str(args.micro_batch), "--gradient_accumulation_steps", "1", "--max_steps", str(args.steps),
                  "--strategy", "ddp", "--save_strategy", "no", "--eval_strategy", "no", "--logging_steps",
                  str(args.steps), "--report_to", "none", "--seed", "42"]  # fmt: skip
        workers = {
            "recipe packed": ["recipe", "{out}", *common, "--output_dir", "{run}", "--packing", "true"],
            "recipe padded": ["recipe", "{out}", *common, "--output_dir", "{run}", "--packing", "false"],
            "TRL packed": [
                "trl",
                "{out}",
                str(tmp / "model"),
                str(tmp / "chat.jsonl"),
                str(args.seq_len),
                str(args.micro_batch),
                str(args.steps),
                "{run}",
            ],  # fmt: skip
        }
        for name in runs:
            slug = name.replace(" ", "-").lower()
            out, run = tmp / f"{slug}-records", tmp / f"{slug}-run"
            worker = ["--worker", *(a.format(out=out, run=run) for a in workers[name])]
            log = tmp / f"{slug}.log"
            wall = launch(name, worker, log)
            results[name] = summarize(out, args.warmup, args.micro_batch)
            results[name]["launch_wall_s"] = wall
            text = log.read_text(errors="replace")
            results[name]["recipe_lines"] = re.findall(r"\[hf_dist\] (?:data|truncation)[^\n]*", text)
            print(f"[packing] {name}: {results[name]['real_tokens_per_s']:,.0f} real tokens/s", flush=True)

    if "recipe padded" in results:
        if "TRL packed" in results:
            results["TRL packed"]["epoch_fill"] = 1.0  # padding-free: no pad token is computed
        if "recipe packed" in results:
            results["recipe packed"]["epoch_fill"] = stats["packed_fill"]
        results["recipe padded"]["epoch_fill"] = stats["padded_fill"]
    summary = {}
    if {"recipe packed", "recipe padded"} <= results.keys():
        speedup = results["recipe packed"]["real_tokens_per_s"] / results["recipe padded"]["real_tokens_per_s"]
        bound = stats["packed_fill"] / stats["padded_fill"]
        timed = results["recipe packed"]["measured_fill"] / results["recipe padded"]["measured_fill"]
        summary.update(packed_vs_padded=speedup, fill_bound_epoch=bound, fill_bound_timed=timed,
                       packed_vs_fill_bound_timed=speedup / timed)  # fmt: skip
    if {"recipe packed", "TRL packed"} <= results.keys():
        summary["packed_vs_trl"] = (
            results["recipe packed"]["real_tokens_per_s"] / results["TRL packed"]["real_tokens_per_s"]
        )

    command = "nice -n 5 python benchmarks/packing.py" + (" " + " ".join(argv) if argv else "")
    report = {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "machine": f"{os.cpu_count()} CPU cores (shared), {RANKS} ranks x 1 thread, torch CPU",
        "corpus": "chitchat-dataset 0.9.0 (PyPI, MIT): BYU Chit-Chat Challenge conversations, >= 2 turns",
        "tokenizer": "hf_dist.data.build_tokenizer (character level)",
        "model": model,
        "seq_len": args.seq_len, "micro_batch": args.micro_batch, "ranks": RANKS, "steps": args.steps,
        "warmup": args.warmup,
        "data": stats,
        "runs": results,
        "summary": summary,
    }  # fmt: skip
    if len(results) == len(RUNS):
        print(table(results, stats))
    for key, value in summary.items():
        print(f"{key}: {value:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"[packing] results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
