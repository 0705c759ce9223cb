"""Checkpoint conversion: detect -> read (streaming, pickle-safe) -> transform -> write (atomic).

Public entry points: :func:`hf_dist.convert`, :func:`hf_dist.verify`,
:func:`hf_dist.checkpoint.detect.detect_format`. Submodules import torch lazily.
"""
