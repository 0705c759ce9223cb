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


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """``--trust-remote-code``: the one permission to import the Python files a model config's ``auto_map`` names."""
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        dest="trust_remote_code",
        help="import the modelling code the model config's auto_map names (files in its folder); only for a folder "
        "you trust. Without it that code never runs: a registered model_type (llama, ...) is read with "
        "transformers' own class, anything else is refused",
    )


def arg_kwargs(args: argparse.Namespace, *names: str, **renamed: str) -> dict[str, Any]:
    """The parsed flags ``names`` as keyword arguments of the same names, and ``keyword=flag`` for ``renamed``:
    ``arg_kwargs(args, "tag", global_batch_size="global_batch")`` is
    ``{"tag": args.tag, "global_batch_size": args.global_batch}``."""
    kwargs = {name: getattr(args, name) for name in names}
    kwargs.update({keyword: getattr(args, flag) for keyword, flag in renamed.items()})
    return kwargs
