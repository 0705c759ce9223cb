"""What a doc line must produce: the outcome its doc states, checked on the folder it ran in (tests/doc_runs.py).

A check is called with a :class:`~tests.doc_runs.Ran` and raises an ``AssertionError`` naming what the doc promised
and showing the tails of the run's output.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from hf_dist.testing import REPO_ROOT
from tests.doc_runs import Outcome, Ran, files_under


def _fail(what: str, outcome: Outcome) -> AssertionError:
    return AssertionError(
        f"{what}\n--- stdout (tail) ---\n{outcome.out[-3000:]}\n--- stderr (tail) ---\n{outcome.err[-3000:]}"
    )


def _exit(outcome: Outcome, code: int = 0) -> None:
    if outcome.code != code:
        raise _fail(f"exit code {outcome.code}, the doc expects {code}", outcome)


def _option(words: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``words`` (the one argparse keeps)."""
    values = [words[i + 1] for i, word in enumerate(words[:-1]) if word == flag]
    return values[-1] if values else None


@dataclass(frozen=True)
class Exits:
    """Exit code ``code`` on every run, and each of ``says`` in its output."""

    code: int = 0
    says: tuple[str, ...] = ()

    def __call__(self, ran: Ran) -> None:
        for outcome in ran.outcomes:
            _exit(outcome, self.code)
            missing = [text for text in self.says if text not in outcome.out + outcome.err]
            if missing:
                raise _fail(f"the output does not say {missing}", outcome)


@dataclass(frozen=True)
class Refusal:
    """A non-zero exit, and a refusal whose first line starts with ``first_line`` (an exception's type prefix
    aside): for ``hf-dist`` the first line it prints; for a launch the first line of the refusal among the
    launcher's output."""

    first_line: str
    first_printed: bool = True

    def __call__(self, ran: Ran) -> None:
        if ran.outcome.code == 0:
            raise _fail("exit code 0, the doc states a refusal", ran.outcome)
        if self.first_printed:
            found = ran.outcome.first_line()
        else:
            lines = [EXCEPTION.sub("", line) for line in (ran.outcome.err + ran.outcome.out).splitlines()]
            found = next((line for line in lines if line.startswith(self.first_line)), "(no such line)")
        if not found.startswith(self.first_line):
            raise _fail(f"refusal {found!r}, the doc expects it to start {self.first_line!r}", ran.outcome)


# an exception's type, or the prefix a recipe prints its refusal behind (hf_dist.recipe_utils.refusal)
EXCEPTION = re.compile(r"^([\w.]*(Error|Exception)|\[hf_dist\] refused): ")


@dataclass(frozen=True)
class Plan:
    """``hf-dist plan``: exit 0 and the chosen strategy (the ``chosen:`` line above the table, or the JSON's)."""

    chosen: str

    def __call__(self, ran: Ran) -> None:
        _exit(ran.outcome)
        if "--json" in ran.words:
            strategy = json.loads(ran.outcome.out)["strategy"]
        else:
            match = re.search(r"^chosen: (\w+)", ran.outcome.out, re.M)
            strategy = match.group(1) if match and "CHOSEN" in ran.outcome.out else None
        if strategy != self.chosen:
            raise _fail(f"chose {strategy!r}, the catalog expects {self.chosen!r}", ran.outcome)


ENGINES = {"ddp": "MULTI_GPU", "zero": "DEEPSPEED", "fsdp": "FSDP", "hsdp": "FSDP"}


