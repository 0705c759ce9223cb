"""Class attributes of the installed transformers, read from its source by AST: nothing of it is imported.

Importing transformers' configuration and modelling modules takes longer than a whole plan (issue 39), yet a few
facts a plan needs changed between the tested releases: Gemma 2's ``_supports_sdpa`` (5.0 runs it under sdpa,
5.24 only eager), and the tensor-parallel plan of the mixtures of experts (``base_model_tp_plan``: 5.0 names
Mixtral's experts ``local_colwise``/``local_rowwise``, 5.24 ``packed_colwise``/``rowwise``). Each is a literal in
the class body, so :func:`class_literal` reads it from the file the installed transformers would import.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any

UNREAD = object()  # transformers is absent, the class is not where it was looked for, or it says other than plainly


@functools.cache
def class_literal(module_file: str, class_name: str, attribute: str, bases: tuple[str, ...], default: Any) -> Any:
    """The literal ``class_name`` assigns to ``attribute`` in transformers' ``module_file`` (relative to the package),
    ``default`` when the class does not assign it, or :data:`UNREAD`. ``bases``: the base classes the class may
    derive from (the value it does not assign is then theirs, ``default``); any other base, or a value that is not
    a literal, is :data:`UNREAD`. Callers must not change a returned dict (it is cached)."""
    spec = importlib.util.find_spec("transformers")
    source = Path(spec.origin).parent / module_file if spec and spec.origin else None
    if source is None or not source.is_file():
        return UNREAD
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            if not {ast.unparse(base) for base in node.bases} <= set(bases):
                return UNREAD
            return _assigned(node, attribute, default)
    return UNREAD


def _assigned(node: ast.ClassDef, attribute: str, default: Any) -> Any:
    """The literal the class body ``node`` assigns to ``attribute`` (the last assignment), ``default`` if none."""
    value = default
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == attribute:
            return UNREAD
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else target
        if isinstance(target, ast.Name) and target.id == attribute:
            try:
                value = ast.literal_eval(stmt.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return UNREAD
    return value
