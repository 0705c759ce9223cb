"""Deciding a layout: hardware, model shape, memory and throughput arithmetic, and the planner.

Pure arithmetic over typed inputs (no process groups, no model weights): ``hardware`` detects or names
the machines, ``model_source`` reads a model's config from wherever it comes (``config_checks`` validates it),
``modelinfo`` its shape, ``layout`` is the one typed description of how a run
is laid out (and the strategy registry), ``memory`` and ``throughput`` estimate a layout, ``planner``
searches layouts, ``flops`` counts model FLOPs and ``wrap`` names the FSDP units.
"""
