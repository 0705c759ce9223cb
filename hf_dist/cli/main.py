"""`hf-dist` entry point. Registers one subcommand per module in ``hf_dist.cli``.

Each subcommand module defines ``HELP``, ``DESCRIPTION``, ``EPILOG`` (examples), ``add_arguments(parser)``
and ``run(args) -> int``, and keeps heavy imports inside ``run``, so ``hf-dist --help`` is instant. A bad input is one line on stderr and
exit 1; a reader that closes the pipe early (``hf-dist plan ... | head``) ends the command quietly, with exit 141
(:data:`PIPE_CLOSED_EXIT`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand name -> module under hf_dist.cli
SUBCOMMANDS = {
    "plan": "plan",
    "config": "config",
    "env": "env",
    "convert": "convert",
    "verify": "verify",
    "reshard": "reshard",
    "bench": "bench",
}

EPILOG = """examples:
  hf-dist plan meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory 80
  hf-dist config --strategy fsdp_full_shard --out fsdp.yaml
  hf-dist convert out/checkpoint-500 out/hf-model
  hf-dist verify out/checkpoint-500 out/hf-model --logits
  hf-dist env
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dist",
        description="Distributed fine-tuning for Hugging Face models: plan, configure, convert checkpoints.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from hf_dist import __version__

    parser.add_argument("--version", action="version", version=f"hf-dist {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"hf_dist.cli.{module_name}")
        sub = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.DESCRIPTION,
            epilog=module.EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
    return parser


# 128 + SIGPIPE: what a shell reports for a tool that a closed pipe stopped (`yes | head`)
PIPE_CLOSED_EXIT = 141


def main(argv: list[str] | None = None) -> int:
    """Run ``hf-dist``; a closed stdout (``hf-dist plan ... | head``) ends it quietly with :data:`PIPE_CLOSED_EXIT`."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # what is still buffered meets a closed pipe here, not in the interpreter's exit
    except BrokenPipeError:
        return _closed_pipe()


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        raise  # the reader went away: no error of ours (main)
    except (ValueError, OSError, RuntimeError) as exc:  # OSError: FileNotFound/FileExists/Permission...
        print(f"hf-dist {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _closed_pipe() -> int:
    """Stop without a word when the reader of stdout has gone: stdout now points at the null device, so the
    interpreter's last flush of what is still buffered has nowhere to fail (the recipe of Python's ``signal`` docs,
    "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return PIPE_CLOSED_EXIT


if __name__ == "__main__":
    sys.exit(main())
