"""Where a model comes from, read as a transformers config: a config object, a dict, a local folder or config.json,
or a hub name (clear error when offline); and the model built from it, on the meta device or with real weights.
The folder's own classes (``auto_map``) are imported only with ``trust_remote_code=True``
(:mod:`hf_dist.planning.remote_code`)."""

from __future__ import annotations

import json
import os
from typing import Any

from hf_dist.planning.config_checks import check_config_dict
from hf_dist.planning.families import ConfigFields
from hf_dist.planning.remote_code import check_config_class, check_trust_flag, uses_folder_class


def is_config(obj: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(obj, PretrainedConfig)


def config_from_dict(data: dict) -> Any:
    from transformers import AutoConfig

    if "model_type" not in data:
        raise ValueError(
            f"config dict has no 'model_type' (keys: {sorted(data)[:10]}...); add it, e.g. 'model_type': 'llama'"
        )
    check_config_dict(data, where="model config")
    kwargs = {k: v for k, v in data.items() if k != "model_type"}
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if data["model_type"] not in CONFIG_MAPPING:
        raise ValueError(
            f"unknown model_type {data['model_type']!r} in config; use one transformers knows, e.g. 'llama'"
        )
    try:
        return AutoConfig.for_model(data["model_type"], **kwargs)
    except Exception as exc:  # transformers/huggingface_hub validators raise their own types
        message = str(exc).strip().splitlines()[-1].strip()[:300] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"invalid {data['model_type']} config: {message}; fix config.json") from None


def load_config(path_or_name: str, *, trust_remote_code: bool = False) -> Any:
    """A config from a local folder, a config.json file or a hub name (clear error when offline).

    A config class named only in the folder's ``auto_map`` is imported with ``trust_remote_code=True`` alone
    (:func:`~hf_dist.planning.remote_code.check_config_class`); a config.json given as a file is then read as its
    folder, where that code lives.
    """
    trust = check_trust_flag(trust_remote_code)
    if os.path.isfile(path_or_name):
        return _config_from_file(path_or_name, trust)
    if os.path.isdir(path_or_name):
        config_file = os.path.join(path_or_name, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"folder {path_or_name} has no config.json; pass a model folder or a config.json")
        data = _read_json(config_file)
        check_config_dict(data, where=f"model config {config_file}")
        check_config_class(data, path_or_name, trust_remote_code=trust)
        return _auto_config(path_or_name, trust, f"cannot read {config_file}", "fix or replace it")
    check_hub_reachable(path_or_name)
    return _hub_config(path_or_name, trust)


def local_config_dict(path_or_name: str) -> tuple[dict, str] | None:
    """(the config.json of a local folder or file, as read, unchecked; where it was read) or None for a hub name.
    Nothing is imported: :func:`hf_dist.planning.families.describe` may plan it without transformers."""
    config_file = os.path.join(path_or_name, "config.json") if os.path.isdir(path_or_name) else path_or_name
    if not os.path.isfile(config_file):
        return None
    return _read_json(config_file), f"model config {config_file}"


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        try:
            data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); pass a transformers config.json") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object; pass a transformers config.json")
    return data


def _config_from_file(path: str, trust: bool) -> Any:
    """A config.json file: read as a dict (no code), or, trusted and with an ``auto_map``, as its folder."""
    data = _read_json(path)
    check_config_dict(data, where=f"model config {path}")
    folder = os.path.dirname(os.path.abspath(path))
    if trust and data.get("auto_map") and os.path.basename(path) == "config.json":
        return load_config(folder, trust_remote_code=True)
    check_config_class(data, folder, trust_remote_code=trust)
    config = config_from_dict(data)
    if getattr(config, "auto_map", None):
        config._name_or_path = folder  # where its auto_map's files are: named by a refusal
    return config


def _auto_config(path_or_name: str, trust: bool, failure: str, fix: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path_or_name, trust_remote_code=trust)
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:  # transformers' validators raise these
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ValueError(f"{failure} ({type(exc).__name__}: {first}); {fix}") from None


def _hub_config(name: str, trust: bool) -> Any:
    """A hub repo's config; its config.json is fetched first so a remote-code config class is refused unread."""
    from transformers import PretrainedConfig

    unresolved = (
        f"could not resolve model {name!r}: it is not a local folder or file, and the hub name could not be "
        "resolved (offline or no access: {}). Pass a local folder or a config.json path"
    )
    try:
        data, _ = PretrainedConfig.get_config_dict(name)
    except (OSError, ValueError) as exc:
        raise ValueError(unresolved.format(type(exc).__name__)) from exc
    check_config_dict(data, where=f"model config of {name!r}")
    check_config_class(data, name, trust_remote_code=trust)
    return _auto_config(name, trust, f"cannot read the config of {name!r}", "pass a local folder or config.json")


