"""Writing converted weights: a Hugging Face folder (``hf_folder``) or a DCP folder (``dcp``)."""
