"""A red-team pass over the new layouts' surface, as one table (issue 21): every case is an attempt to make hf_dist run
foreign code, resume the wrong state, export another run's weights, run something other than the flags say, or write
a config the planner refuses. Each must fail before anything runs, with a message naming what was received and
what to do; the payload cases also prove the payload never ran.

Classes: payload x file kind x entry point; resume x layout x path form; re-run into a used folder; recipe flag x
user config; `hf-dist config` against the planner's validation.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_dist.cli.main import main
from hf_dist.planning.features import installed_features
from tests.unit.checkpoint.fakes import make_autotp_checkpoint, make_zero_checkpoint, tiny_model_state
from tests.unit.checkpoint.safety.test_entry_points import _args_for, _build

STATE = tiny_model_state()


def payload(kind: str, fmt: str, entry: str):
    """A payload planted in ``kind`` (zip, a zip with two central directories, or legacy tar), reached through
    ``entry``."""

    def run(tmp: Path) -> str:
        from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
        from hf_dist.checkpoint.lifecycle.reshard import prepare_resume, reshard

        ckpt, _, marker = _build(kind, tmp, STATE, fmt)
        try:
            if entry == "auto_resume":
                auto_resume(ckpt.parent, training_args=_args_for(ckpt))
            elif entry == "prepare_resume":
                prepare_resume(ckpt, 3, training_args=_args_for(ckpt))
            elif entry == "reshard":
                reshard(ckpt, tmp / "copy")
            else:  # convert / verify, through the CLI
                argv = [entry, str(ckpt), str(tmp / "hf" if entry == "convert" else ckpt)]
                code = main(argv)
                raise RuntimeError(f"{entry} exit code {code}")
        finally:
            assert not marker.exists(), "the payload ran"
        return "no error"

    return run


def resume_case(layout: str, form: str):
    """A checkpoint that must not be resumed as is, given as ``form``: the run folder or the checkpoint path."""

    def run(tmp: Path) -> str:
        from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
        from hf_dist.checkpoint.lifecycle.reshard import prepare_resume

        config, state = STATE
        ckpt = tmp / "run" / "checkpoint-3"
        if layout == "zero3 for zero2":
            from tests.unit.checkpoint.fakes import seal

            make_zero_checkpoint(ckpt, config, state, stage=3)
            seal(ckpt, world_size=2, step=3)  # complete: only the strategy is wrong
            args = _args_for(ckpt)
            args.deepspeed = args.hf_deepspeed_config.config = {"zero_optimization": {"stage": 2}}
        elif layout == "unprovable":
            make_zero_checkpoint(ckpt, config, state, stage=3)  # no marker, no trainer_state.json
            args = None
        elif layout == "autotp missing rank":
            tag = make_autotp_checkpoint(ckpt, config, state, tp=2)
            next(tag.glob("*zero_pp_rank_0_mp_rank_01_optim_states.pt")).unlink()
            from hf_dist.checkpoint.conversion.convert import convert

            return convert(ckpt, tmp / "out", progress=False)
        if form == "folder":
            return auto_resume(tmp / "run", training_args=args) if args else auto_resume(tmp / "run", world_size=2)
        if form == "checkpoint as folder":
            return auto_resume(ckpt)
        return prepare_resume(ckpt, 2, training_args=args)

    return run


def rerun(tmp: Path) -> str:
    """A fresh recipe run into a folder holding another run's checkpoints."""
    import hf_dist.recipe_utils as ru

    (tmp / "checkpoint-4").mkdir()
    return ru.check_output_dir(str(tmp), resuming=False)


def recipe_sizes(config_kind: str, sizes: dict):
    """Recipe size flags next to the user's own strategy config."""

    def run(tmp: Path):
        import hf_dist.recipe_utils as ru
        from hf_dist import PlanRequest
        from hf_dist.configs.deepspeed import deepspeed_config

        ds = {"zero2": deepspeed_config("zero2"), "zero2 sp": deepspeed_config("zero2", sp_size=2)}[config_kind]
        kwargs = {"output_dir": str(tmp), "deepspeed": ds, "report_to": []}
        return ru.training_arguments(kwargs, {"deepspeed"}, None, PlanRequest(method="full", seq_len=16, **sizes))

    return run


def cli(*argv: str, code: int = 1):
    """``hf-dist ARGV``: a refusal shows as SystemExit(exit code); any other exit code as a RuntimeError."""

    def run(tmp: Path) -> str:
        got = main([a.replace("{tmp}", str(tmp)) for a in argv])
        if got != code:
            raise RuntimeError(f"exit code {got}")
        raise SystemExit(code)

    return run


