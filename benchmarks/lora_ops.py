"""Kernels per decoder layer, full fine-tuning against PEFT LoRA: the counts behind the throughput model's LoRA terms.

    python benchmarks/lora_ops.py

Runs one forward + backward of a Llama layer (built and prepared by hf_dist.tracing.prepare, on fake tensors) under
a dispatch mode that counts every ATen operator that launches a kernel (view and metadata ops left out), for 1 and 3
layers; the difference / 2 is one layer's count. hf_dist.planning.throughput charges each of them eager PyTorch's
per-op dispatch (DISPATCH_S): OPS_PER_LAYER for a layer, OPS_PER_LORA_ADAPTER (+ OPS_PER_LORA_DROPOUT) per adapter.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from hf_dist.tracing import TraceSetup, prepare

VIEWS = {"view", "t", "transpose", "_unsafe_view", "detach", "slice", "expand", "unsqueeze", "squeeze", "permute",
         "alias", "reshape", "select", "split", "split_with_sizes", "chunk", "as_strided", "unbind", "lift_fresh"}  # fmt: skip


class KernelCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).split(".")[1]
        if not str(func).startswith("prim") and name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def kernels(layers: int, **setup) -> Counter:
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    trace_setup = TraceSetup(strategy="ddp", seq_len=64, micro_batch_size=1, **setup)
    model = prepare.build_model(config, trace_setup)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = prepare.autocast_forward(prepare.materialize(model), trace_setup)
        ids = torch.randint(0, config.vocab_size, (1, 64))
        with prepare.cuda_dropout(), KernelCount() as count:
            model(input_ids=ids, labels=ids).loss.backward()
    return count.ops


def main() -> None:
    cases = {"full fine-tuning": {}, "LoRA, dropout 0.05": {"method": "lora"},
             "LoRA, no dropout": {"method": "lora", "lora_dropout": 0.0}}  # fmt: skip
    base = None
    for name, setup in cases.items():
        one, three = kernels(1, **setup), kernels(3, **setup)
        per_layer = (sum(three.values()) - sum(one.values())) / 2
        base = base or per_layer
        extra = f", {(per_layer - base) / 7:.1f} per adapter (7 adapters)" if per_layer != base else ""
        print(f"{name:20} {per_layer:5.0f} kernels per layer, forward + backward{extra}")


if __name__ == "__main__":
    main()
