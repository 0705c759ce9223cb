"""Load a DCP checkpoint written by ``hf-dist convert --to dcp`` into an FSDP2 model on N CPU ranks.

Usage:  torchrun --nproc_per_node=2 convert_load_dcp.py DCP_DIR HF_DIR OUT_JSON

Every rank reads only its shards (``dcp.load`` into the sharded state dict); the gathered full
state dict is then compared with the HF folder's weights and rank 0 writes ``{"equal": bool, ...}``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard


def main() -> None:
    dcp_dir, hf_dir, out = sys.argv[1:4]
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo")
    config = AutoConfig.from_pretrained(hf_dir)
    torch.manual_seed(123)  # different from the checkpoint: the load must overwrite every value
    model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        expected = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
        mismatched = [k for k, v in expected.items() if not torch.equal(full[k], v)]
        report = {"equal": not mismatched, "mismatched": mismatched, "world_size": dist.get_world_size()}
        with open(out, "w") as handle:
            json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
