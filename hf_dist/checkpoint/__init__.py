"""Everything about checkpoint files. Submodules import torch lazily.

- ``formats/``: what a checkpoint folder holds and how to read it. ``formats.contents`` answers which layout a folder
  has and which files it must hold (format, family, world size, tag/step, per-rank files), read from file names by
  :func:`hf_dist.checkpoint.formats.contents.read_contents`: the one model convert, reshard and resume use; every file
  name and pattern it reads in ``formats.names``. ``formats.checkpoint_folder.open_checkpoint`` opens a checkpoint
  once: its folder object, that layout and its manifest (parsed there only), one frozen object every check and reader
  takes. Beside it the reader interface (``reader``), one reader per training format (``deepspeed``, ``autotp``,
  ``dcp``, ``hf``) and the parameter specs of known model families (``param_specs``).
- ``write/``: converted weights written as a Hugging Face folder (``hf_folder``) or a DCP folder (``dcp``).
- ``safety/``: nothing from a checkpoint runs: every unpickle is torch's ``weights_only`` load with one allowlist,
  hf_dist's own and the libraries' it drives (``loading``; the Trainer's loads in ``trainer_loads``; DCP's metadata
  in ``dcp_metadata``), every path a checkpoint names stays inside it (``paths``), errors in ``errors``.
- ``output/``: who owns an output folder: the live job writing it (``lock``), the run writing it now (``runs``), and
  the destination checks of every folder hf_dist writes (``paths``).
- ``lifecycle/``: a run's checkpoints over time: the manifest that makes one complete (``manifest``), the checks before a resume
  (``resume_checks``), the newest complete checkpoint a run may resume from (``auto_resume``,
  :func:`hf_dist.auto_resume`), resuming on another number of ranks (``reshard``, :func:`hf_dist.prepare_resume`,
  ``hf-dist reshard``), hf_dist's sharded optimizer state (``sharded_state``), background saves (``async_save``)
  and ZeRO-Infinity resume repairs (``zero_infinity``).
- ``conversion/`` (``convert``, ``verify``): read (``formats``) -> plan names (``conversion_plan``,
  ``formats.param_specs``, ``transform``) -> write (``write``; destinations checked by ``output.paths``, built
  atomically by :mod:`hf_dist.atomic_io`).
"""
