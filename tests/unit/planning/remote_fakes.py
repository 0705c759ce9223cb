"""An attacker's model folder: a config.json whose ``auto_map`` names Python files beside it that leave a marker
folder when imported. A marker that appears means the folder's code ran.

Variants (issue 30):

- ``"t5"``: a ``model_type`` transformers knows but not as a causal LM, with an ``AutoModelForCausalLM`` entry;
- ``"unknown"``: a ``model_type`` transformers does not know, with ``AutoConfig`` and ``AutoModelForCausalLM``
  entries (transformers itself imports ``configuration_evil.py`` for ``AutoConfig`` when trusted);
- ``"llama"``: a registered causal LM with an ``AutoModelForCausalLM`` entry (planned from transformers' own class
  without the flag).

With ``trust_remote_code=True`` the ``unknown`` and ``llama`` folders build (a Llama subclass); ``t5``'s class
cannot build a T5 config, so only its marker proves its code ran.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

VARIANTS = ("t5", "unknown", "llama")
REFUSED = ("t5", "unknown")  # nothing but the folder's code can build these

# a tiny Llama (0.1M parameters): seconds to plan, to trace, and to build for real
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}  # fmt: skip
T5 = {"model_type": "t5", "d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_heads": 4, "vocab_size": 256}
CAUSAL_LM = "modeling_evil.EvilForCausalLM"
CONFIG = "configuration_evil.EvilConfig"

_PAYLOAD = "import os\n\nos.makedirs({marker!r}, exist_ok=True)  # the payload: proof that this file ran\n\n"
_CONFIG_FILE = (
    _PAYLOAD + 'from transformers import LlamaConfig\n\n\nclass EvilConfig(LlamaConfig):\n    model_type = "evil"\n'
)
_MODEL_FILE = (
    _PAYLOAD + "from transformers import LlamaForCausalLM\n{extra}\n\nclass EvilForCausalLM(LlamaForCausalLM):\n"
)


def evil_config(variant: str, base: dict | None = None) -> dict:
    """config.json of ``variant``; ``base``: the Llama config it is made from (default :data:`LLAMA`)."""
    base = dict(base or LLAMA)
    if variant == "t5":
        return {**T5, "auto_map": {"AutoModelForCausalLM": CAUSAL_LM}}
    if variant == "unknown":
        base.pop("architectures", None)
        return {**base, "model_type": "evil", "auto_map": {"AutoConfig": CONFIG, "AutoModelForCausalLM": CAUSAL_LM}}
    if variant == "llama":
        return {**base, "auto_map": {"AutoModelForCausalLM": CAUSAL_LM}}
    raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")


def plant(folder: Path, variant: str, marker: Path) -> Path:
    """Turn ``folder`` (a model or checkpoint folder; its config.json, if any, is the base) into ``variant``'s
    attacker's folder whose code creates ``marker``; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config_file = folder / "config.json"
    base = json.loads(config_file.read_text()) if config_file.is_file() else None
    config_file.write_text(json.dumps(evil_config(variant, base), indent=2))
    unknown = variant == "unknown"
    extra = "\nfrom .configuration_evil import EvilConfig\n" if unknown else ""
    body = "    config_class = EvilConfig\n" if unknown else "    pass\n"
    (folder / "modeling_evil.py").write_text(_MODEL_FILE.format(marker=str(marker), extra=extra) + body)
    if unknown:
        (folder / "configuration_evil.py").write_text(_CONFIG_FILE.format(marker=str(marker)))
    return folder


def refusal_pattern(folder: Path, variant: str) -> str:
    """What the one-line refusal of ``variant``'s folder must say (a regular expression)."""
    auto, ref, module = (("AutoConfig", CONFIG, "configuration_evil.py") if variant == "unknown"
                         else ("AutoModelForCausalLM", CAUSAL_LM, "modeling_evil.py"))  # fmt: skip
    return (
        rf"^refusing to import code from {re.escape(str(folder.resolve()))}/{module}: .*config\.json's auto_map names "
        rf"{auto} -> {ref}; pass --trust-remote-code \(trust_remote_code=True\) only if you trust this folder$"
    )
