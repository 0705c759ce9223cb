"""PEFT's entry points, called without the deprecation warning PEFT's own code raises under transformers 5.

``peft.PeftModel.__init__`` (peft 0.21, ``peft_model.py``) reads ``model.is_gradient_checkpointing`` to decide whether
to prepare the model for gradient checkpointing; transformers 5.23 deprecated that property in favour of
``is_activation_checkpointing`` (``modeling_utils.py``) and warns on every read. A LoRA run read it once per rank in
``get_peft_model`` and once more when its export was reloaded, three warnings a user can do nothing about. The value
read is the same; only that one message is filtered, only around PEFT's call.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DEPRECATED_PROPERTY = r"`is_gradient_checkpointing` is deprecated"


@contextmanager
def without_peft_deprecation() -> Iterator[None]:
    """Filter transformers' ``is_gradient_checkpointing`` deprecation (PEFT's read of it) inside the block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DEPRECATED_PROPERTY, category=FutureWarning)
        yield


def get_peft_model(model: Any, config: Any) -> Any:
    """``peft.get_peft_model(model, config)`` without PEFT's deprecated-property warning."""
    from peft import get_peft_model as wrap

    with without_peft_deprecation():
        return wrap(model, config)


def load_peft_model(path: Any, *, trust_remote_code: bool = False) -> Any:
    """``peft.AutoPeftModelForCausalLM.from_pretrained(path, trust_remote_code=...)`` without PEFT's deprecated-property
    warning."""
    from peft import AutoPeftModelForCausalLM

    with without_peft_deprecation():
        return AutoPeftModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
