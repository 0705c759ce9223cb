"""The recipes' export: the trained model as a consolidated HF folder (or PEFT adapter), checked by reloading it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hf_dist.callbacks.phases import Phase, phase
from hf_dist.checkpoint.safety.paths import ConfinedFolder
from hf_dist.data import generation_prompt
from hf_dist.recipe_utils.model import outside_zero3
from hf_dist.runtime.dist import live_strategy


def export_model(
    trainer: Any, tokenizer: Any, export_dir: Path, *, adapter: bool, trust_remote_code: bool = False
) -> str:
    """Write a consolidated HF folder (or PEFT adapter) to ``export_dir``; returns how it was made.

    Sharded runs (FSDP, ZeRO) go through ``hf_dist.convert`` from the checkpoint of the weights the Trainer ends
    with (:func:`final_checkpoint`); without a checkpoint (and for DDP) the full weights are gathered and saved
    in-process. The folder is marked as an output (``hf_dist_output.json``). Collective: every rank calls it, as the
    export phase (the hang watchdog's allowance for exports, :func:`hf_dist.callbacks.watchdog.watching`).
    """
    from hf_dist.checkpoint.output.paths import mark_output

    with phase(Phase.EXPORT):
        how = _export(trainer, tokenizer, export_dir, adapter=adapter, trust_remote_code=trust_remote_code)
    if trainer.args.should_save:
        mark_output(export_dir, "recipe export")  # a rerun's export may replace it, and nothing else
    return how


def _export(trainer: Any, tokenizer: Any, export_dir: Path, *, adapter: bool, trust_remote_code: bool) -> str:
    from hf_dist.planning.layout import strategy

    running = strategy(live_strategy(trainer.args))
    checkpoint = final_checkpoint(trainer)
    if not running.is_ddp and checkpoint is not None:
        if trainer.args.should_save:
            _convert_checkpoint(trainer, tokenizer, checkpoint, export_dir, adapter=adapter,
                                trust_remote_code=trust_remote_code)  # fmt: skip
        trainer.accelerator.wait_for_everyone()
        return f"hf_dist.convert({checkpoint.name})"
    if running.is_fsdp:
        # FSDP with a sharded state dict makes save_model a no-op; gather a full state dict instead
        state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if trainer.args.should_save:
            trainer.accelerator.unwrap_model(trainer.model).save_pretrained(export_dir, state_dict=state_dict)
            tokenizer.save_pretrained(export_dir)
        return "accelerator.get_state_dict"
    trainer.save_model(str(export_dir))
    return "trainer.save_model"


def _convert_checkpoint(
    trainer: Any, tokenizer: Any, checkpoint: Path, export_dir: Path, *, adapter: bool, trust_remote_code: bool
) -> None:
    """Run ``hf_dist.convert`` on the checkpoint in a fresh process, as ``hf-dist convert`` would.

    A separate process keeps the converter away from this job's initialised process group (its
    readers must not join collectives the other ranks are not in). The config, adapter config and tokenizer that
    make the sharded tensors loadable are written to a folder beside the export (``--model-config`` and
    ``--tokenizer`` of the conversion), never into the checkpoint, whose manifest lists what the run saved.
    """
    import shutil
    import tempfile

    model = trainer.accelerator.unwrap_model(trainer.model)
    base = model.get_base_model() if adapter else model
    export_dir.parent.mkdir(parents=True, exist_ok=True)
    side = Path(tempfile.mkdtemp(prefix=f".{export_dir.name}.side-", dir=export_dir.parent))
    try:
        base.config.save_pretrained(side)
        if adapter:
            model.peft_config["default"].save_pretrained(side)
        tokenizer.save_pretrained(side)
        _run_convert(checkpoint, export_dir, side, adapter=adapter, trust_remote_code=trust_remote_code)
    finally:
        shutil.rmtree(side, ignore_errors=True)


def _run_convert(checkpoint: Path, export_dir: Path, side: Path, *, adapter: bool, trust_remote_code: bool) -> None:
    code = (
        "import sys, hf_dist; "
        "hf_dist.convert(sys.argv[1], sys.argv[2], model_config=sys.argv[3], tokenizer=sys.argv[3], "
        "adapter=sys.argv[4] == '1', overwrite=True, progress=False, trust_remote_code=sys.argv[5] == '1')"
    )
    flags = (adapter, trust_remote_code)
    dist_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint), str(export_dir), str(side), *("1" if f else "0" for f in flags)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hf_dist.convert({checkpoint} -> {export_dir}) failed:\n{proc.stderr[-4000:]}")


def final_checkpoint(trainer: Any) -> Path | None:
    """The checkpoint holding the weights the Trainer ends with: the best one under ``load_best_model_at_end`` (the
    Trainer loaded it back), else the one this run saved at its last step (:func:`save_at_end_callback`), never an
    older run's."""
    from hf_dist.callbacks.export import ended_with

    path = ended_with(trainer.args, trainer.state)
    return path if path.is_dir() else None


def reload_export(
    export_dir: Path, tokenizer: Any, *, task: Any, mode: str, adapter: bool, trust_remote_code: bool = False
) -> dict:
    """Reload the export the way a user would and run it: accuracy on the task and one sample (the config's
    ``auto_map`` code imported only with ``trust_remote_code``, the recipes' ``--trust_remote_code``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dist.embedded.task_eval import generate

    with outside_zero3():
        if adapter:
            from hf_dist.runtime.peft_calls import load_peft_model

            model = load_peft_model(export_dir, trust_remote_code=trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=trust_remote_code)
    if adapter:
        _check_adapter_loaded(model, export_dir)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    reloaded_tokenizer = AutoTokenizer.from_pretrained(export_dir, trust_remote_code=trust_remote_code)
    out: dict[str, Any] = {"exported_params": sum(p.numel() for p in model.parameters())}
    if task is not None:
        out.update(task_results(model, reloaded_tokenizer, task, mode=mode))
        return out
    text = "Explain in one sentence what data parallel training is."
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    out["sample_prompt"] = generation_prompt(reloaded_tokenizer, messages) if mode == "chat" else text
    out["sample_output"] = generate(model, reloaded_tokenizer, [out["sample_prompt"]], max_new_tokens=32)[0]
    return out


def task_results(model: Any, tokenizer: Any, task: list, *, mode: str) -> dict:
    """Accuracy on the embedded task and the sample to show: one of the answers scored, right where any is."""
    from hf_dist.embedded.task_eval import accuracy, answer_all, is_right, showcase, task_prompt

    answers = answer_all(model, tokenizer, task, mode=mode)
    shown = showcase(answers, task)
    return {
        "accuracy_after": accuracy(answers, task),
        "sample_prompt": task_prompt(tokenizer, task[shown], mode),
        "sample_output": answers[shown],
        "sample_expected": task[shown].answer,
        "sample_right": is_right(answers[shown], task[shown]),
    }


def _check_adapter_loaded(model: Any, export_dir: Path) -> None:
    """LoRA B matrices start at zero, so all-zero B after loading means PEFT matched none of the
    exported keys (it only warns) and the "fine-tuned" model is the bare base."""
    from safetensors import safe_open

    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    if lora_b and all(float(p.abs().max()) == 0.0 for p in lora_b):
        with safe_open(str(ConfinedFolder(export_dir).path("adapter_model.safetensors")), "pt") as fh:
            keys = sorted(fh.keys())[:3]
        raise RuntimeError(
            f"the adapter exported to {export_dir} did not load: every lora_B is zero after from_pretrained. "
            f"Its keys start {keys}; PEFT expects 'base_model.model.<module>.lora_B.weight'"
        )
