"""Code a model folder names runs only when the user says so (``trust_remote_code=True``, ``--trust-remote-code``).

A config.json may name classes in the folder's own Python files: ``"auto_map": {"AutoModelForCausalLM":
"modeling_x.X"}``. transformers imports such a file when it builds that class with ``trust_remote_code=True`` (and
may prompt when it is None). hf_dist never derives that permission from the config: every path that reads a model
config takes an explicit ``trust_remote_code`` (default False) and passes True or False, never None. Without it:

- a config whose own class, or whose causal LM, exists only in the folder's code is refused with one line
  (:class:`RemoteCodeError`): an unknown ``model_type`` with an ``AutoConfig`` entry, or a ``model_type``
  transformers knows but not as a causal LM (``t5``) with an ``AutoModelForCausalLM`` entry;
- a ``model_type`` transformers registers as a causal LM (``llama``) is built from transformers' registered class:
  the ``auto_map`` entry is ignored (a warning says so) and the folder's code is never imported.

With it, the folder's classes are built, as ``from_pretrained(..., trust_remote_code=True)`` builds them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

_WARNED: set[tuple[str, str]] = set()  # (config, class reference) already warned about in this process
FLAG = "pass --trust-remote-code (trust_remote_code=True) only if you trust this folder"


class RemoteCodeError(ValueError):
    """A model config names code to import (``auto_map``) and ``trust_remote_code=True`` was not given."""


def check_trust_flag(trust_remote_code: Any) -> bool:
    """``trust_remote_code`` as given, refused unless it is True or False (None would let transformers prompt)."""
    if not isinstance(trust_remote_code, bool):
        raise ValueError(
            f"trust_remote_code must be True or False, got {trust_remote_code!r}; pass True only for a model folder "
            "whose code you trust"
        )
    return trust_remote_code


def auto_map_entry(config: Any, auto_class: str) -> str | None:
    """The class reference ``auto_class`` maps to in a config's (or config dict's) ``auto_map``, else None."""
    auto_map = config.get("auto_map") if isinstance(config, dict) else getattr(config, "auto_map", None)
    ref = (auto_map or {}).get(auto_class) if isinstance(auto_map, dict) else None
    if isinstance(ref, (list, tuple)):  # AutoTokenizer maps to a (slow, fast) pair
        ref = next((r for r in ref if r), None)
    return ref if isinstance(ref, str) else None


def refusal(auto_class: str, ref: str, source: str) -> RemoteCodeError:
    """The one-line refusal: which file would be imported, the ``auto_map`` entry that names it, the flag."""
    repo, _, local_ref = ref.rpartition("--")
    module_file = local_ref.rsplit(".", 1)[0].replace(".", os.sep) + ".py"
    if repo:
        where = f"{module_file} of hub repo {repo}"
    elif source and os.path.isdir(source):
        where = os.path.join(os.path.abspath(source), module_file)
    elif source:
        where = f"{module_file} of hub repo {source}"
    else:
        where = f"{module_file} beside the config"
    config_file = os.path.join(source, "config.json") if source else "the config"
    return RemoteCodeError(
        f"refusing to import code from {where}: {config_file}'s auto_map names {auto_class} -> {ref}; {FLAG}"
    )


def check_config_class(data: dict, source: str, *, trust_remote_code: bool) -> None:
    """Refuse, before transformers reads it, a config.json (``data``, read from folder or hub repo ``source``) whose
    config class exists only in the folder's code: an ``AutoConfig`` entry and a ``model_type`` transformers does
    not know. A known ``model_type`` is read with transformers' own config class, its entry ignored."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    ref = auto_map_entry(data, "AutoConfig")
    if ref is None or check_trust_flag(trust_remote_code) or data.get("model_type") in CONFIG_MAPPING:
        return
    raise refusal("AutoConfig", ref, source)


def uses_folder_class(config: Any, auto_class: str, *, registered: bool, trust_remote_code: bool) -> bool:
    """Whether ``config``'s ``auto_class`` model is built from the folder's code (its ``auto_map`` entry).

    True only with ``trust_remote_code``. Without it, a config transformers can build itself (``registered``) is
    built that way (False, with a warning that the entry was ignored); any other raises :class:`RemoteCodeError`.
    """
    ref = auto_map_entry(config, auto_class)
    if ref is None:
        return False
    if check_trust_flag(trust_remote_code):
        return True
    source = str(getattr(config, "_name_or_path", "") or "")
    if not registered:
        raise refusal(auto_class, ref, source)
    if (source, ref) in _WARNED:
        return False
    _WARNED.add((source, ref))
    logging.getLogger("hf_dist").warning(
        "%s's auto_map names %s -> %s: built with transformers' own %s class instead, without importing the "
        "folder's code (pass --trust-remote-code / trust_remote_code=True to build the folder's class)",
        os.path.join(source, "config.json") if source else "the config", auto_class, ref, config.model_type,
    )  # fmt: skip
    return False
