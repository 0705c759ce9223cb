"""A tiny single-process Trainer factory for tests of callbacks and checkpoints (real Trainer, real optimizer, CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(callbacks=[...], eval_dataset=None, **training_args) -> Trainer`` with a 2-layer Llama, batch
    2 x 16 tokens."""
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from hf_dist.testing import TokenDataset, tiny_llama_config

    def build(callbacks=(), model=None, eval_dataset=None, **overrides):
        torch.manual_seed(0)
        kwargs = dict(
            output_dir=str(tmp_path / "out"),
            max_steps=4,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            seed=0,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        kwargs.update(overrides)
        model = model if model is not None else LlamaForCausalLM(tiny_llama_config())
        return Trainer(
            model=model,
            args=TrainingArguments(**kwargs),
            train_dataset=TokenDataset(32),
            eval_dataset=eval_dataset,
            callbacks=list(callbacks),
        )

    return build