def auto(**kwargs):
    def run(tmp: Path):
        from hf_dist.auto import auto_args
        from hf_dist.testing import tiny_llama_config

        return auto_args(tiny_llama_config(), gpus=4, gpu_memory_gib=80, seq_len=64, global_batch_size=16, **kwargs)

    return run


def wrote_autotp_json_then(*argv: str):
    def run(tmp: Path) -> str:
        assert main(["config", "--strategy", "zero2", "--format", "deepspeed", "--out", str(tmp / "ds.json")]) == 0
        return cli(*argv)(tmp)

    return run


UNSAFE = "UnsafePickleError"
# (id, attempt, exception type name, message pattern)
CASES = [
    # payload x file kind x entry point (zip archives and torch's legacy tar format)
    ("tar zero2 optimizer via auto_resume", payload("zero2 optimizer states", "tar", "auto_resume"), UNSAFE, "legacy tar"),
    ("tar zero2 model via prepare_resume", payload("zero2 model states", "tar", "prepare_resume"), UNSAFE, "legacy tar"),
    ("tar zero3 model via reshard", payload("zero3 model states", "tar", "reshard"), UNSAFE, "legacy tar"),
    ("zip zero3 model via convert", payload("zero3 model states", "zip", "convert"), "RuntimeError", "exit code 1"),
    ("zip dcp metadata via verify", payload("dcp .metadata", "zip", "verify"), "RuntimeError", "exit code 1"),
    ("zip dcp value via auto_resume", payload("dcp non-tensor value in .distcp", "zip", "auto_resume"), UNSAFE, "mkdir"),
    ("tar fsdp .bin via convert", payload("pytorch_model_fsdp.bin", "tar", "convert"), "RuntimeError", "exit code 1"),
    ("two-directory zip zero2 optimizer via auto_resume", payload("zero2 optimizer states", "two directories",
     "auto_resume"), UNSAFE, "mkdir"),
    ("zip rng state via prepare_resume", payload("rng_state_1.pth", "zip", "prepare_resume"), UNSAFE, "mkdir"),
    ("tar scheduler via auto_resume", payload("scheduler.pt", "tar", "auto_resume"), UNSAFE, "legacy tar"),
    # resume x layout x path form
    ("zero3 checkpoint for a zero2 run, folder", resume_case("zero3 for zero2", "folder"), "RuntimeError",
     r"holds DeepSpeed ZeRO-3.*hf-dist convert"),
    ("zero3 checkpoint for a zero2 run, path", resume_case("zero3 for zero2", "path"), "RuntimeError",
     r"holds DeepSpeed ZeRO-3"),
    ("checkpoint folder given as output_dir", resume_case("zero3 for zero2", "checkpoint as folder"), "ValueError",
     r"which is a checkpoint folder itself.\n  Pass the run's output_dir"),
    ("unprovable checkpoints never restart silently", resume_case("unprovable", "folder"), "RuntimeError",
     r"none can be proven complete.*trainer_state.json is missing.*fresh_start=True"),
    ("AutoTP rank without its optimizer file", resume_case("autotp missing rank", "path"), "ValueError",
     r"of tensor-parallel rank 1 \(mp_rank_01\); missing rank\(s\) \[0\]"),
    # re-run into a used folder
    ("fresh recipe run over another run's checkpoints", rerun, "ValueError",
     r"already holds checkpoints of an earlier run \(checkpoint-4\).*--resume_from_checkpoint auto"),
    # recipe flag x user config
    ("--tp_size 2 with a ZeRO-2 JSON", recipe_sizes("zero2", {"tp_size": 2}), "ValueError",
     r"--tp_size 2 asks for what your own strategy config \(deepspeed\) does not run \(tp 1\)"),
    ("--sp_size 2 with a ZeRO-2 JSON", recipe_sizes("zero2", {"sp_size": 2}), "ValueError", r"--sp_size 2 .*\(sp 1\)"),
    ("--tp_size 2 with a ZeRO-2 SP JSON", recipe_sizes("zero2 sp", {"tp_size": 2}), "ValueError", r"\(tp 1\)"),
    ("parallelism_config tp 1 under tp_size 2", auto(strategy="fsdp_full_shard", tp_size=2,
     parallelism_config={"tp_size": 1}), "ValueError", r"parallelism_config tp_size=1 contradicts the plan"
     if installed_features().tp_distributed_config  # transformers < 5.23 refuses the layout before the merge
     else r"tp_size 2 with 2 data-parallel ranks needs transformers >= 5.23"),
    ("autotp_size in a zero2 override", auto(strategy="zero2", deepspeed={"tensor_parallel": {"autotp_size": 2}}),
     "ValueError", r"tensor_parallel'\]=\{'autotp_size': 2\} contradicts the plan \(zero2\)"),
    ("sequence_parallel_size in an override", auto(strategy="zero2", deepspeed={"sequence_parallel_size": 2}),
     "ValueError", r"sequence_parallel_size'\]=2 contradicts"),
    ("checkpointing flag against the plan", auto(strategy="ddp", activation_checkpointing=False,
     gradient_checkpointing=True), "ValueError", r"contradicts the plan, which does not checkpoint"),
    ("LoRA pinned with TP", auto(strategy="fsdp_full_shard", tp_size=2, method="lora"), "ValueError",
     r"PEFT's LoRA layers do not run on tensor-parallel weights"),
    # hf-dist config against the planner's validation
    ("config: AutoTP with Ulysses", cli("config", "--strategy", "zero2", "--tp-size", "2", "--sp-size", "2",
     "--format", "deepspeed"), "SystemExit", "1"),
    ("config: TP not dividing the processes", cli("config", "--strategy", "zero2", "--tp-size", "2",
     "--num-processes", "3", "--format", "deepspeed"), "SystemExit", "1"),
    ("config: --nvme-path dropped", cli("config", "--strategy", "zero3", "--offload", "optimizer", "--nvme-path",
     "{tmp}"), "SystemExit", "1"),
    ("config: missing DeepSpeed JSON", cli("config", "--strategy", "zero2", "--deepspeed-config-file",
     "{tmp}/missing.json"), "SystemExit", "1"),
    ("config: JSON without the asked AutoTP size", wrote_autotp_json_then("config", "--strategy", "zero2",
     "--tp-size", "2", "--deepspeed-config-file", "{tmp}/ds.json"), "SystemExit", "1"),
    ("config: AutoTP with ZeRO-3", cli("config", "--strategy", "zero3", "--tp-size", "2", "--format", "deepspeed"),
     "SystemExit", "1"),
    ("config: SP with FSDP", cli("config", "--strategy", "fsdp_full_shard", "--sp-size", "2"), "SystemExit", "1"),
    ("config: CP with ZeRO", cli("config", "--strategy", "zero3", "--cp-size", "2", "--format", "deepspeed"),
     "SystemExit", "1"),
]  # fmt: skip
# what each hf-dist config case must say on stderr
CONFIG_MESSAGES = {
    "config: AutoTP with Ulysses": "do not compose",
    "config: TP not dividing the processes": "does not divide world_size 3",
    "config: --nvme-path dropped": "is used only with --offload-device nvme",
    "config: missing DeepSpeed JSON": "missing.json does not exist",
    "config: JSON without the asked AutoTP size": "has autotp_size 1 and sequence_parallel_size 1",
    "config: AutoTP with ZeRO-3": "AutoTP runs with ZeRO stage <= 2",
    "config: SP with FSDP": "runs only with DeepSpeed",
    "config: CP with ZeRO": "only with FSDP2",
}


