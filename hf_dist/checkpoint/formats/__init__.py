"""Reading checkpoints: the folder layout model (``layout``), the reader interface (``reader``) and one reader per
training format (``deepspeed``, ``autotp``, ``dcp``, ``hf``), plus the parameter specs of known model families."""
