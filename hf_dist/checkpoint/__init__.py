"""Everything about checkpoint files. Submodules import torch lazily.

- ``layout``: what a checkpoint folder holds (format, family, world size, tag/step, per-rank files), read from
  file names by :func:`hf_dist.checkpoint.layout.read_layout`: the one model convert, reshard and resume use.
- ``marker`` / ``auto_resume``: complete-checkpoint markers, and the newest complete checkpoint a run may
  resume from (:func:`hf_dist.auto_resume`), checked against its strategy and world size.
- ``reshard``: resume on another number of ranks (:func:`hf_dist.prepare_resume`, ``hf-dist reshard``).
- ``convert`` / ``verify``: read (``deepspeed_reader``, ``dcp_reader``, ``hf_io``; pickles through
  ``safe_pickle``) -> plan names (``plan``, ``param_specs``, ``transform``) -> write (``writer``,
  ``dcp_writer``; destinations checked by ``paths``, built atomically by :mod:`hf_dist.atomic_io`).
"""
