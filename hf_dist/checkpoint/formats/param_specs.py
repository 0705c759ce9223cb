"""Parameter names and shapes of common decoder architectures, computed from ``config.json`` alone.

Validating a checkpoint against its config through transformers means importing transformers
and building the model on the meta device, which costs seconds, often more than the conversion
itself. For the Llama family (the common case) the parameter list is small, declarative data; other
architectures fall back to transformers. ``tests/unit/checkpoint/formats/test_param_specs.py`` checks these
against transformers' own models.
"""

from __future__ import annotations

# model_type -> whether the config's attention_bias / mlp_bias flags exist for it
LLAMA_LIKE = {"llama": True, "mistral": False}


def llama_like_specs(config: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, str]] | None:
    """Names -> shapes and tied ``target -> source`` for a Llama/Mistral CausalLM config, else None."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or ["ForCausalLM"]
    if model_type not in LLAMA_LIKE or not all(a.endswith("ForCausalLM") for a in architectures):
        return None
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    has_flags = LLAMA_LIKE[model_type]
    attn_bias = has_flags and bool(config.get("attention_bias"))
    mlp_bias = has_flags and bool(config.get("mlp_bias"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        linears = {
            "self_attn.q_proj": ((heads * head_dim, hidden), attn_bias),
            "self_attn.k_proj": ((kv_heads * head_dim, hidden), attn_bias),
            "self_attn.v_proj": ((kv_heads * head_dim, hidden), attn_bias),
            "self_attn.o_proj": ((hidden, heads * head_dim), attn_bias),
            "mlp.gate_proj": ((inter, hidden), mlp_bias),
            "mlp.up_proj": ((inter, hidden), mlp_bias),
            "mlp.down_proj": ((hidden, inter), mlp_bias),
        }
        for name, (shape, bias) in linears.items():
            shapes[f"{p}{name}.weight"] = shape
            if bias:
                shapes[f"{p}{name}.bias"] = (shape[0],)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    tie = config.get("tie_word_embeddings", False)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if tie else {}
    return shapes, tied
