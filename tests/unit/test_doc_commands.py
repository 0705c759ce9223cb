"""Every command line printed in README.md and docs/ is run by a test, or says who runs it or why nothing can.

The lines come from the docs themselves (tests/doc_commands.py); tests/doc_catalog.py says for each how it runs. A new
or edited doc line fails here, naming the file and line, until it is catalogued; an entry whose line left the docs,
a named test that does not exist and a benchmark whose copied output is gone fail too. The catalog's ``Run`` lines
(``hf-dist``, ``python -c``) run here in-process from the doc text; its ``Launch`` lines run in
tests/distributed/test_doc_commands.py.
"""

from __future__ import annotations

import re
import shlex

import pytest

from hf_dist.testing import REPO_ROOT
from tests.doc_catalog import CATALOG, CI, DOC_LAUNCH, CannotRun, Launch, RanBy, Run
from tests.doc_commands import doc_commands
from tests.doc_runs import SUBSTITUTIONS, Ran, files_under, prepare, run_in_process

DOC = doc_commands()
RUN_LINES = [command for command, entry in CATALOG.items() if isinstance(entry, Run)]


def _where(command: str) -> str:
    places = DOC.get(command, ["(not in the docs)"])
    return places[0] + (f" (and {len(places) - 1} more)" if len(places) > 1 else "")


SAMPLE = """Run `hf-dist plan ./m
--gpus 2`, not `hf-dist convert` nor `hf-dist convert: error: x`.

```console
$ hf-dist env   # a note
torch 2.13
```

```bash
# a comment line
FOO=1 torchrun --nproc_per_node 2 \\
    a.py --x "a # b"   # trailing
```

```
output line
$ make demo
python -m x
```

```python
main(["plan"])
```
"""


def test_the_extractor_finds_every_kind_of_command_line(tmp_path):
    from tests.doc_commands import file_commands

    (tmp_path / "x.md").write_text(SAMPLE)
    assert [(line.command, line.where) for line in file_commands(tmp_path / "x.md", tmp_path)] == [
        ("hf-dist plan ./m --gpus 2", "x.md:1"),  # inline code wrapped onto the next line
        ("hf-dist env", "x.md:5"),  # a console block's prompt, comment stripped; its output is not a command
        ('FOO=1 torchrun --nproc_per_node 2 a.py --x "a # b"', "x.md:11"),  # continuation joined, quoted # kept
        ("make demo", "x.md:17"),  # an output block's prompted line ...
        ("python -m x", "x.md:18"),  # ... and its line that starts with a known command
    ]


def test_every_command_line_in_the_docs_is_catalogued():
    missing = [f"  {where[0]}: {command}" for command, where in DOC.items() if command not in CATALOG]
    assert not missing, (
        "command lines in README.md/docs with no entry in tests/doc_catalog.py's CATALOG (a Run/Launch from the doc "
        "text, RanBy a test that runs it, or CannotRun with the reason):\n" + "\n".join(missing)
    )


def test_every_catalog_entry_is_still_in_the_docs():
    gone = [command for command in CATALOG if command not in DOC]
    assert not gone, "catalogued in tests/doc_catalog.py but no longer printed in the docs:\n" + "\n".join(gone)


def _test_ids(text: str) -> list[tuple[str, str]]:
    return re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", text)


def test_every_test_a_catalog_entry_names_exists():
    wrong = []
    for command, entry in CATALOG.items():
        texts = [entry.test, entry.note] if isinstance(entry, RanBy) else [getattr(entry, "reason", "")]
        for path, name in _test_ids(" ".join(texts)):
            source = REPO_ROOT / path
            if not source.is_file() or (name and not re.search(rf"^def {name}\(", source.read_text(), re.M)):
                wrong.append(f"  {_where(command)}: {path}::{name}")
        if isinstance(entry, RanBy) and entry.test != CI and not _test_ids(entry.test):
            wrong.append(f"  {_where(command)}: {entry.test!r} is not a test id or {CI}")
        if isinstance(entry, RanBy) and entry.test == DOC_LAUNCH:
            other = re.match(r"`([^`]+)`", entry.note)
            if not (other and isinstance(CATALOG.get(other.group(1)), Launch)):
                wrong.append(f"  {_where(command)}: its note must start with the `Launch` line that runs it")
    assert not wrong, "tests named in tests/doc_catalog.py that do not exist:\n" + "\n".join(wrong)


def _ci_make_targets() -> set[str]:
    """The make targets .ci/run runs, with their prerequisites (from the Makefile)."""
    targets = set()
    for match in re.finditer(r"\bmake((?: [\w-]+)+)", (REPO_ROOT / CI).read_text()):
        targets |= set(match.group(1).split())
    rules = dict(re.findall(r"^([\w-]+):(.*)$", (REPO_ROOT / "Makefile").read_text(), re.M))
    todo = list(targets)
    while todo:
        for dep in rules.get(todo.pop(), "").split():
            if dep in rules and dep not in targets:
                targets.add(dep)
                todo.append(dep)
    return targets


