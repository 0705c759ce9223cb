"""What keeps checkpoint handling safe: every unpickle is torch's ``weights_only`` load with one allowlist, hf_dist's
own and the libraries' it drives (``loading``, ``trainer_loads``, DCP's metadata in ``dcp_metadata``); every path
a checkpoint names stays inside it (``paths``). Every output folder's destination is checked by
:mod:`hf_dist.checkpoint.output.paths`."""
