"""Refusals: a recipe's arguments refused before any model is built, said once, in a few lines, without a traceback.

A recipe runs every check of its arguments inside :func:`checking` (the flags, the output folder, the model's
source, the dataset, the plan ``auto_args`` makes, the checkpoint to resume). An error a check raises on the user's
input (``ValueError``, ``RuntimeError``, ``OSError``) leaves it as a :class:`RecipeRefusal` carrying the message.
The recipes' entry point :func:`run_recipe` prints a refusal once, from rank 0, and exits with status
:data:`REFUSAL_EXIT`; every other error keeps its traceback (it is a failure, not a refusal).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

REFUSAL_EXIT = 2  # argparse's status for a command line it refuses
RANK_0_GRACE_S = 30.0  # how long a rank other than 0 lets rank 0 say a refusal first (run_recipe)
CHECK_ERRORS = (ValueError, RuntimeError, OSError)  # what the checks raise on the user's input


class RecipeRefusal(Exception):
    """The arguments of a recipe refused before any model was built; the message says what was received, what is
    allowed and what to do. ``__cause__`` is the error the check raised."""


@contextmanager
def checking() -> Iterator[None]:
    """Run the checks of a recipe's arguments: an error they raise on the input becomes a :class:`RecipeRefusal`."""
    try:
        yield
    except RecipeRefusal:
        raise
    except CHECK_ERRORS as exc:
        if _collective_failure(exc):
            raise
        raise RecipeRefusal(str(exc) or type(exc).__name__) from exc


def _collective_failure(exc: BaseException) -> bool:
    """A failure of the process group (a rank gone, a timeout) is no refusal: it can strike one rank alone, which
    must then say so itself, with its traceback."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return isinstance(exc, dist.DistError)


def refusal_text(refusal: RecipeRefusal) -> str:
    """What a refusal prints: its message, the first line marked as hf_dist's."""
    return f"[hf_dist] refused: {str(refusal).strip()}"


def run_recipe(main: Callable[[], Any]) -> None:
    """A recipe's ``if __name__ == "__main__"``: under torchrun the process group started for restarts
    (:func:`~hf_dist.runtime.bootstrap.init_distributed_for_restarts`), ``main()``, then the group torn down on every
    rank together.

    A :class:`RecipeRefusal` is said once, to stderr, and the rank exits with status :data:`REFUSAL_EXIT`, leaving the
    process group without waiting for the others. Rank 0 says it at once. Every rank refuses the same arguments, so
    another rank first gives rank 0 :data:`RANK_0_GRACE_S` seconds: once rank 0 has exited, the launcher stops the
    other ranks, and a rank that exited first would have had rank 0 stopped before it spoke. A rank still running
    after the grace period met a refusal rank 0 did not, and says it itself.
    """
    from hf_dist.runtime.bootstrap import init_distributed_for_restarts
    from hf_dist.runtime.dist import shutdown

    init_distributed_for_restarts()  # under torchrun: a restart round cannot read a dead round's rendezvous keys
    try:
        main()
    except RecipeRefusal as refusal:
        _leave_process_group()
        if os.environ.get("RANK", "0") != "0":
            time.sleep(RANK_0_GRACE_S)
        print(refusal_text(refusal), file=sys.stderr, flush=True)
        sys.exit(REFUSAL_EXIT)
    shutdown()


def _leave_process_group() -> None:
    """Destroy this rank's process group when the checks had started one (``TrainingArguments`` does), without the
    barrier of :func:`hf_dist.runtime.dist.shutdown`: a rank left to tear it down at interpreter exit can abort."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