def test_lines_ran_by_ci_are_run_by_ci():
    """A ``make X`` line: .ci/run makes X (or a target needing it). A pytest line: every path it names exists, and
    ``make test`` (in .ci/run) runs all of tests/."""
    targets, wrong = _ci_make_targets(), []
    assert "test" in targets, f"{CI} no longer runs `make test`"
    for command, entry in CATALOG.items():
        if not isinstance(entry, RanBy) or entry.test != CI:
            continue
        words = shlex.split(command)
        if words[0] == "make":
            wrong += [f"  {_where(command)}: {CI} never makes {t!r}" for t in words[1:] if t not in targets]
            continue
        paths = [word for word in words if word.startswith("tests")]
        assert "pytest" in command and paths, f"{command!r}: RanBy({CI}) is for make targets and pytest lines"
        wrong += [f"  {_where(command)}: {path} does not exist" for path in paths if not (REPO_ROOT / path).exists()]
    assert not wrong, "\n".join(wrong)


def test_benchmarks_that_cannot_run_show_output_copied_from_a_run():
    gone = [
        f"  {_where(command)}: {entry.output[0]} no longer holds {entry.output[1]!r}"
        for command, entry in CATALOG.items()
        if isinstance(entry, CannotRun)
        and entry.output
        and entry.output[1] not in (REPO_ROOT / entry.output[0]).read_text()
    ]
    assert not gone, (
        "a benchmark's copied output changed: check it came from a run, then update the catalog:\n" + "\n".join(gone)
    )


def test_after_lines_are_run_lines_of_the_same_kind():
    for command, entry in CATALOG.items():
        for before in getattr(entry, "after", ()):
            assert type(CATALOG.get(before)) is type(entry), f"{command!r}: its `after` {before!r} is no {type(entry)}"


def test_every_substitution_is_used_by_a_run_line():
    runs = [command for command, entry in CATALOG.items() if isinstance(entry, (Run, Launch))]
    unused = [old for old in SUBSTITUTIONS if not any(re.search(rf"(?<!\S){re.escape(old)}(?!\S)", c) for c in runs)]
    assert not unused, f"substitutions no run line needs (remove them from tests/doc_runs.py): {unused}"


@pytest.mark.parametrize("command", RUN_LINES, ids=[DOC.get(c, ["?"])[0] for c in RUN_LINES])
def test_doc_line_runs(command, tmp_path, monkeypatch, capsys):
    entry = CATALOG[command]
    monkeypatch.chdir(tmp_path)
    ran = Ran(tmp_path, [])
    prepare(tmp_path, entry.setup, ran.facts)
    for before in entry.after:
        _, outcome = run_in_process(before, capsys)
        assert outcome.code == 0, f"{before!r} (run first, as the doc does) failed:\n{outcome.err[-3000:]}"
    ran.facts["files_before"] = files_under(tmp_path)
    ran.words, outcome = run_in_process(command, capsys)
    ran.outcomes.append(outcome)
    for check in entry.checks:
        try:
            check(ran)
        except AssertionError as exc:
            raise AssertionError(f"{_where(command)}: {command}\n{exc}") from None


def test_cpu_launch_lines_leave_nothing_to_accelerates_defaults(monkeypatch, caplog):
    """A line printed to be run as written on CPU ranks (``ACCELERATE_USE_CPU=1 accelerate launch ...``) passes every
    value accelerate would otherwise default and list in its "values were not passed" block (the TP line printed that
    block): checked with accelerate's own validation of the line's arguments, without a user's `accelerate config`."""
    import logging

    from accelerate.commands import launch as accelerate_launch

    monkeypatch.setattr(accelerate_launch, "default_config_file", str(REPO_ROOT / "no-such-default-config.yaml"))
    monkeypatch.chdir(REPO_ROOT)  # a --config_file is relative to the repository
    cpu_lines = [line for line in DOC if "ACCELERATE_USE_CPU=1 accelerate launch" in line]
    assert any("--tp_size 2" in line for line in cpu_lines)
    for line in cpu_lines:
        words = shlex.split(line)
        for word in words[: words.index("accelerate")]:
            monkeypatch.setenv(*word.split("=", 1))
        args = accelerate_launch.launch_command_parser().parse_args(words[words.index("launch") + 1 :])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=accelerate_launch.logger.name):
            accelerate_launch._validate_launch_command(args)
        assert "were not passed" not in caplog.text, f"{line}:\n{caplog.text}"
