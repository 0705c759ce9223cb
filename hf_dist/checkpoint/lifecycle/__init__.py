"""A training run's checkpoints over time: the manifest that makes one complete (``manifest``), the proof of one
without a manifest (``proof``), resuming (``resume_checks``, ``auto_resume``),
resuming on another world size (``reshard``), hf_dist's own sharded optimizer state (``sharded_state``), background
saves (``async_save``) and ZeRO-Infinity resume repairs (``zero_infinity``). Which run wrote which, and who owns
the output folder: :mod:`hf_dist.checkpoint.output`."""
