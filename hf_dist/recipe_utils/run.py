"""The run itself: resume, callbacks, strategy check, plan, baseline, training, export, reload and results."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hf_dist.atomic_io import atomic_write_json
from hf_dist.recipe_utils.data import BatchShape, collator
from hf_dist.recipe_utils.export import export_model, reload_export
from hf_dist.runtime.dist import deepspeed_config, live_strategy, parallel_sizes

# ---------------------------------------------------------------- the run


def load_recipe(path: str | Path) -> Any:
    """The recipe file at ``path`` as a module (``recipes/`` is a folder of scripts, not a package)."""
    import importlib.util

    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_at_end_callback() -> Any:
    """A callback that saves a checkpoint at the last step, so every run has one to export from."""
    from transformers import TrainerCallback

    class SaveAtEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.max_steps and state.global_step >= state.max_steps:
                control.should_save = True
            return control

    return SaveAtEnd()


def make_trainer(
    model: Any, args: Any, tokenizer: Any, train_ds: Any, eval_ds: Any, *, rows: str, seq_len: int | None = None
) -> Any:
    """A ``Trainer`` that saves a checkpoint at its last step (resolve the checkpoint to resume with
    :func:`resume_checkpoint` first: it may edit the DeepSpeed config). ``rows``: what the datasets' rows are
    (:func:`hf_dist.recipe_utils.data.collator`)."""
    from transformers import Trainer

    return Trainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=collator(tokenizer, rows=rows, sp_size=_sp_size(args), seq_len=seq_len),
        processing_class=tokenizer,
        callbacks=[save_at_end_callback()],
    )


def _sp_size(args: Any) -> int:
    return parallel_sizes(getattr(args, "parallelism_config", None), deepspeed_config(args))["sp"]


def resume_checkpoint(args: Any) -> str | None:
    """What ``--resume_from_checkpoint`` names, made loadable by this run; call before any model or Trainer is built.

    ``auto``: the newest complete checkpoint in ``--output_dir`` (:func:`hf_dist.auto_resume`; None, a fresh
    start, when there is none); a path: that checkpoint. A DeepSpeed ZeRO checkpoint saved by another number
    of ranks is converted to DeepSpeed's universal format first, and a checkpoint of another strategy is
    refused (:func:`hf_dist.checkpoint.lifecycle.reshard.prepare_resume`). Rank 0 prints one line: where the run
    resumes, that it starts from scratch, or that the checkpoint is at the run's last step (:func:`is_finished`).
    """
    value = args.resume_from_checkpoint
    if not value:
        return None
    from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume, resume_line
    from hf_dist.checkpoint.lifecycle.reshard import prepare_resume

    if value == "auto":  # the line below says it, with the finished case (auto_resume alone would not)
        found = auto_resume(args.output_dir, training_args=args, announce=False)
    else:
        found = prepare_resume(value, training_args=args)
    if args.process_index == 0:
        print(resume_line(found, args, output_dir=args.output_dir), flush=True)
    return found


def is_finished(resume: str | None, args: Any) -> bool:
    """Whether ``resume`` (:func:`resume_checkpoint`) is at the run's last step: the rerun of a finished run, which
    trains nothing (transformers would train one step past it: :mod:`hf_dist.checkpoint.lifecycle.finished`)."""
    from hf_dist.checkpoint.lifecycle.finished import finished_at

    return finished_at(resume, args) is not None


def earlier_results(args: Any) -> dict:
    """The finished run's ``<output_dir>/results.json`` (empty when it has none): what a rerun of it returns."""
    import json

    path = Path(args.output_dir) / "results.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def cpu_test_modes(run_args: Any) -> None:
    """The recipes' CPU test opt-ins (tests and CPU development only, never needed on GPUs): ``--fsdp_on_cpu``
    keeps FSDP2, which accelerate drops on CPU; ``--model_parallel_on_cpu`` lets accelerate accept a
    ``ParallelismConfig`` (TP/SP), which it refuses on CPU (:mod:`hf_dist.runtime.cpu_fsdp`)."""
    from hf_dist.runtime.cpu_fsdp import allow_parallelism_config_on_cpu, enable_fsdp_on_cpu

    if run_args.fsdp_on_cpu:
        enable_fsdp_on_cpu()
    if run_args.model_parallel_on_cpu:
        allow_parallelism_config_on_cpu()