def check_hub_reachable(name: str, timeout_s: float = 1.5) -> None:
    """Fail in about a second when the hub cannot be reached, instead of huggingface_hub's retries (~25 s): under
    ``HF_HUB_OFFLINE`` only its cache answers (no network call is made), otherwise its endpoint must resolve and accept
    a connection."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError as exc:
        raise ValueError(
            f"could not resolve model {name!r}: it is not a local folder or file, and the hub ({constants.ENDPOINT}) "
            f"cannot be reached ({exc.__class__.__name__}: {exc}). Pass a local folder or a config.json path, or set "
            "HF_HUB_OFFLINE=1 to use the local cache only"
        ) from None


def check_causal_lm(config: Any, *, trust_remote_code: bool = False) -> bool:
    """Refuse a config that is no causal LM; True when its causal LM is the folder's own (trusted) ``auto_map`` class,
    False when it is transformers' registered one. An ``auto_map`` causal LM of a config transformers cannot build
    as one raises :class:`~hf_dist.planning.remote_code.RemoteCodeError` unless ``trust_remote_code``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    trust = check_trust_flag(trust_remote_code)
    registered = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
    if uses_folder_class(config, "AutoModelForCausalLM", registered=registered, trust_remote_code=trust):
        return True
    if registered:
        return False
    raise ValueError(
        f"model_type {config.model_type!r} is not a causal language model (no AutoModelForCausalLM mapping); "
        "hf_dist plans fine-tuning of causal LMs such as llama, mistral, qwen2, gpt2"
    )


def resolve_config(model: Any, *, trust_remote_code: bool = False) -> Any:
    """The transformers config of a config object, a config dict, a local folder / config.json, a hub name, or the
    fields a plan described without transformers (:class:`~hf_dist.planning.families.ConfigFields`)."""
    if is_config(model):
        return model
    if isinstance(model, ConfigFields):
        return config_from_dict(model.source)
    if isinstance(model, dict):
        return config_from_dict(model)
    if isinstance(model, (str, os.PathLike)):
        return load_config(os.fspath(model), trust_remote_code=trust_remote_code)
    raise ValueError(
        f"cannot read a model config from an object of type {type(model).__name__}; pass a transformers config, "
        "a config dict, a local folder / config.json path or a hub name"
    )


def meta_model(config: Any, *, trust_remote_code: bool = False) -> Any:
    """``config`` built on the meta device (module tree only, no weight memory); a causal LM when it is one.

    Registered causal-LM configs use the model class itself, not ``from_config``: under an active ZeRO-3
    config ``from_config`` wraps the build in ``deepspeed.zero.Init``, a collective that hangs when only one
    rank plans. The folder's own classes (``auto_map``) are built only with ``trust_remote_code=True``, through
    the auto classes with zero.Init marked active (:func:`_build`).
    """
    import contextlib

    import torch

    try:
        from transformers.modeling_utils import set_zero3_state
    except ImportError:  # pragma: no cover - older/newer transformers
        set_zero3_state = contextlib.nullcontext
    with torch.device("meta"), set_zero3_state():
        return _build(config, trust_remote_code=trust_remote_code)


def causal_lm_from_config(config: Any, *, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_config(config, **kwargs)`` (real weights, the config's dtype), asked with an
    explicit ``trust_remote_code``: the folder's ``auto_map`` class only when True (:func:`check_causal_lm` refuses
    a config only that code can build before transformers is asked)."""
    from transformers import AutoModelForCausalLM

    check_causal_lm(config, trust_remote_code=trust_remote_code)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **kwargs)


def _build(config: Any, *, trust_remote_code: bool = False) -> Any:
    """``config``'s model on the current device: its causal LM when it has one (else its base model), tied.

    The folder's ``auto_map`` class is imported only with ``trust_remote_code=True``; without it a class
    transformers registers is built instead, and a config only the folder's code can build raises
    :class:`~hf_dist.planning.remote_code.RemoteCodeError` (:func:`~hf_dist.planning.remote_code.uses_folder_class`).
    """
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    trust = check_trust_flag(trust_remote_code)
    registered = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
    if registered and not uses_folder_class(config, "AutoModelForCausalLM", registered=True, trust_remote_code=trust):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    else:
        model = _auto_model(config, (AutoModelForCausalLM, AutoModel), trust)
    if hasattr(model, "tie_weights"):  # transformers 5.0's bare constructor leaves tied weights untied
        model.tie_weights()
    return model


def _auto_model(config: Any, autos: tuple, trust: bool) -> Any:
    """The first of ``autos`` that builds ``config``, asked with an explicit ``trust_remote_code`` (never None)."""
    errors = []
    for auto in autos:
        registered = type(config) in auto._model_mapping
        if uses_folder_class(config, auto.__name__, registered=registered, trust_remote_code=trust):
            return auto.from_config(config, trust_remote_code=True)  # trusted: the folder's class, its own errors
        try:
            return auto.from_config(config, trust_remote_code=False)
        except (ValueError, KeyError) as exc:  # config class not registered for this auto class
            errors.append(f"{auto.__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else exc}")
    raise ValueError(f"cannot build a model for config type {type(config).__name__}: {'; '.join(errors)}")


# LoRA adapter / PEFT bookkeeping parameters are not part of the base model
