"""A training checkpoint turned into another format: ``hf-dist convert`` (``convert``: sharded -> HF folder, PEFT
adapter, or DCP), ``hf-dist verify`` (``verify``: two checkpoints compared tensor by tensor), the validated plan of
which tensors go where (``conversion_plan``) and the name and layout transforms between formats (``transform``).
Reading is :mod:`hf_dist.checkpoint.formats`' and writing :mod:`hf_dist.checkpoint.write`'s."""
