"""A training run's checkpoints over time: completion markers (``marker``), resuming (``resume_checks``,
``auto_resume``), resuming on another world size (``reshard``), hf_dist's own sharded optimizer state
(``sharded_state``), background saves (``async_save``) and ZeRO-Infinity resume repairs (``zero_infinity``)."""