@dataclass(frozen=True)
class ConfigWritten:
    """``hf-dist config``: exit 0, and the ``--out`` file sets up the ``--strategy`` asked for, read by accelerate's
    own loader (YAML) or as DeepSpeed JSON (``--format deepspeed``)."""

    def __call__(self, ran: Ran) -> None:
        _exit(ran.outcome)
        out, strategy = ran.ws / _option(ran.words, "--out"), _option(ran.words, "--strategy")
        stage = int(strategy[4]) if strategy.startswith("zero") else None
        if _option(ran.words, "--format") == "deepspeed":
            got = json.loads(out.read_text())["zero_optimization"]["stage"]
            assert got == stage, f"{out.name}: ZeRO stage {got}, asked for {strategy}"
            return
        from accelerate.commands.config.config_args import load_config_from_file

        config = load_config_from_file(str(out))
        engine = ENGINES[re.match(r"[a-z]+?(?=\d|_|$)", strategy).group(0)]
        assert config.distributed_type == engine, f"{out.name}: {config.distributed_type}, asked for {strategy}"
        if stage:
            ds = config.deepspeed_config
            file = ds.get("deepspeed_config_file")
            got = json.loads((ran.ws / file).read_text())["zero_optimization"]["stage"] if file else ds["zero_stage"]
            assert got == stage, f"{out.name}: ZeRO stage {got} ({ds}), asked for {strategy}"


def _assert_weights(got: dict, want: dict, where: str) -> None:
    import torch

    assert set(got) == set(want), f"{where}: tensors {sorted(set(got) ^ set(want))} differ"
    for name, value in want.items():  # bf16 output of fp32 masters: within one bf16 step
        torch.testing.assert_close(got[name].float(), value.float(), rtol=1e-2, atol=1e-3, msg=f"{where}: {name}")


@dataclass(frozen=True)
class HfFolder:
    """``hf-dist convert``: exit 0, and ``path`` loads with ``from_pretrained`` as ``dtype`` holding the checkpoint's
    weights (a LoRA checkpoint's: merged), and with ``tokenizer`` a tokenizer."""

    path: str
    dtype: str = "bfloat16"
    tokenizer: bool = False

    def __call__(self, ran: Ran) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _exit(ran.outcome)
        if self.tokenizer:
            AutoTokenizer.from_pretrained(ran.ws / self.path)
        model = AutoModelForCausalLM.from_pretrained(ran.ws / self.path, dtype="auto")
        assert str(model.dtype) == f"torch.{self.dtype}", f"{self.path} loads as {model.dtype}, not {self.dtype}"
        if "peft" in ran.facts:
            want = ran.facts["peft"].merge_and_unload().state_dict()
        else:
            want = ran.facts["state"]
        _assert_weights(model.state_dict(), want, self.path)


@dataclass(frozen=True)
class AdapterFolder:
    """``hf-dist convert --adapter``: exit 0, and ``path`` loads with ``PeftModel.from_pretrained`` holding the run's
    LoRA tensors."""

    path: str

    def __call__(self, ran: Ran) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        _exit(ran.outcome)
        trained = ran.facts["peft"]
        base = AutoModelForCausalLM.from_config(trained.base_model.model.config)
        loaded = PeftModel.from_pretrained(base, ran.ws / self.path).state_dict()
        want = {name: value for name, value in trained.state_dict().items() if "lora_" in name}
        _assert_weights({name: loaded[name] for name in loaded if "lora_" in name}, want, self.path)


@dataclass(frozen=True)
class DcpFolder:
    """``hf-dist convert --to dcp``: exit 0, and ``dcp.load`` (no process group) fills the model's state dict with
    the source folder's weights."""

    path: str
    source: str

    def __call__(self, ran: Ran) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from transformers import AutoModelForCausalLM

        _exit(ran.outcome)
        want = AutoModelForCausalLM.from_pretrained(ran.ws / self.source, dtype="auto").state_dict()
        got = {name: torch.empty_like(value) for name, value in want.items()}
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": got}, checkpoint_id=str(ran.ws / self.path), no_dist=True)
        _assert_weights(got, want, self.path)


@dataclass(frozen=True)
class Verified:
    """``hf-dist verify``: exit 0, and the report's first line says OK."""

    def __call__(self, ran: Ran) -> None:
        _exit(ran.outcome)
        if not ran.outcome.out.startswith("OK:"):
            raise _fail("verify did not say OK", ran.outcome)


