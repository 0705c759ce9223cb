"""The analytic memory model against the tracer, and the tracer against real GPUs (an H100 and an H200).

    python benchmarks/trace_accuracy.py                 # every row (about 15 minutes on 2 cores)
    python benchmarks/trace_accuracy.py --only llama-3-8b --out trace.json
    python benchmarks/trace_accuracy.py --skip-models --gpu-only llama-3-8b   # part 2: the H200 LoRA run (~1 min)
    python benchmarks/trace_accuracy.py --moe --skip-gpu   # the mixture-of-experts matrix alone (about 5 minutes)
    python benchmarks/trace_accuracy.py --moe-planned --skip-gpu   # every layout the planner picks for them
    python benchmarks/trace_accuracy.py --deepspeed-only --skip-gpu   # the ZeRO-1/2/3 rows
    python benchmarks/trace_accuracy.py --deepspeed-only --rescore trace.json   # saved traces, the model as it is now

Part 1: public models' configs (hf_dist.testing.PUBLIC_CONFIGS: Llama 3.2 1B/3B, Llama 3 8B/70B, Qwen2.5 7B, Mistral
7B, Gemma 2 9B, Mixtral 8x7B) laid out as DDP, FSDP2 full-shard / shard-grad-op / HSDP, FSDP2 x TP and DeepSpeed
ZeRO-1/2/3 (``--deepspeed-only``: these alone), full and LoRA,
with and without activation checkpointing, on 8, 64 and 512 ranks, sequences of 2k to 32k tokens and micro-batches
of 1 to 8; the mixtures of experts (Mixtral 8x7B, Qwen1.5-MoE-A2.7B, DeepSeek-V2-Lite) also run MOE_LAYOUTS: FSDP2
full-shard on 8 and 64 ranks, 2k to 8k tokens, with and without checkpointing, full and LoRA; ``--moe-planned``: instead,
each layout the planner itself picks for them over PICK_GRID (TP, HSDP, ZeRO and offload included, where the
planner chooses them; a layout the tracer cannot run says why). Each row traces rank 0 (hf_dist.trace_memory: the real model, fake tensors, a fake process group) and
prints the traced peak of live tensors next to the memory model's ``allocated`` (what
``torch.cuda.max_memory_allocated`` reports). Target: within 5 % on every row whose traced device total (traced
peak + the model's allocator and CUDA-context terms) fits in 80 GiB.

Part 2: the tracer against every GPU run of benchmarks/data/gpu/ (H100, H200) that trained with fp32 master weights and
a layout the tracer runs (DDP / FSDP2 / DeepSpeed ZeRO-2/3, with or without Liger: its functions are traced through
hf_dist's fakes of Liger 0.8.5, hf_dist/tracing/liger/), with the LoRA the run recorded (``hf_dist.testing.gpu_case_lora``),
against its measured ``max_memory_allocated``; the memory model's ``allocated`` beside it. Target: within 3 %.
Out-of-memory runs must trace above what the card reached before it failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

from hf_dist.planning.dtypes import GIB
from hf_dist.planning.lora import LoraSpec
from hf_dist.planning.memory import estimate_memory
from hf_dist.planning.model_source import config_from_dict
from hf_dist.testing import PUBLIC_CONFIGS, gpu_case_lora, public_config
from hf_dist.tracing import TraceError, TraceResult, TraceSetup, TraceUnsupported, trace_memory

CARD_GIB = 80.0
MODEL_TARGET = 0.05
GPU_TARGET = 0.03
GPU_DATA = Path(__file__).parent / "data" / "gpu"

# (strategy, world, nodes, tp, method, ckpt, seq_len, micro_batch, accumulation): each model runs every layout
LAYOUTS = [
    ("ddp", 8, 1, 1, "lora", False, 2048, 1, 1),
    ("fsdp_full_shard", 8, 1, 1, "full", False, 2048, 2, 1),
    ("fsdp_full_shard", 8, 1, 1, "full", True, 2048, 8, 4),
    ("fsdp_full_shard", 64, 8, 1, "full", True, 8192, 1, 1),
    ("fsdp_shard_grad_op", 64, 8, 1, "lora", True, 2048, 4, 1),
    ("hsdp", 512, 64, 1, "full", True, 4096, 2, 1),
    ("fsdp_full_shard", 64, 8, 2, "full", True, 32768, 1, 1),
]
SMALL_ONLY = {"llama-3.2-1b", "llama-3.2-3b"}  # and these also DDP full fine-tuning on 8 ranks
EXTRA = [("ddp", 8, 1, 1, "full", False, 2048, 4, 1), ("ddp", 8, 1, 1, "full", True, 4096, 2, 2)]
# mixtures of experts: FSDP2 full-shard (the layout of issue 33's 0.88x) across ranks, tokens, checkpointing and method;
# the 8k rows without checkpointing on 8 ranks and 2k rows with it are left out (the one over 80 GiB everywhere, the
# other between rows that are run); the matrix takes about 5 minutes on 2 busy cores
MOE_MODELS = ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "deepseek-v2-lite")
MOE_LAYOUTS = [
    ("fsdp_full_shard", 8, 1, 1, "full", False, 2048, 1, 1),
    ("fsdp_full_shard", 8, 1, 1, "full", True, 4096, 1, 1),
    ("fsdp_full_shard", 8, 1, 1, "full", True, 8192, 1, 1),
    ("fsdp_full_shard", 8, 1, 1, "lora", False, 4096, 1, 1),
    ("fsdp_full_shard", 64, 8, 1, "full", True, 4096, 1, 1),
    ("fsdp_full_shard", 64, 8, 1, "full", False, 8192, 1, 1),
    ("fsdp_full_shard", 64, 8, 1, "lora", False, 2048, 1, 1),
    ("fsdp_full_shard", 64, 8, 1, "lora", True, 8192, 1, 1),
]

# PEFT moves gate/up/down_proj targets of DeepSeek-V2 onto its stacked expert parameters, which hf_dist refuses to plan
# (planning/lora.py _refuse_expert_parameters): its LoRA rows adapt the attention's linears (the recipes' rank, dropout)
MOE_LORA = {"deepseek-v2-lite": LoraSpec(targets=("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))}

# the requests whose picks --moe-planned traces: (gpus, nodes) x strategy pinned to FSDP2 or the planner's choice x
# method x global batch, at 4k tokens with checkpointing on 80 GiB cards
PICK_GRID = list(itertools.product(((8, 1), (64, 8)), ("fsdp_full_shard", None), ("full", "lora"), (16, 64, 512)))


# DeepSpeed ZeRO-1/2/3 as hf_dist configures it (bf16, the Trainer's AdamW), traced through the real engine
DEEPSPEED_LAYOUTS = [
    ("zero1", 8, 1, 1, "full", True, 4096, 2, 1),
    ("zero2", 8, 1, 1, "full", False, 2048, 2, 2),
    ("zero2", 64, 8, 1, "lora", False, 2048, 4, 1),
    ("zero3", 8, 1, 1, "full", False, 2048, 2, 1),
    ("zero3", 64, 8, 1, "full", True, 8192, 1, 1),
    ("zero3", 64, 8, 1, "lora", True, 4096, 2, 1),
]


def layouts(model: str, moe_only: bool = False, deepspeed_only: bool = False) -> list[tuple]:
    """The layouts ``model`` runs: the dense matrix with its DeepSpeed rows (Mixtral too, as before), and the MoE
    matrix for MoE models; ``moe_only`` / ``deepspeed_only``: that part alone."""
    dense = model not in MOE_MODELS[1:]
    if deepspeed_only:
        return DEEPSPEED_LAYOUTS if dense else []
    moe = MOE_LAYOUTS if model in MOE_MODELS else []
    if moe_only:
        return moe
    return (LAYOUTS + (EXTRA if model in SMALL_ONLY else []) + DEEPSPEED_LAYOUTS if dense else []) + moe


def setups(models: list[str], moe_only: bool = False, deepspeed_only: bool = False) -> list[tuple[str, TraceSetup]]:
    rows = []
    for model in models:
        for strategy, world, nodes, tp, method, ckpt, seq, mb, accum in layouts(model, moe_only, deepspeed_only):
            rows.append((model, TraceSetup(
                strategy=strategy, world_size=world, nodes=nodes, tp_size=tp, method=method,
                activation_checkpointing=ckpt, seq_len=seq, micro_batch_size=mb, gradient_accumulation_steps=accum,
                lora=MOE_LORA.get(model) if method == "lora" else None,
            )))  # fmt: skip
    return rows


def planned_setups(models: list[str]) -> list[tuple[str, TraceSetup]]:
    """Each distinct layout the planner picks for ``models`` over PICK_GRID (requests nothing fits are left out)."""
    from hf_dist.planning.planner import plan

    picked: dict[tuple[str, str], tuple[str, TraceSetup]] = {}
    for model in models:
        for (gpus, nodes), strategy, method, batch in PICK_GRID:
            lora = MOE_LORA.get(model) if method == "lora" else None
            targets = {"lora_targets": list(lora.targets)} if lora is not None else {}
            pinned = {"strategy": strategy} if strategy else {}
            try:
                chosen = plan(public_config(model), gpus=gpus, nodes=nodes, gpu_memory_gib=CARD_GIB, seq_len=4096,
                              activation_checkpointing=True, method=method, global_batch_size=batch, **pinned,
                              **targets)  # fmt: skip
            except ValueError:  # nothing fits (PlanError)
                continue
            setup = TraceSetup.from_plan(chosen)
            picked.setdefault((model, describe(setup)), (model, setup))
    return list(picked.values())


def model_row(name: str, setup: TraceSetup, limit: float) -> dict:
    config = public_config(name)
    estimate = estimate_memory(config, setup.strategy, **setup.estimate_kwargs())
    row = {
        "model": name,
        "layout": describe(setup),
        "modelled_gib": estimate.allocated / GIB,
        "setup": setup.to_dict(),
    }
    try:
        trace = trace_memory(config, isolate=False, time_limit_s=limit, **setup.to_dict())
    except (TraceUnsupported, TraceError, ValueError) as exc:
        return {**row, "error": str(exc).split("; the analytic")[0][:160]}
    total = trace.device_total(estimate) / GIB
    return {
        **row, "traced_gib": trace.peak_bytes / GIB, "ratio": estimate.allocated / trace.peak_bytes,
        "fits_80": total <= CARD_GIB, "seconds": trace.seconds, "peak_phase": trace.peak_phase,
        "reserved_gib": trace.reserved_bytes / GIB,
        "traced_terms_gib": {k: round(v / GIB, 3) for k, v in trace.terms.items() if v},
        "modelled_terms_gib": {k: round(v / GIB, 3) for k, v in estimate.to_dict().items()
                               if v and k in ("params", "grads", "optimizer", "activations", "logits", "buffers", "step")},
    }  # fmt: skip


def rescore(rows: list[dict], selected: list[tuple[str, TraceSetup]]) -> list[dict]:
    """Saved rows (``--out``) against the memory model as it is now: the traces do not depend on it. A row without
    its setup (older files) takes the setup of the selected layouts with the same model and layout name."""
    by_name = {(name, describe(setup)): setup for name, setup in selected}
    out = []
    for row in rows:
        setup = TraceSetup.from_dict(row["setup"]) if "setup" in row else by_name.get((row["model"], row["layout"]))
        if setup is None:
            raise ValueError(f"--rescore: no layout {row['layout']!r} of {row['model']} among the selected rows")
        estimate = estimate_memory(public_config(row["model"]), setup.strategy, **setup.estimate_kwargs())
        row = {**row, "modelled_gib": estimate.allocated / GIB, "setup": setup.to_dict()}
        if "traced_gib" in row:
            row["ratio"] = estimate.allocated / (row["traced_gib"] * GIB)
            traced = TraceResult(setup, round(row["traced_gib"] * GIB), {}, {}, {}, 0.0,
                                 reserved_bytes=round(row.get("reserved_gib", 0) * GIB))  # fmt: skip
            row["fits_80"] = traced.device_total(estimate) / GIB <= CARD_GIB
        out.append(row)
    return out


def describe(s: TraceSetup) -> str:
    sizes = "".join(f" {n}{v}" for n, v in (("tp", s.tp_size), ("cp", s.cp_size), ("sp", s.sp_size)) if v > 1)
    sizes += f" offload={s.offload}" if s.offload != "none" else ""
    flags = ("+ckpt" if s.activation_checkpointing else "") + ("+sync" if s.sync_each_batch else "")
    flags += f" ga{s.gradient_accumulation_steps}" if s.gradient_accumulation_steps > 1 else ""
    return f"{s.strategy}{sizes} w{s.world_size} {s.method}{flags} seq{s.seq_len} mb{s.micro_batch_size}"


def gpu_rows(limit: float, only: list[str] | None = None) -> list[dict]:
    """Every GPU case with fp32 masters that the tracer can run (of the ``only`` models, when given)."""
    rows = []
    for path in sorted(GPU_DATA.glob("*.json")):
        data = json.loads(path.read_text())
        gpu = data["environment"]["gpu"].split(" (")[0]
        for case in data["cases"]:
            measured = case["measured"]
            # fp32 masters unless the Adam state was bf16 (gpu_ground_truth.ran_pure_bf16: ZeRO-3's is not recorded)
            masters = measured.get("adam_state_dtype") != "torch.bfloat16"
            if not masters or (only and case["model"] not in only):
                continue
            config = json.loads((GPU_DATA / "configs" / case["model"] / "config.json").read_text())
            setup = TraceSetup(
                strategy=case["strategy"], method=case["method"], seq_len=case["seq_len"],
                micro_batch_size=case["micro_batch_size"], gradient_accumulation_steps=case["gradient_accumulation_steps"],
                activation_checkpointing=case["activation_checkpointing"], base_dtype=case["weights_loaded_as"],
                lora=gpu_case_lora(case), use_liger_kernel=case["use_liger_kernel"],
            )  # fmt: skip
            trace = trace_memory(config, isolate=False, time_limit_s=limit, **setup.to_dict())
            modelled = estimate_memory(config_from_dict(config), setup.strategy, **setup.estimate_kwargs())
            real = measured["max_memory_allocated_gib"]
            rows.append({
                "case": f"{case['model']} {describe(setup)}{' liger' if setup.use_liger_kernel else ''}", "gpu": gpu,
                "gpu_allocated_gib": real,
                "traced_gib": trace.peak_bytes / GIB, "ratio": trace.peak_bytes / GIB / real,
                "modelled_gib": modelled.allocated / GIB, "out_of_memory": bool(measured.get("out_of_memory")),
                "seconds": trace.seconds,
            })  # fmt: skip
    return rows


HEADER = f"{'model':17} {'layout':52} {'traced':>8} {'model':>8} {'model/traced':>12} {'fits 80':>7} {'s':>6}"


def format_row(r: dict) -> tuple[str, bool]:
    """The printed line, and whether the row misses the target."""
    if "error" in r:
        return f"{r['model']:17} {r['layout']:52} {'-':>8} {r['modelled_gib']:8.2f}   not traced: {r['error']}", False
    miss = r["fits_80"] and abs(r["ratio"] - 1) > MODEL_TARGET
    line = (f"{r['model']:17} {r['layout']:52} {r['traced_gib']:8.2f} {r['modelled_gib']:8.2f} {r['ratio']:12.3f} "
            f"{'yes' if r['fits_80'] else 'no':>7} {r['seconds']:6.1f}{'  MISS' if miss else ''}")  # fmt: skip
    return line, miss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--only", nargs="*", choices=sorted(PUBLIC_CONFIGS), help="models to run (default: all)")
    parser.add_argument("--skip-gpu", action="store_true", help="leave out part 2 (the GPU comparison)")
    parser.add_argument("--moe", action="store_true", help="part 1 for the mixtures of experts' matrix only")
    parser.add_argument("--moe-planned", action="store_true", help="part 1 for the layouts the planner picks for them")
    parser.add_argument("--deepspeed-only", action="store_true", help="part 1's DeepSpeed ZeRO rows only")
    parser.add_argument("--skip-models", action="store_true", help="leave out part 1 (the memory model vs the tracer)")
    parser.add_argument(
        "--gpu-only", nargs="*", help="part 2 alone, for these models only (e.g. llama-3-8b; none: all)"
    )
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per trace")
    parser.add_argument("--out", type=Path, help="also write every row as JSON")
    parser.add_argument("--rescore", type=Path, help="no tracing: part 1 from a saved --out file, modelled anew")
    args = parser.parse_args(argv)
    start = time.time()
    print("Part 1: analytic model vs tracer (rank 0, allocated GiB)")
    print(HEADER, flush=True)
    rows, misses = [], 0
    skip_models = args.skip_models or args.gpu_only is not None  # --gpu-only: part 2 alone
    models = args.only or (list(MOE_MODELS) if args.moe or args.moe_planned else list(PUBLIC_CONFIGS))
    selected = [] if skip_models else setups(models, moe_only=args.moe, deepspeed_only=args.deepspeed_only)
    selected = planned_setups(models) if args.moe_planned and not skip_models else selected
    saved = rescore(json.loads(args.rescore.read_text())["model_rows"], selected) if args.rescore else None
    for item in saved if saved is not None else selected:
        rows.append(item if saved is not None else model_row(*item, args.time_limit))
        line, miss = format_row(rows[-1])
        misses += miss
        print(line, flush=True)
    checked = sum(1 for r in rows if r.get("fits_80"))
    print(f"{checked - misses}/{checked} rows that fit in {CARD_GIB:g} GiB within {MODEL_TARGET:.0%}")
    gpu = [] if args.skip_gpu or args.rescore else gpu_rows(args.time_limit, args.gpu_only)
    if gpu:
        print("\nPart 2: tracer (and memory model) vs the GPU's max_memory_allocated (GiB)")
        for r in gpu:
            # an OOM run: at least what the card reached before the allocation that failed
            ok = r["ratio"] >= 1 - GPU_TARGET if r["out_of_memory"] else abs(r["ratio"] - 1) <= GPU_TARGET
            print(
                f"{r['case']:60} {r['gpu']:22} {r['gpu_allocated_gib']:7.2f}  traced {r['traced_gib']:7.2f}  "
                f"ratio {r['ratio']:.3f}  modelled {r['modelled_gib']:7.2f}"
                f"{' (OOM on the GPU)' if r['out_of_memory'] else ''}{'' if ok else '  MISS'}"
            )
    print(f"\n{time.time() - start:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"model_rows": rows, "gpu_rows": gpu}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
