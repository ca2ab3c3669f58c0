"""The child side of the process boundary: one measurement inside a launched process group.
``python -m autotune.worker JOB.json`` (``main``) reads the job record and writes one result record
per rank (``protocol`` and ``dist_env``, its free port and plain-``python`` process-group variables,
the only modules the parent side imports), driving DeepSpeed or FSDP2 through
the engine adapters (``engines``, which also put a strategy's long-context knobs on a Hugging Face
model through autotune.models.long_context), measuring CPU peaks (``cpu_memory``) and CUDA snapshots
(``snapshot``). torch and deepspeed are imported inside functions, never at import."""
