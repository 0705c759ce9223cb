"""Helpers the ``hf-dist`` subcommands share: positional arguments and handing parsed flags to a library call."""

from __future__ import annotations

import argparse
from typing import Any


def add_positional(parser: argparse.ArgumentParser, name: str, help: str | None = None, **kwargs: Any) -> None:
    """A positional argument shown in usage and help as its name in capitals (``src`` -> ``SRC``)."""
    parser.add_argument(name, metavar=name.upper(), help=help, **kwargs)


def add_checkpoint_paths(parser: argparse.ArgumentParser, src_help: str, dst_help: str, *, dst_required: bool = True):
    """``SRC`` (the checkpoint to read) and ``DST`` (the folder to write; optional: ``dst`` is then None)."""
    add_positional(parser, "src", src_help)
    add_positional(parser, "dst", dst_help, **({} if dst_required else {"nargs": "?"}))


def arg_kwargs(args: argparse.Namespace, *names: str, **renamed: str) -> dict[str, Any]:
    """The parsed flags ``names`` as keyword arguments of the same names, and ``keyword=flag`` for ``renamed``:
    ``arg_kwargs(args, "tag", global_batch_size="global_batch")`` is
    ``{"tag": args.tag, "global_batch_size": args.global_batch}``."""
    kwargs = {name: getattr(args, name) for name in names}
    kwargs.update({keyword: getattr(args, flag) for keyword, flag in renamed.items()})
    return kwargs
