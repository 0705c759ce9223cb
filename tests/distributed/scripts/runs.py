"""Several runs of the test scripts in one launch: the same ranks run each script's ``main(argv)`` in turn.

A 2-rank launch spends 15-25 s on 2 cores before its first step (each rank imports torch, transformers and
DeepSpeed, then the rendezvous); a run of the tiny model takes a few seconds. Runs of one engine therefore share a
launch (tests/distributed/conftest.py ``LaunchCache`` groups them). Between runs everything a run leaves in the process
that a fresh one would not have is reset: the environment (``cpu_deepspeed_training_kwargs`` sets DeepSpeed's
variables), accelerate's state, transformers' ZeRO-3 config. The process group is kept, as in a long-lived job.

A run that fails ends the launch (its ranks may be in a collective): the runs before it wrote their reports, the ones
after it have none, and the launch's error is what their tests show. Usage::

    torchrun --nproc_per_node 2 tests/distributed/scripts/runs.py RUNS.json

``RUNS.json``: a list of ``[script, *argv]``, ``script`` a module of this folder with ``main(argv)``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from hf_dist.runtime.dist import shutdown


def reset_between_runs(environ: dict[str, str] | None = None) -> None:
    """Forget the previous run's accelerate state, ZeRO-3 config and (given the launch's) environment variables."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    environ = dict(os.environ)
    for index, (script, *argv) in enumerate(runs):
        if index:
            reset_between_runs(environ)
        importlib.import_module(script).main([str(a) for a in argv])
    shutdown()


if __name__ == "__main__":
    main()
