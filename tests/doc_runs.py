"""How a catalogued doc line runs: the only changes to its text, the program that starts it, where it runs.

A doc line runs in a fresh folder standing for the repository root: the repository's ``recipes/``,
``accelerate_configs/``, ``examples/`` and ``benchmarks/`` are linked there (for launches), and the files the doc
assumes the reader has are written there by the entry's setups (tests/doc_setups.py), so every relative path of the
line is used as printed. Only :data:`SUBSTITUTIONS` change its text. The checks (tests/doc_checks.py) receive a
:class:`Ran`: the folder, the words that ran and one :class:`Outcome` per run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hf_dist.testing import REPO_ROOT, free_port

# doc text -> (what a CPU test runs instead, why); applied as whole words to `run` lines only, never anything else
SUBSTITUTIONS: dict[str, tuple[str, str]] = {
    "--num_processes 8": (
        "--multi_gpu --num_processes 2",
        "2 CPU ranks; without a config file accelerate spawns ranks on a machine without GPUs only with --multi_gpu",
    ),
    "--nproc_per_node 8": ("--nproc_per_node 2", "2 CPU ranks instead of 8 GPUs"),
    "meta-llama/Llama-3.1-8B-Instruct": ("./tiny-llama", "no hub here: a tiny Llama folder the test writes"),
    "meta-llama/Llama-3.1-8B": ("./llama-3.1-8b", "no hub here: a config folder of its shape the test writes"),
    "...": ("", "the doc's '...' (the reader's other flags): the entry's declared extra flags"),
}
REPO_FOLDERS = ("recipes", "accelerate_configs", "examples", "benchmarks")


@dataclass(frozen=True)
class Outcome:
    """One run of a doc line: exit code, stdout, stderr."""

    code: int
    out: str
    err: str

    def first_line(self) -> str:
        lines = [line for line in (self.err or self.out).splitlines() if line.strip()]
        return lines[0] if lines else ""


@dataclass
class Ran:
    """What a check sees: the folder it ran in, the words that ran, one outcome per run, and what the setups made."""

    ws: Path
    words: list[str]
    outcomes: list[Outcome] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    @property
    def outcome(self) -> Outcome:
        return self.outcomes[-1]


def substitute(command: str) -> str:
    """The doc line with every declared substitution applied (whole words only)."""
    for old, (new, _) in SUBSTITUTIONS.items():
        command = re.sub(rf"(?<!\S){re.escape(old)}(?!\S)", new, command)
    return " ".join(command.split())


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 cmd ...`` -> ({A: 1, B: 2}, [cmd, ...])."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def argv_of(command: str, extra: tuple[str, ...] = ()) -> tuple[dict[str, str], list[str]]:
    """(environment, words) of a doc line after substitution, with the entry's extra flags appended."""
    return split_env([*shlex.split(substitute(command)), *extra])


def program(words: list[str]) -> list[str]:
    """The line's program as started here, with its own arguments: accelerate and torchrun get a free port (other
    jobs share the machine), ``python`` is this interpreter."""
    if words[:2] == ["accelerate", "launch"]:
        port = ["--main_process_port", str(free_port())]
        return [sys.executable, "-m", "accelerate.commands.launch", *port, *words[2:]]
    if words[0] == "torchrun":
        port = ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
        return [sys.executable, "-m", "torch.distributed.run", *port, *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    raise ValueError(f"no way to start {words[0]!r} here: add it to program() in tests/doc_runs.py")


def link_repo(ws: Path) -> None:
    for name in REPO_FOLDERS:
        (ws / name).symlink_to(REPO_ROOT / name, target_is_directory=True)


# -- running a line --------------------------------------------------------------------------------------------------


def prepare(ws: Path, setups: tuple, facts: dict) -> None:
    """Write what the doc assumes into ``ws`` (``facts``: what the setups made, for the checks)."""
    for setup in setups:
        setup(ws, facts)


def run_in_process(command: str, capsys) -> tuple[list[str], Outcome]:
    """An ``hf-dist`` line through ``hf_dist.cli.main.main``, a ``python -c`` line's code executed, in this process
    (the caller chdir'ed into the folder); ``capsys`` is pytest's."""
    env, words = argv_of(command)
    assert not env, f"{command!r}: an in-process line cannot set {env}; make it a Launch"
    capsys.readouterr()
    if words[0] == "hf-dist":
        from hf_dist.cli.main import main

        try:
            code = main(words[1:])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    elif words[:2] == ["python", "-c"]:
        exec(compile(words[2], "<doc line>", "exec"), {"__name__": "__main__"})
        code = 0
    else:
        raise ValueError(f"{command!r} cannot run in-process: make it a Launch")
    captured = capsys.readouterr()
    return words, Outcome(int(code or 0), captured.out, captured.err)


def run_subprocess(command: str, ws: Path, *, extra: tuple = (), env: tuple = (), timeout: float = 600):
    """A launcher/script line as a subprocess in ``ws`` on CPU (tests' one thread per rank, offline hub), with the
    entry's declared environment and the line's own ``VAR=value`` prefixes; returns (words, outcome)."""
    from hf_dist.testing import cpu_env

    line_env, words = argv_of(command, extra)
    proc = subprocess.run(program(words), cwd=ws, env=cpu_env({**dict(env), **line_env}), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    return words, Outcome(proc.returncode, proc.stdout, proc.stderr)


def files_under(ws: Path) -> list[str]:
    """Every path under ``ws``, relative (symbolic links to folders not followed)."""
    return [str(path.relative_to(ws)) for path in ws.rglob("*") if "__pycache__" not in path.parts]
