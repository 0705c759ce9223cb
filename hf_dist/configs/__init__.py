"""Config factories: a layout (usually a :class:`hf_dist.planning.planner.Plan`'s) becomes
``TrainingArguments`` kwargs, an FSDP config, a DeepSpeed JSON or an accelerate YAML.

Every factory is a pure function of its arguments: no environment, no files, no process groups, no model
building and no probing of the installed libraries (what they accept comes in as a
:class:`~hf_dist.planning.features.LibraryFeatures`), so the same inputs always give the same config and the
shipped YAMLs can be regenerated. :func:`hf_dist.auto_args` (``hf_dist/auto.py``) is the layer that looks at
the installed versions and the environment and calls them.
"""

from __future__ import annotations

from hf_dist.planning.layout import MIXED_PRECISIONS, OFFLOADS, STRATEGIES

__all__ = ["MIXED_PRECISIONS", "OFFLOADS", "STRATEGIES"]
