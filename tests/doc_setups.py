"""The files a doc line assumes its reader has, written into the folder it runs in (tests/doc_runs.py).

Each setup is called with the folder and a ``facts`` dict, where it leaves what the checks compare against (the
weights of a checkpoint it built). Everything is tiny and built in-process: seconds, no hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    """A config.json of a public model's shape at ``path`` (a folder, or a config.json file): nothing allocated."""

    path: str
    shape: str = "Llama-3-8B"

    def __call__(self, ws: Path, facts: dict) -> None:
        from hf_dist.testing import llama3_config

        target = ws / self.path
        llama3_config(self.shape).save_pretrained(target.parent if target.name == "config.json" else target)


@dataclass(frozen=True)
class ZeroCheckpoint:
    """A Trainer ``checkpoint-N`` of a ZeRO run (``latest`` + the tag folder), built in-process; its weights go to
    ``facts["state"]``. ``config_at``: where its config.json and tokenizer go (default: inside it)."""

    path: str
    tag: str = "global_step500"
    stage: int = 3
    config_at: str | None = None

    def __call__(self, ws: Path, facts: dict) -> None:
        from hf_dist.data import build_tokenizer
        from tests.unit.checkpoint.fakes import make_zero_checkpoint, tiny_model_state

        config, state = tiny_model_state()
        root = ws / self.path
        make_zero_checkpoint(root, config, state, stage=self.stage, tag=self.tag)
        if self.config_at:
            (root / "config.json").unlink()
            (root / "latest").unlink()
            config.save_pretrained(ws / self.config_at)
        build_tokenizer().save_pretrained(ws / (self.config_at or self.path))
        facts["state"] = state


@dataclass(frozen=True)
class LoraCheckpoint:
    """A Trainer ``checkpoint-N`` of a LoRA run under ZeRO-2 (LoRA tensors in the fp32 partitions, the base frozen
    in the model states, adapter_config.json beside it); the PEFT model goes to ``facts["peft"]``."""

    path: str
    tag: str = "global_step500"

    def __call__(self, ws: Path, facts: dict) -> None:
        from collections import OrderedDict

        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from tests.unit.checkpoint.fakes import make_zero_checkpoint, tiny_model_state

        config, _ = tiny_model_state()
        torch.manual_seed(1)
        model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=2, target_modules=["q_proj"]))
        for name, param in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: a trained adapter is not
                torch.nn.init.normal_(param)
        params = dict(model.named_parameters())
        trained = OrderedDict((n, p.detach().clone()) for n, p in params.items() if p.requires_grad)
        tag_dir = make_zero_checkpoint(ws / self.path, config, trained, stage=2, tag=self.tag)
        states = tag_dir / "mp_rank_00_model_states.pt"
        model_states = torch.load(states, weights_only=False)
        frozen = {n: p.detach().to(torch.bfloat16) for n, p in params.items() if not p.requires_grad}
        model_states["frozen_param_shapes"] = OrderedDict((n, t.shape) for n, t in frozen.items())
        model_states["frozen_param_fragments"] = frozen
        torch.save(model_states, states)
        model.peft_config["default"].save_pretrained(ws / self.path)
        facts["peft"] = model


@dataclass(frozen=True)
class TinyModel:
    """A tiny Llama folder with the embedded tokenizer, standing for a hub model the doc names."""

    path: str = "tiny-llama"

    def __call__(self, ws: Path, facts: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from hf_dist.data import build_tokenizer
        from hf_dist.testing import tiny_llama_config

        torch.manual_seed(0)
        tokenizer = build_tokenizer()
        config = tiny_llama_config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64)
        AutoModelForCausalLM.from_config(config).save_pretrained(ws / self.path)
        tokenizer.save_pretrained(ws / self.path)


@dataclass(frozen=True)
class ChatData:
    """A small chat dataset (``messages`` rows) at ``path``, standing for the reader's own file."""

    path: str = "chat.jsonl"
    rows: int = 64

    def __call__(self, ws: Path, facts: dict) -> None:
        words = ["red", "blue", "green", "gold"]
        with open(ws / self.path, "w") as f:
            for i in range(self.rows):
                ask, answer = words[i % 4], words[(i + 1) % 4]
                messages = [{"role": "user", "content": f"after {ask}?"}, {"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": messages}) + "\n")
