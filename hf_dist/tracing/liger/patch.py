"""Liger applied to a model as the Trainer applies it, with the fake functions in place of Liger's Triton ones.

``Trainer(args.use_liger_kernel=True)`` calls ``_apply_liger_kernel_to_instance(model=<the PEFT-unwrapped model>)``,
which runs ``apply_liger_kernel_to_<model_type>(model=...)`` with its defaults. For llama, mistral and qwen2,
liger-kernel 0.8.5 (``liger_kernel/transformers/monkey_patch.py``) then:

* replaces the modeling module's ``apply_rotary_pos_emb`` with ``liger_rotary_pos_emb`` (process-wide);
* binds ``LigerRMSNorm.forward`` to the final norm and to each layer's two norms (``_patch_rms_norm_module``:
  offset 0, llama casting, in place);
* binds ``LigerSwiGLUMLP.forward`` to each layer's MLP (``down_proj(silu_mul(gate_proj(x), up_proj(x)))``);
* binds ``lce_forward`` (``transformers/model/<type>.py``) as the model's ``forward``: in training with labels it
  never computes the logits, and ``LigerForCausalLMLoss`` (``transformers/model/loss_utils.py``) runs the fused
  linear cross-entropy on the final hidden states and ``lm_head.weight``.

The same steps follow here with :mod:`hf_dist.tracing.liger.functions`.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hf_dist.tracing.liger.functions import (
    FakeFusedLinearCrossEntropyFunction,
    FakeRMSNormFunction,
    FakeRopeFunction,
    FakeSiLUMulFunction,
)


def fake_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """``liger_rotary_pos_emb``: ``dispatch("rope", ...)``, which runs ``LigerRopeFunction`` (nvidia-triton)."""
    return FakeRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim, None)


def _rms_norm_forward(self, hidden_states):
    """``LigerRMSNorm.forward`` with the attributes ``_patch_rms_norm_module`` sets."""
    return FakeRMSNormFunction.apply(
        hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode, self.in_place, self.row_mode
    )


def _swiglu_forward(self, x):
    """``LigerSwiGLUMLP.forward`` (``_swiglu_dispatch``: gate and down multipliers 1.0)."""
    return self.down_proj(FakeSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x), 1.0, 1.0))


def _bind(module: Any, name: str, function: Callable) -> None:
    """``_bind_method_to_module``: the method set on the instance, as Liger does."""
    module.__dict__[name] = function.__get__(module, module.__class__)


def patch_rms_norm(module: Any, eps: float = 1e-6) -> None:
    """``_patch_rms_norm_module(module)`` with its defaults (offset 0, llama casting, in place, no row mode)."""
    module.offset, module.casting_mode, module.in_place, module.row_mode = 0.0, "llama", True, None
    module.variance_epsilon = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or eps
    _bind(module, "forward", _rms_norm_forward)


def causal_lm_loss(hidden_states, lm_head_weight, labels, hidden_size: int, num_items_in_batch=None,
                   ignore_index: int = -100, shift_labels=None, final_logit_softcapping=None, **kwargs):  # fmt: skip
    """``LigerForCausalLMLoss`` and ``fixed_fused_linear_cross_entropy``: labels shifted by padding, the fused loss
    summed over ``num_items_in_batch`` when the Trainer passes it, else averaged."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    hidden_states = hidden_states.view(-1, hidden_size)
    shift_labels = shift_labels.view(-1).to(hidden_states.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = FakeFusedLinearCrossEntropyFunction.apply(
        hidden_states, lm_head_weight, shift_labels, None, ignore_index, reduction, final_logit_softcapping
    )
    return loss / num_items_in_batch if reduction == "sum" else loss


def lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, skip_logits=None, **kwargs):  # fmt: skip
    """``lce_forward`` of llama / mistral / qwen2: the base model, then the fused loss on the kept hidden states in
    training with labels (the logits never exist), else ``lm_head`` and the model's own loss."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)  # fmt: skip
    hidden_states = outputs[0]
    kept = hidden_states[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep, :]
    shift_labels = kwargs.pop("shift_labels", None)
    if getattr(self.config, "pretraining_tp", 1) > 1:
        raise ValueError("Liger Kernel does not support pretraining_tp > 1 (liger_kernel/transformers/model/llama.py)")
    if skip_logits is None:
        skip_logits = self.training and (labels is not None or shift_labels is not None)
    if skip_logits:
        loss = causal_lm_loss(kept, self.lm_head.weight, labels, self.config.hidden_size, shift_labels=shift_labels,
                              **kwargs)  # fmt: skip
        return CausalLMOutputWithPast(loss=loss, logits=None)
    logits, loss = self.lm_head(kept), None
    if labels is not None or shift_labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, shift_labels=shift_labels,
                                  vocab_size=self.config.vocab_size, **kwargs)  # fmt: skip
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def patch_model(model: Any) -> Any:
    """``apply_liger_kernel_to_<type>(model=model)``'s instance part on the PEFT-unwrapped causal LM: the norms, the
    MLPs and the forward (the module-level RoPE is :func:`liger_rope`'s)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, base.base_model_prefix, base)
    base.forward = types.MethodType(lce_forward, base)
    patch_rms_norm(decoder.norm)
    for layer in decoder.layers:
        _bind(layer.mlp, "forward", _swiglu_forward)
        patch_rms_norm(layer.input_layernorm)
        patch_rms_norm(layer.post_attention_layernorm)
    return model


@contextlib.contextmanager
def liger_rope(model_type: str) -> Iterator[None]:
    """``modeling_<type>.apply_rotary_pos_emb = liger_rotary_pos_emb`` for the trace's duration (Liger leaves it
    patched for the rest of the process; the trace restores it)."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = fake_rotary_pos_emb
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original
