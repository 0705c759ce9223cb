"""What happens inside a launched process: version probes, precision fixes, CPU specifics, launching.

``support`` probes the installed libraries, ``precision`` puts a model in the dtype its plan needs,
``cpu_fsdp`` is the explicit opt-in for FSDP on CPU ranks, ``launch`` starts CPU ranks.
"""
