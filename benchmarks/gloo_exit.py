"""How often a gloo job that finished its work dies at exit, with and without tearing the group down.

    python benchmarks/gloo_exit.py --runs 100 --nproc 3        # ~15 min on 2 cores (~6 s a launch)

Each launch is ``torchrun --nproc_per_node N`` of this file's worker: 30 all-reduces of varied sizes,
a barrier, rank 0 lingering up to 0.5 s, then the end of the script — either a plain return (the
process group is left to interpreter teardown) or ``hf_dist.runtime.dist.shutdown()`` (barrier +
``destroy_process_group``, what every hf_dist script ends with). The two variants alternate, so load
on the machine hits both alike. A launch fails when any rank exits non-zero; the first line naming
the cause is printed (measured: ``terminate called without an active exception``, SIGABRT).

Measured (torch 2.13, 2 cores, 3 ranks; this worker run from a shell loop, one variant after the other):
1 abort in 100 plain launches, 0 in 150 with shutdown(); at 4 ranks 0 in 18 each. The rate is low: evidence,
not proof.
This script, `--runs 60 --nproc 3` (alternating): plain exit 1 failed of 60, shutdown() 0 of 60.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_dist.testing import cause_lines, cpu_env, torchrun_command


def worker(teardown: bool) -> None:
    import random
    import time

    import torch
    import torch.distributed as dist

    from hf_dist.runtime.dist import shutdown

    dist.init_process_group("gloo")
    for i in range(30):
        dist.all_reduce(torch.ones(random.Random(i).randint(1, 200_000)))
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(random.random() * 0.5)
    if teardown:
        shutdown()


def launch(nproc: int, teardown: bool) -> str | None:
    """None when every rank exited 0, else the first line of the output naming why."""
    cmd = torchrun_command(__file__, ["--worker", *(["--teardown"] if teardown else [])], nproc=nproc)
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    return (cause_lines(proc.stderr) or [f"exit code {proc.returncode}"])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100, help="launches per variant")
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--teardown", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        return worker(opts.teardown)
    failed = {False: 0, True: 0}
    for i in range(opts.runs):
        for teardown in (False, True) if i % 2 == 0 else (True, False):
            cause = launch(opts.nproc, teardown)
            if cause is not None:
                failed[teardown] += 1
                print(f"launch {i + 1}, {'shutdown()' if teardown else 'plain exit'}: {cause}", flush=True)
    print(f"{opts.nproc} ranks, {opts.runs} launches each:")
    print(f"  plain exit : {failed[False]} failed")
    print(f"  shutdown() : {failed[True]} failed")


if __name__ == "__main__":
    main()
