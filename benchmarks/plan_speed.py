"""How long ``hf-dist plan`` on a local config.json takes, next to importing the libraries it no longer needs.

    python benchmarks/plan_speed.py --runs 5        # ~2 min on 2 cores

Each run is a fresh process, as a user's shell starts it, for the README's headline request (Llama-3-8B's
config.json written by hand, 8 x 80 GB, global batch 64):

- ``plan, first``: an empty feature store (``HF_DIST_CACHE_DIR``), so the installed libraries' features are probed
  (this imports transformers, accelerate and torch) and stored;
- ``plan``: the store filled, as every later plan on that machine: neither torch nor transformers is imported;
- ``import torch, transformers``: what importing the two alone costs, which every plan paid before (the meta model
  was counted and the features probed on each run);
- ``plan, meta model``: the same config with one key ``hf_dist.planning.families`` does not model, so it is counted
  on the meta device as every config was before;
- ``plan, Gemma 2 9B``: a Gemma 2 config.json (``hf_dist.testing.public_config("gemma-2-9b")``), described by arithmetic
  since Gemma 2 joined the families (its attention read from transformers' source, not imported); before, it was
  counted on the meta device like the row above;
- ``plan, Mixtral 8x7B``: Mixtral-8x7B's config.json (``public_config("mixtral-8x7b")``), described by arithmetic since
  Mixtral joined the families (its tensor-parallel plan read from transformers' source); before, counted on meta.

Medians of ``--runs`` runs; ratios from the same run. Measured (2 shared cores, torch 2.13, transformers 5.24):
see docs/measurements.md, "What a plan costs".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
}  # fmt: skip
GEMMA_2_9B = {
    "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
    "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096,
    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 256,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "sliding_window": None, "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16",
}  # fmt: skip
REQUEST = ["--gpus", "8", "--gpu-memory", "80", "--global-batch", "64"]


def _timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per measurement (default 5)")
    args = parser.parse_args(argv)
    import os

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        configs = (
            ("llama", LLAMA_3_8B),
            ("meta", {**LLAMA_3_8B, "quantization_config": None}),
            ("gemma", GEMMA_2_9B),
            ("mixtral", MIXTRAL_8X7B),
        )
        for name, config in configs:
            (root / name).mkdir()
            (root / name / "config.json").write_text(json.dumps(config))
        plan = [sys.executable, "-m", "hf_dist", "plan"]
        times: dict[str, list[float]] = {}
        for i in range(args.runs):
            env = {**os.environ, "HF_DIST_CACHE_DIR": str(root / f"store-{i}")}
            for label, command in (
                ("plan, first", [*plan, str(root / "llama" / "config.json"), *REQUEST]),
                ("plan", [*plan, str(root / "llama" / "config.json"), *REQUEST]),
                ("import torch, transformers", [sys.executable, "-c", "import torch, transformers"]),
                ("plan, meta model", [*plan, str(root / "meta" / "config.json"), *REQUEST]),
                ("plan, Gemma 2 9B", [*plan, str(root / "gemma" / "config.json"), *REQUEST]),
                ("plan, Mixtral 8x7B", [*plan, str(root / "mixtral" / "config.json"), *REQUEST]),
            ):
                times.setdefault(label, []).append(_timed(command, env))
    base = statistics.median(times["import torch, transformers"])
    print(f"{'':28} {'median s':>9} {'/ import':>9}")
    for label, values in times.items():
        print(f"{label:28} {statistics.median(values):9.2f} {statistics.median(values) / base:9.2f}")


if __name__ == "__main__":
    main()
