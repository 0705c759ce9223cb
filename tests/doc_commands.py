"""Every command line printed in README.md and docs/*.md, read from the docs themselves.

A command line is
* a line of a fenced ``bash``/``sh``/``shell`` block (``$ `` prompts dropped, ``\\`` continuations joined, ``#``
  comments and comment-only lines dropped);
* a ``$ ``-prompted line of a ``console`` block, and a ``$ ``-prompted line or a line starting with a known command
  of an unlabelled or ``text`` block (the rest of such blocks is output);
* inline code (which may wrap onto the next line of a paragraph) that starts with a known command and has at least
  one argument: a bare tool name in prose (`hf-dist convert`, `accelerate launch`) is not a command line, nor is a
  message that starts with one (`hf-dist convert: error: ...`).

Python, YAML and JSON blocks are not command lines (the README's Python snippet is run by
tests/unit/test_readme_snippet.py). Each command is normalised to single spaces: its key in tests/doc_catalog.py is
the doc text itself, so editing a doc line changes its key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hf_dist.testing import REPO_ROOT

SHELL_BLOCKS = {"bash", "sh", "shell", "zsh"}
PROMPT_BLOCKS = {"console"}  # commands only where prompted with "$ "
OUTPUT_BLOCKS = {"", "text"}  # commands only where prompted with "$ " or starting with a known command
# a command: optional VAR=value prefixes, then one of these programs, then at least one argument
COMMAND = re.compile(
    r"^(?:[A-Z_][A-Z0-9_]*=\S+ )*"
    r"(?:hf-dist|accelerate launch|torchrun|deepspeed|python3?|\.venv[\w-]*/bin/\w+|make|srun|sbatch|pytest) \S"
)
TOOLS_WITH_SUBCOMMANDS = {"hf-dist", "accelerate"}  # inline `hf-dist convert` names the subcommand
FENCE = re.compile(r"^\s*```\s*(\w*)")
INLINE = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


@dataclass(frozen=True)
class DocLine:
    command: str  # the doc text, whitespace collapsed: the catalog key
    where: str  # "docs/recipes.md:102"


def doc_files(root: Path = REPO_ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _strip_comment(line: str) -> str:
    """``cmd  # note`` -> ``cmd``; a ``#`` inside a word (``a#b``) or quotes is kept."""
    out, quote = [], None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).strip()


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _block_commands(lines: list[str], start: int, lang: str, rel: str) -> list[DocLine]:
    """Commands of the fenced block whose body is ``lines`` (the first at file line ``start``)."""
    found, i = [], 0
    while i < len(lines):
        first = i
        raw = lines[i].strip()
        prompted = raw.startswith("$ ")
        text = _strip_comment(raw.removeprefix("$ ")) if lang in SHELL_BLOCKS or prompted else raw
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + _strip_comment(lines[i].strip())
        i += 1
        if lang not in SHELL_BLOCKS:
            command = prompted or (lang in OUTPUT_BLOCKS and COMMAND.match(text))
            text = _strip_comment(text) if command else ""
        if text:
            found.append(DocLine(_normalise(text), f"{rel}:{start + first}"))
    return found


def _is_inline_command(text: str) -> bool:
    words = text.split()
    if not COMMAND.match(text) or words[1].endswith(":"):
        return False
    return len(words) > 2 or words[0] not in TOOLS_WITH_SUBCOMMANDS


def _inline_commands(paragraph: str, start: int, rel: str) -> list[DocLine]:
    found = []
    for match in INLINE.finditer(paragraph):
        text = _normalise(match.group(2))
        if _is_inline_command(text):
            line = start + paragraph.count("\n", 0, match.start())
            found.append(DocLine(text, f"{rel}:{line}"))
    return found


def file_commands(path: Path, root: Path = REPO_ROOT) -> list[DocLine]:
    """The command lines of one markdown file, in order."""
    rel = str(path.relative_to(root))
    lines = path.read_text().splitlines()
    found, prose, prose_start, i = [], [], 1, 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence and lines[i].strip():
            prose_start = prose_start if prose else i + 1
            prose.append(lines[i])
            i += 1
            continue
        found += _inline_commands("\n".join(prose), prose_start, rel)
        prose = []
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
            lang = fence.group(1).lower()
            if lang in SHELL_BLOCKS | PROMPT_BLOCKS | OUTPUT_BLOCKS:
                found += _block_commands(lines[i + 1 : end], i + 2, lang, rel)
            i = end
        i += 1
    return found + _inline_commands("\n".join(prose), prose_start, rel)


def doc_commands(root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """{command: ["file:line", ...]} over README.md and docs/*.md, in doc order."""
    found: dict[str, list[str]] = {}
    for path in doc_files(root):
        for doc_line in file_commands(path, root):
            found.setdefault(doc_line.command, []).append(doc_line.where)
    return found
