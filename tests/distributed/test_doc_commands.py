"""The docs' launch lines run as printed: each ``Launch`` entry of tests/doc_catalog.py, from its doc text.

A line runs as a subprocess in a fresh folder standing for the repository root (``recipes/`` etc. linked), with only
the declared substitutions (8 GPUs -> 2 CPU ranks, a hub model -> a tiny local folder), the files the doc assumes,
and the entry's extra flags (2 steps of a tiny model). What the doc states is checked: exit code, the strategy and
world size that ran, the checkpoints, a rerun's resume step, a refusal's first line. A line whose ``after`` names
another launch continues in a copy of that launch's folder (launched once per session). A launch whose rank dies
of gloo's rare abort is launched once more in a fresh folder, with a warning.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest

from hf_dist.testing import GLOO_ABORT
from tests.doc_catalog import CATALOG, Launch
from tests.doc_commands import doc_commands
from tests.doc_runs import Ran, files_under, link_repo, prepare, run_subprocess

pytestmark = pytest.mark.distributed

DOC = doc_commands()
LAUNCH_LINES = [command for command, entry in CATALOG.items() if isinstance(entry, Launch)]


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """command -> the folder and result of its launch, launched once per session on first use."""
    done: dict[str, Ran] = {}

    def get(command: str) -> Ran:
        if command not in done:
            done[command] = _launch_retrying(command, tmp_path_factory)
        return done[command]

    return get


def _launch_retrying(command: str, tmp_path_factory) -> Ran:
    ran = _launch(command, tmp_path_factory.mktemp("doc_launch"))
    if ran.outcome.code != 0 and GLOO_ABORT in ran.outcome.err:
        warnings.warn(
            f"{command!r}: a rank died of gloo's abort at exit; launched once more", RuntimeWarning, stacklevel=2
        )
        ran = _launch(command, tmp_path_factory.mktemp("doc_launch"))
    return ran


def _launch(command: str, ws: Path) -> Ran:
    entry = CATALOG[command]
    ran = Ran(ws, [])
    link_repo(ws)
    prepare(ws, entry.setup, ran.facts)
    ran.facts["files_before"] = files_under(ws)
    for more in entry.runs:
        ran.words, outcome = run_subprocess(command, ws, extra=(*entry.extra, *more), env=entry.env)
        ran.outcomes.append(outcome)
    return ran


def _continue(command: str, launched, tmp_path: Path) -> Ran:
    """``command`` run in a copy of the folder its ``after`` line's launch left."""
    entry = CATALOG[command]
    (before,) = entry.after
    first = launched(before)
    assert first.outcome.code == 0, f"{before!r} (run first, as the doc does) failed:\n{first.outcome.err[-3000:]}"
    ws = tmp_path / "ws"
    shutil.copytree(first.ws, ws, symlinks=True)
    ran = Ran(ws, [], facts=dict(first.facts))
    for more in entry.runs:
        ran.words, outcome = run_subprocess(command, ws, extra=(*entry.extra, *more), env=entry.env)
        ran.outcomes.append(outcome)
    return ran


@pytest.mark.parametrize("command", LAUNCH_LINES, ids=[DOC.get(c, ["?"])[0] for c in LAUNCH_LINES])
def test_doc_launch_line(command, launched, tmp_path):
    entry = CATALOG[command]
    ran = _continue(command, launched, tmp_path) if entry.after else launched(command)
    for check in entry.checks:
        try:
            check(ran)
        except AssertionError as exc:
            raise AssertionError(f"{', '.join(DOC.get(command, ['?']))}: {command}\n{exc}") from None
