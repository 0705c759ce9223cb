"""Deciding a layout: hardware, model shape, memory and throughput arithmetic, and the planner.

Pure arithmetic over typed inputs (no process groups, no model weights): ``hardware`` detects or names
the machines, ``modelinfo`` reads a model's shape, ``layout`` is the one typed description of how a run
is laid out (and the strategy registry), ``memory`` and ``throughput`` estimate a layout, ``planner``
searches layouts, ``flops`` counts model FLOPs and ``wrap`` names the FSDP units.
"""