def train(trainer: Any, resume: str | None, *, async_save: bool = False) -> str:
    """Check the strategy really runs, add hf_dist's callbacks, train (resuming from ``resume``); returns the strategy.

    The callbacks (:func:`hf_dist.callbacks.default`) mark checkpoints complete for ``--resume_from_checkpoint
    auto``, skip non-finite updates, and log memory and throughput per rank; ``async_save`` (the recipes'
    ``--async_save``) writes the checkpoints in the background.
    """
    from hf_dist.callbacks import attach

    strategy = check_strategy(trainer)
    # plan=False: a recipe's explicit flags win over auto_args' kwargs (docs/recipes.md), so its run is not checked
    # against the plan; a resume path from another run's folder resumes its optimizer state too
    attach(trainer, plan=False, resume_from=resume, async_save=async_save)
    trainer.train(resume_from_checkpoint=resume)
    return strategy


def check_strategy(trainer: Any) -> str:
    """The strategy accelerate actually runs (a registry name); a RuntimeError when it silently dropped the requested one.

    The name comes from :func:`hf_dist.runtime.dist.live_strategy` (what accelerate built, not what was
    asked for). accelerate falls back to plain DDP on CPU for DeepSpeed when ``use_cpu``/``ACCELERATE_USE_CPU``
    is set, and for FSDP unless :func:`hf_dist.runtime.cpu_fsdp.enable_fsdp_on_cpu` was called (the
    recipes' ``--fsdp_on_cpu``); training on would produce a run the user did not ask for.
    """
    from hf_dist.planning.layout import strategy

    actual = strategy(live_strategy(trainer.args))
    if trainer.args.deepspeed and not actual.is_deepspeed:
        raise RuntimeError(
            f"DeepSpeed was requested but accelerate runs {actual}: on CPU it drops DeepSpeed when use_cpu / "
            "ACCELERATE_USE_CPU=1 is set (unset it)"
        )
    if trainer.args.fsdp and not actual.is_fsdp:
        raise RuntimeError(
            f"FSDP was requested but accelerate runs {actual}: on CPU it drops FSDP unless the recipe runs with "
            "--fsdp_on_cpu (tests and CPU development only)"
        )
    sizes = _live_sizes(trainer)
    if trainer.args.process_index == 0:
        dims = "".join(f", {name}={size}" for name, size in sizes.items() if size > 1)
        print(f"[hf_dist] running {actual} ({actual.engine.value}, {type(trainer.model).__name__}{dims})", flush=True)
    return actual.name


