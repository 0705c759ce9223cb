from hf_dist.checkpoint.conversion import transform


def test_peft_names_are_anchored_on_peft_root_whatever_container_saved_them():
    # ZeRO saves PEFT names bare; accelerate's FSDP2 DCP saves them under an outer "model."
    bare = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    for saved in (bare, "model." + bare, "model._fsdp_wrapped_module." + bare):
        name = transform.strip_wrappers(saved)
        assert transform.adapter_key(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    base = "model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert transform.base_key(base) == "model.layers.0.self_attn.q_proj.weight"
    # a plain (non-PEFT) name is left alone
    assert transform.base_key("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
