"""Who owns an output folder: the live job writing it (``lock``: one per folder, with its launch's token and
liveness), the run writing it now and the step it started from (``runs``), and the checks of every folder hf_dist
writes to (``paths``: never a source, its run folder, inside it, or a training checkpoint)."""