def _live_sizes(trainer: Any) -> dict[str, int]:
    """tp / cp / sp of the run (:func:`hf_dist.runtime.dist.parallel_sizes`); a RuntimeError when TP was asked for
    and did not happen: torch TP with no weight sharded over a ``tp`` mesh of that size (a model loaded without
    ``tp_plan``), or DeepSpeed AutoTP whose engine (once built) replaced no layer with a TP layer of that size."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)  # what accelerate built
    sizes = parallel_sizes(pc, deepspeed_config(trainer.args))
    tp = sizes["tp"]
    if tp > 1 and not trainer.args.deepspeed:
        from torch.distributed.tensor import DTensor

        meshes = {
            dict(zip(p.device_mesh.mesh_dim_names or (), p.device_mesh.shape, strict=True)).get("tp")
            for p in trainer.model.parameters()
            if isinstance(p, DTensor)
        }
        if tp not in meshes:
            raise RuntimeError(
                f"tp_size {tp} was requested but no weight is sharded over a 'tp' mesh of that size: load "
                "the model with from_pretrained(..., **hf_dist.from_pretrained_kwargs(plan.layout))"
            )
    engine = getattr(trainer, "deepspeed", None)  # set once the Trainer started DeepSpeed
    # DeepSpeed's TP layers (module_inject.layers.TensorParallel_Layer) carry the TP group's size
    if (
        tp > 1
        and engine is not None
        and not any(getattr(m, "tp_world_size", None) == tp for m in engine.module.modules())
    ):
        raise RuntimeError(
            f"DeepSpeed AutoTP was configured with autotp_size {tp} but no layer of the model was replaced by a "
            "tensor-parallel layer of that size; check the model's linear layers and the DeepSpeed version"
        )
    return sizes


def print_plan(config: Any, *, method: str, seq_len: int, args: Any, strategy: str | None = None,
               trust_remote_code: bool = False, peft_config: Any = None, data: Any = None) -> None:  # fmt: skip
    """Print :func:`describe_plan` on the main process, then the lines of ``data``
    (:class:`~hf_dist.recipe_utils.data.ChatData`: truncation and fill)."""
    if args.process_index == 0:
        text = describe_plan(config, method=method, seq_len=seq_len, args=args, strategy=strategy,
                             trust_remote_code=trust_remote_code, peft_config=peft_config, data=data)  # fmt: skip
        print("\n".join([text, *(data.lines if data is not None else ())]), flush=True)


def batch_shape(args: Any) -> BatchShape:
    """The :class:`~hf_dist.recipe_utils.data.BatchShape` of ``args``: micro-batch, accumulation and the
    data-parallel ranks (the ranks of one tensor / context / sequence parallel group share each row)."""
    sizes = parallel_sizes(getattr(args, "parallelism_config", None), deepspeed_config(args))
    dp = args.world_size // (sizes["tp"] * sizes["cp"] * sizes["sp"])
    return BatchShape(args.per_device_train_batch_size, args.gradient_accumulation_steps, dp)


def describe_plan(config: Any, *, method: str, seq_len: int, args: Any, strategy: str | None = None,
                  trust_remote_code: bool = False, peft_config: Any = None, data: Any = None) -> str:  # fmt: skip
    """The planner's explanation for this model/method on the detected hardware, plus the batch math (over the
    data-parallel ranks: the ranks of one tensor / context / sequence parallel group share each sequence).
    ``trust_remote_code``: the planner may import the config's ``auto_map`` code (``--trust_remote_code``);
    ``peft_config``: the LoRA the recipe applies; ``data`` (:class:`~hf_dist.recipe_utils.data.ChatData`): packed
    rows are said as such, and the plan's tokens/s is also given as real tokens at the data's fill."""
    world = args.world_size
    asked = parallel_sizes(getattr(args, "parallelism_config", None), deepspeed_config(args))
    sizes = {f"{n}_size": size for n, size in asked.items()}
    dp = world // (sizes["tp_size"] * sizes["cp_size"] * sizes["sp_size"])
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp
    shared = "".join(f" {n[:2]}={v}" for n, v in sizes.items() if v > 1)
    lines = [
        f"[hf_dist] {method} training, {world} process(es) on {args.device.type}{shared}: micro batch "
        f"{args.per_device_train_batch_size} x grad accum {args.gradient_accumulation_steps} x data parallel {dp} "
        + (f"= global batch {batch} packed rows of {seq_len} token slots" if getattr(data, "packed", False)
           else f"= global batch {batch} sequences of <= {seq_len} tokens")
    ]  # fmt: skip
    from hf_dist.checkpoint.lifecycle.resume_checks import strategy_of_args
    from hf_dist.planning.planner import plan

    strategy = strategy or strategy_of_args(args)  # what these arguments run (the user's own config may choose it)
    pinned = sizes if shared else {}
    try:
        chosen = plan(
            config, gpus=world, method=method, seq_len=seq_len, global_batch_size=batch, strategy=strategy,
            trust_remote_code=trust_remote_code, peft_config=peft_config if method != "full" else None, **pinned,
        )  # fmt: skip
        # model / hardware / chosen / why (and the LoRA); `hf-dist plan` prints the full per-strategy table
        head = chosen.explain().splitlines()
        lines += ["[hf_dist] plan: " + line for line in head[:4] + [h for h in head[4:5] if h.startswith("lora:")]]
        if getattr(data, "fill", None) and chosen.tokens_per_s:
            lines.append(
                f"[hf_dist] plan: ~{chosen.tokens_per_s * data.fill:,.0f} real tokens/s estimated at the data's "
                f"{data.fill:.0%} fill ({'packed' if data.packed else 'padded'})"
            )
    except ValueError as exc:  # PlanError: e.g. no strategy fits the detected hardware
        lines.append(f"[hf_dist] planner: {exc}")
    return "\n".join(lines)


def baseline_accuracy(model: Any, tokenizer: Any, task: Any, *, mode: str, args: Any) -> float | None:
    """Task accuracy before training, computed once on the main process (others wait); a model transformers
    sharded at load (tensor parallelism) runs collectives in every forward, so there every rank evaluates."""
    from hf_dist.embedded.task_eval import exact_match

    if task is None:
        return None
    accuracy = None
    if getattr(model, "is_distributed_loading_by_transformers", False):
        accuracy = exact_match(model, tokenizer, task, mode=mode)
    else:
        with args.main_process_first(desc="baseline accuracy"):
            if args.process_index == 0:
                accuracy = exact_match(model, tokenizer, task, mode=mode)
    if args.process_index == 0:
        print(f"[hf_dist] task accuracy before training: {accuracy:.0%} ({len(task)} held-out examples)")
    return accuracy


def finish_run(
    trainer: Any, tokenizer: Any, *, task: Any, mode: str, adapter: bool, before: float | None, check_export: bool,
    trust_remote_code: bool = False,
) -> dict:  # fmt: skip
    """Evaluate and export an HF folder (or adapter); then, for the embedded ``task`` or when ``check_export``
    (``--check_export``) asks, reload the export with from_pretrained and sample it (and score the task).
    ``trust_remote_code`` (``--trust_remote_code``): the export and its reload may import the config's
    ``auto_map`` code.

    Returns (and writes to ``<output_dir>/results.json`` on the main process) the run summary.
    """
    from transformers.trainer_callback import ProgressCallback

    from hf_dist.callbacks.watchdog import watching

    # training is over: one bar per run, and the result below says what the evaluation found
    trainer.pop_callback(ProgressCallback)
    if trainer.args.process_index == 0:
        print(f"[hf_dist] evaluating on {len(trainer.eval_dataset)} held-out sequences", flush=True)
    export_dir = Path(trainer.args.output_dir) / ("adapter" if adapter else "final")
    with watching(trainer):  # the hang watchdog's allowances for an evaluation and an export
        metrics = trainer.evaluate()
        eval_loss = float(metrics["eval_loss"])
        if trainer.args.process_index == 0:
            print(f"[hf_dist] eval loss {eval_loss:.4f}; exporting", flush=True)
        how = export_model(trainer, tokenizer, export_dir, adapter=adapter, trust_remote_code=trust_remote_code)
    trainer.accelerator.wait_for_everyone()
    if not trainer.args.should_save:
        return {}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    results = {
        "strategy": live_strategy(trainer.args),
        "wrapped_model": type(trainer.model_wrapped).__name__,
        "model": type(trainer.model).__name__,
        "world_size": trainer.args.world_size,
        **{f"{name}_size": size for name, size in _live_sizes(trainer).items()},
        "steps": trainer.state.global_step,
        "train_losses": losses,
        "eval_loss": eval_loss,
        "perplexity": math.exp(min(eval_loss, 50.0)),
        "accuracy_before": before,
        "export_dir": str(export_dir),
        "exported_with": how,
    }
    if task is not None or check_export:
        results.update(reload_export(export_dir, tokenizer, task=task, mode=mode, adapter=adapter,
                                     trust_remote_code=trust_remote_code))  # fmt: skip
    atomic_write_json(Path(trainer.args.output_dir) / "results.json", results)
    print(format_results(results))
    return results


def _sample_verdict(results: dict) -> str:
    """The verdict on the task's sample, the first right answer when there is one
    (:func:`hf_dist.embedded.task_eval.showcase`): a miss is shown only when none is right."""
    output, expected = results["sample_output"].strip(), results["sample_expected"]
    if (output.splitlines()[0].strip() if output else "") == expected:
        return " (right)"
    none_right = "; no held-out prompt was answered right" if results.get("accuracy_after") == 0 else ""
    return f" (a miss: expected {expected!r}{none_right})"


def format_results(results: dict) -> str:
    """The end-of-run summary printed by every recipe."""
    losses = results["train_losses"]
    lines = [
        f"[hf_dist] strategy run: {results['strategy']} ({results['wrapped_model']}"
        + "".join(
            f", {n}={results.get(f'{n}_size', 1)}" for n in ("tp", "cp", "sp") if results.get(f"{n}_size", 1) > 1
        )
        + f"), {results['steps']} steps on {results['world_size']} process(es)",
        f"[hf_dist] train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "[hf_dist] no train loss logged",
        f"[hf_dist] eval loss {results['eval_loss']:.4f}, perplexity {results['perplexity']:.2f}",
        f"[hf_dist] exported {results['export_dir']} via {results['exported_with']}",
    ]
    if "sample_output" in results:
        lines[-1] += "; reloaded with from_pretrained"
    if "accuracy_after" in results:
        before = results["accuracy_before"]
        before_txt = f"{before:.0%}" if before is not None else "n/a"
        lines.append(
            f"[hf_dist] task exact-match accuracy: {before_txt} before -> {results['accuracy_after']:.0%} after"
        )
    if "sample_output" in results:
        line = f"[hf_dist] sample: {results['sample_prompt']!r} -> {results['sample_output']!r}"
        if "sample_expected" in results:  # the task knows the answer: say whether this one is it
            line += _sample_verdict(results)
        lines.append(line)
    return "\n".join(lines)
