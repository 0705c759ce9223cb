"""What keeps checkpoint handling safe: the pickle loading gate (``pickles``, with the DCP metadata it allows in
``dcp_metadata``) and the destination checks of every output folder (``output_paths``)."""
