"""The trace worker: ``python -m hf_dist.tracing REQUEST.json RESULT.json`` (run by ``trace_memory``)."""

from hf_dist.tracing.api import worker_main

if __name__ == "__main__":
    raise SystemExit(worker_main())
