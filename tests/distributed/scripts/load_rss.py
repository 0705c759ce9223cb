"""Peak resident memory of each rank while ``from_pretrained`` loads a saved model, against the plan's figure.

Run on 2 ranks: ``load_rss.py MODEL_DIR OUT.json``. Three loads, one after another in each rank:

- ``checkpoint_dtype``: the checkpoint's dtype (memory-mapped views of the file);
- ``fp32``: fp32 from a 16-bit checkpoint (every rank allocates its own copy);
- ``fp32_fsdp_efficient``: the same with accelerate's FSDP ``cpu_ram_efficient_loading`` variables set, which
  transformers 5 no longer honours at load (every rank still reads).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The resident set's highest point above where it stood on entry, sampled every millisecond."""

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def rise(self) -> int:
        return self.peak - self.base


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_dist

    model_dir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    plan = hf_dist.plan(model_dir, gpus=dist.get_world_size())
    report = {"rank": dist.get_rank(), "plan": {**plan.to_dict()["load"], "rank_peak": plan.load.rank_peak}}
    # the modelling code from_pretrained imports is imported before anything is measured: a Llama plan no longer
    # builds the model, so its import would otherwise count as the first load's memory
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    for name, dtype, env in (
        ("checkpoint_dtype", "auto", {}),
        ("fp32", torch.float32, {}),
        ("fp32_fsdp_efficient", torch.float32, {"ACCELERATE_USE_FSDP": "1", "FSDP_CPU_RAM_EFFICIENT_LOADING": "1"}),
    ):
        os.environ.update(env)
        dist.barrier()
        with PeakRSS() as peak:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        report[name] = {"rise": peak.rise, "params": sum(p.numel() for p in model.parameters())}
        del model
        for key in env:
            del os.environ[key]
        time.sleep(0.1)
    with open(f"{out}.rank{dist.get_rank()}", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