@dataclass(frozen=True)
class Recipe:
    """A recipe launch: exit 0; results.json names the strategy and world size that ran and the step it ended at
    (``--max_steps``); the export exists; the ``checkpoint-N`` folders are those the save flags ask for, each marked
    complete."""

    out: str
    strategy: str
    world_size: int
    checkpoints: tuple[int, ...] = ()

    def __call__(self, ran: Ran) -> None:
        from hf_dist.checkpoint.formats.names import MANIFEST_NAME

        _exit(ran.outcome)
        out = ran.ws / self.out
        results = json.loads((out / "results.json").read_text())
        got = (results["strategy"], results["world_size"], results["steps"])
        want = (self.strategy, self.world_size, int(_option(ran.words, "--max_steps")))
        assert got == want, f"ran (strategy, world size, steps) {got}, the line asks {want}"
        assert (ran.ws / results["export_dir"]).is_dir(), f"no export at {results['export_dir']}"
        found = tuple(sorted(int(path.name.split("-")[1]) for path in out.glob("checkpoint-*")))
        assert found == self.checkpoints, f"checkpoints {found}, the save flags ask for {self.checkpoints}"
        assert all((out / f"checkpoint-{n}" / MANIFEST_NAME).is_file() for n in found), f"unmarked: {found}"


@dataclass(frozen=True)
class Restarts:
    """The same line serves a restart and a rerun (``Launch.runs``, in a folder a first launch trained): the first
    run resumes from ``checkpoint-{resumes_from}`` of ``out``; the next, of a finished run, says so and trains
    nothing (no new checkpoint, the results unchanged)."""

    out: str
    resumes_from: int

    def __call__(self, ran: Ran) -> None:
        restart, rerun = ran.outcomes
        said = f"resuming from {self.out}/checkpoint-{self.resumes_from}"
        if restart.code != 0 or said not in restart.out:
            raise _fail(f"the restart did not exit 0 saying {said!r}", restart)
        if rerun.code != 0 or "[hf_dist] nothing to train: " not in rerun.out:
            raise _fail("the rerun of a finished run did not exit 0 saying it is finished", rerun)
        if "[hf_dist] running" in rerun.out:
            raise _fail("the rerun of a finished run trained", rerun)


@dataclass(frozen=True)
class CopiedOutput:
    """The doc's output block that starts with ``first`` (in ``doc``) was copied from a run of the line: each of its
    lines, timings masked and ``...`` lines skipped, is in the run's output. Checked on the newest tested versions
    (``make test``), the ones the docs' outputs come from; the lowest set (``make test-min``) plans other layouts."""

    doc: str
    first: str

    def __call__(self, ran: Ran) -> None:
        if not newest_tested():
            return
        said = _masked(ran.outcome.out + ran.outcome.err)
        lines = [line for line in output_block(REPO_ROOT / self.doc, self.first) if line.strip() not in ("", "...")]
        missing = [line for line in lines if _masked(line.strip()) not in said]
        if missing:
            raise _fail(
                f"{self.doc}: {len(missing)} printed line(s) not in the run's output: {missing[:3]}", ran.outcome
            )


def newest_tested() -> bool:
    """Are the installed versions the newest tested set (``NEWEST_TESTED``, what ``make test`` installs)?"""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    from hf_dist.runtime.support import NEWEST_TESTED

    def installed(name: str) -> str | None:
        try:
            return Version(version(name)).base_version
        except PackageNotFoundError:
            return None

    return all(installed(name) in (None, want) for name, want in NEWEST_TESTED.items())


TIMING = re.compile(r"\d+(\.\d+)? s\)")


def _masked(text: str) -> str:
    return TIMING.sub("<t> s)", text)


def output_block(doc: Path, first: str) -> list[str]:
    """The lines of the fenced block in ``doc`` whose first line starts with ``first``."""
    lines = doc.read_text().splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.lstrip().startswith("```") and lines[i + 1].startswith(first):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```"))
            return lines[i + 1 : end]
    raise AssertionError(
        f"{doc.relative_to(REPO_ROOT)} has no output block starting with {first!r}: update the catalog"
    )


@dataclass(frozen=True)
class Unchanged:
    """The line only reports: the folder holds the same files before and after."""

    def __call__(self, ran: Ran) -> None:
        added = sorted(set(files_under(ran.ws)) - set(ran.facts["files_before"]))
        assert not added, f"a report-only line wrote {added}"