LINE_LIMIT = 400  # an error is a few readable lines, not one line of 1,000 characters


def test_the_table_has_every_class_and_at_least_30_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "attempt", "error", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_red_team(name, attempt, error, pattern, tmp_path, capsys, monkeypatch):
    if name.startswith(("tar", "zip", "two-directory")):
        monkeypatch.setenv("WORLD_SIZE", "3")  # resuming on another world size: the reshard paths are taken
    with pytest.raises(BaseException) as caught:  # noqa: PT011  (the type is checked by name below)
        attempt(tmp_path)
    assert type(caught.value).__name__ == error, f"{name}: {type(caught.value).__name__}: {caught.value}"
    assert re.search(pattern, str(caught.value), re.S), f"{name}: {caught.value}"
    err = capsys.readouterr().err
    longest = max(len(line) for line in [*str(caught.value).splitlines(), *err.splitlines(), ""])
    assert longest <= LINE_LIMIT, f"{name}: a {longest}-character line: {caught.value}"
    if name in CONFIG_MESSAGES:
        assert CONFIG_MESSAGES[name] in err, err
        assert not (tmp_path / "out").exists()
    if (
        name.startswith(("zip", "tar", "two-directory")) and error == "RuntimeError"
    ):  # the CLI named the file and refused
        assert "refusing to" in err and ("posix.mkdir" in err or "legacy tar" in err), err
