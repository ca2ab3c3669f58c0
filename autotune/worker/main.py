"""Run one measurement, DeepSpeed or FSDP2: ``python -m autotune.worker JOB.json``.

The strategy's ``engine`` picks the engine adapter: deepspeed (``deepspeed.init_distributed`` and
``deepspeed.initialize``) or fsdp2 (``torch.distributed.init_process_group``, gloo on CPU, NCCL
plus gloo on CUDA; ``autotune.models.fsdp2.apply``; ``autotune.models.fsdp2.make_optimizer``). Both train with the
job's optimizer (``training.optimizer``, autotune.spec.OptimizerSpec) and run the
same step loop (``_step_loop``), memory probe, result keys and failure handling.

Launched by ``torchrun --nproc_per_node N`` (or the ``deepspeed`` launcher) or by plain
``python`` (then a 1-process group on a free local port is created). Reads RANK / WORLD_SIZE /
LOCAL_RANK from the environment. Every rank writes its own result file; the launcher backend
reads them (rank 0's file carries the cross-rank summary when all ranks finished). Failure is
data: the process writes ``status`` != ``ok`` and exits with code 0 for a *measured* failure
(oom, nan), 1 for ``error``. A crash or a hang leaves no result file: the launcher must treat
a missing file (plus the exit status / timeout) as the failure.

Job JSON (all keys but ``model``, ``training``, ``strategy`` are optional)::

    {
      "model":    {ModelSpec fields},           # autotune.spec.ModelSpec(**model)
      "training": {TrainingSpec fields},        # seq_len, global_batch_size, precision, optimizer
                                                #   (OptimizerSpec fields: type, lr, betas, eps, ...)
      "strategy": {Strategy fields},            # autotune.strategy.Strategy(**strategy); the long-context
                                                #   knobs (Ulysses, context parallel, tiled loss / MLP,
                                                #   activation offload) applied to an HF model by
                                                #   autotune.models.long_context (engines.apply_long_context)
      "deepspeed_config": {...},                # deepspeed only; default: engine_configs.to_deepspeed_config(...)
                                                #   with data-parallel size = WORLD_SIZE (fsdp2: the
                                                #   layout is always engine_configs.to_fsdp2_config(...) over
                                                #   WORLD_SIZE ranks, LOCAL_WORLD_SIZE per node)
      "result_path": "result.json",             # default: JOB.json's dir / "result.json";
                                                #   rank r > 0 writes "<stem>.rank<r>.json"
      "warmup_steps": 2, "measure_steps": 2,    # optimizer steps (each = GAS micro-steps); the peak is
                                                #   the max over every micro-step of the measured steps
      "loop": "keep_outputs",                   # the usual user loop: outputs = engine(**batch);
                                                #   engine.backward(outputs.loss); engine.step() (outputs,
                                                #   logits included, alive until the next forward rebinds
                                                #   it); "drop_outputs": only the loss is kept
      "optimizer_impl": "auto",                 # deepspeed only; "deepspeed": the config's optimizer section
                                                #   (FusedAdam / DeepSpeedCPUAdam, JIT-built ops);
                                                # "torch": the config's optimizer section as a
                                                #   torch.optim AdamW / Adam (fused) or SGD, passed to initialize
                                                #   (no JIT builds); "auto": torch on CPU, deepspeed on CUDA
      "memory": "auto",                         # "cuda" (max_memory_allocated), "profiler" (CPU: peak
                                                #   tensor bytes from torch.profiler allocation events),
                                                #   "none"; "auto": cuda on CUDA, profiler on CPU
      "seed": 0,
      "data_seed": null,                        # the batches' seed alone (null: seed): the same model on
                                                #   other batches
      "fresh_batches": false,                   # true: every micro-step a new batch (a data loader; EP's
                                                #   received rows follow each batch's routing); false: two
                                                #   batches, reused every step
      "gc_collect": true,                       # after backward and after the step: gc.collect()
                                                #   and, on CPU, a few 1-element all-reduces per
                                                #   process group: ProcessGroupGloo keeps each worker
                                                #   thread's last work (tensors included) alive, so
                                                #   0-3 of DeepSpeed's flat all-reduce buckets would
                                                #   outlive the step at random (not so with NCCL);
                                                #   this reduces, but does not remove, the effect
                                                #   (blocks released on gloo's threads are counted
                                                #   through track_all_threads):
                                                #   accuracy figures use the max over steps and
                                                #   ranks (what a job OOMs at)
      "device": "auto",                         # "cuda" | "cpu" | "auto"
      "gpu": "h100-80gb",                       # GPU preset of the default deepspeed_config (none given)
      "hf_config": "path/config.json",          # build an HF model from_config (transformers installed)
      "tokens": "path/tokens.npy",              # batches: windows of these token ids (profile.tokens;
                                                #   autotune.models.tokens), not uniform random ids
      "model_factory": "pkg.mod:build_model",   # the user's factory (contract: autotune.models.sources)
      "python_path": ["dir", ...],              # put first on sys.path before importing the factory
      "snapshot": "trials/3/memory_snapshot.pickle",  # CUDA: record allocation history, dump it here
                                                #   (also on OOM; rank r > 0: "<stem>.rank<r>.pickle");
                                                #   CPU: no-op with a note
      "exchange_timeout_s": 60,                 # bound of the final cross-rank exchange
      "fault": {"rank": 1, "phase": "init" | "end", "kind": "error" | "oom"}  # test-only injection
    }

Result JSON (one per rank)::

    {
      "status": "ok" | "oom" | "nan" | "error",
      "reason": "short human sentence" | null,
      "phase": "init" | "forward" | "backward" | "optimizer" | null,  # where it failed
      "rank": 0, "world_size": 2, "device": "cpu" | "cuda",
      "peak_allocated_bytes": int,          # steady-state (measured steps) peak of this rank:
                                            #   CUDA max_memory_allocated / CPU peak tensor bytes
      "peak_reserved_bytes": int | null,    # CUDA max_memory_reserved (null on CPU)
      "peak_phase": "forward" | "backward" | "optimizer",  # phase containing the peak
      "phase_peaks_bytes": {"forward": int, "backward": int, "optimizer": int},
      "step_peaks_bytes": [int, ...],       # CPU profiler: peak of each measured optimizer step
                                            #   (all its micro-steps)
      "min_step_peak_bytes": int,           # CPU profiler: smallest of those
      "max_step_peak_bytes": int,           # CPU profiler: largest of those (= peak_allocated_bytes)
      "loop": "keep_outputs" | "drop_outputs",
      "step_start_bytes": int,              # allocated at the start of the last measured step
      "init_peak_bytes": int | null,        # peak during model build + deepspeed.initialize
      "step_times_s": [float, ...],         # measured optimizer steps, wall clock
      "tokens_per_s": float,                # all ranks: mbs * seq * GAS * world / (sp * cp) / median step time
      "host_offload_peak_bytes": int,       # activation_offload: most host bytes its checkpointed inputs held
      "routing": {"sent": int, "steps": [[[int, ...], ...], ...]},  # expert parallelism: the rows this rank
                                            #   sends per dispatch and, per measured micro-step, every
                                            #   dispatch's received rows per (source rank, local expert)
                                            #   (autotune.worker.routing)
      "losses": [float, ...],               # every step (warm-up included)
      "num_parameters": int,
      "optimizer": "BF16_Optimizer" | ...,  # DeepSpeed's final optimizer wrapper class (fsdp2: "AdamW")
      "optimizer_settings": {"class": str, "lr": float, ...},  # read back from the optimizer the
                                            #   engine built: class, lr, betas, eps, weight_decay
                                            #   (sgd: momentum instead of betas, eps), gradient_clipping
      "gradient_accumulation_steps": int,
      "all_ranks": {"status": [per rank], "phase": [...], "peak_allocated_bytes": [...],
                    "min_step_peak_bytes": [...], "max_step_peak_bytes": [...], "peak_phase": [...],
                    "phase_peaks_bytes": [...]},
                                            # every rank joins this one exchange whatever its status
                                            #   (absent if the exchange failed or timed out)
      "model_source": "reference" | "hf" | "factory:pkg.mod:fn",
      "notes": [str, ...],                  # approximations, snapshot no-op on CPU...
      "snapshot_path": str | null,          # the memory snapshot written (CUDA, "snapshot" set)
      "elapsed_s": float
    }

An ``oom`` reason starts with autotune.worker.snapshot.oom_note(phase) (the OOM-phase table: cause and remedy per phase).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from autotune.worker.protocol import WorkerJob
from autotune.worker.cpu_memory import PHASES, MEASURED_MARK, CpuMemoryProbe, record_phase
from autotune.worker.engines import Context, DeepSpeedEngine, Fsdp2Engine, flush_gloo, set_dist_env
from autotune.models.sources import is_oom


def result_path_for_rank(result_path: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its result (rank 0: ``result_path`` itself)."""
    p = Path(result_path)
    return p if rank == 0 else p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def run_job(job: WorkerJob, job_dir: Path, write_early: Optional[Any] = None) -> dict[str, Any]:
    """Run the job in this process (a rank of the group); returns the result dict.

    ``write_early(result)``: called with a failed rank's result before the cross-rank exchange, so
    the launcher sees the failure at once even if a peer keeps the exchange waiting."""
    t_start = time.time()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    result: dict[str, Any] = {"status": "error", "reason": None, "phase": "init", "rank": rank, "world_size": world,
                              "device": None, "peak_allocated_bytes": None, "peak_reserved_bytes": None,
                              "peak_phase": None, "phase_peaks_bytes": {}, "step_start_bytes": None,
                              "init_peak_bytes": None, "step_times_s": [], "tokens_per_s": None, "losses": [],
                              "num_parameters": None, "optimizer": None, "gradient_accumulation_steps": None}
    probe: Optional[CpuMemoryProbe] = None
    notes: list[str] = []
    result["notes"] = notes
    snap_info: dict[str, Any] = {"path": None}
    try:
        import torch

        from autotune.worker import snapshot

        want = job.setting("device")
        use_cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
        device_kind = "cuda" if use_cuda else "cpu"
        result["device"] = device_kind
        if not use_cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        memory_mode = job.setting("memory")
        if memory_mode == "auto":
            memory_mode = "cuda" if use_cuda else "profiler"
        if memory_mode == "profiler":
            probe = CpuMemoryProbe()
        snap_path = job.snapshot
        if snap_path and not use_cuda:
            notes.append("memory snapshot requested, but torch.cuda memory history needs CUDA and this worker "
                         "ran on the CPU: no snapshot written")
        snap_path = str(result_path_for_rank(snap_path, rank)) if snap_path else ""
        with snapshot.memory_snapshot(snap_path, enabled=bool(snap_path) and use_cuda) as snap_info:
            with (probe if probe is not None else contextlib.nullcontext()):
                _run(job, result, probe, rank, world, local_rank, use_cuda, memory_mode)
    except BaseException as exc:  # failure is data
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["status"] = "oom" if is_oom(exc) else "error"
        first = (str(exc).strip().splitlines() or [""])[0]
        result["reason"] = f"{type(exc).__name__}: {first[:300]}"
        if result["status"] == "oom":
            from autotune.worker.snapshot import oom_note

            result["reason"] = f"{oom_note(result.get('phase'))}; {type(exc).__name__}: {first[:200]}"
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-4000:]
    if probe is not None:
        try:
            mem = probe.analyse()
            result.update({k: v for k, v in mem.items() if v is not None or k not in result})
        except Exception as exc:  # pragma: no cover - profiler internals changed
            result["notes"].append(f"memory analysis failed: {type(exc).__name__}: {exc}")
    result["snapshot_path"] = snap_info.get("path")
    if result["status"] == "ok":
        result["phase"] = None
    elif write_early is not None:
        result["elapsed_s"] = round(time.time() - t_start, 3)
        write_early(result)
    _gather_ranks(result, world)
    result["elapsed_s"] = round(time.time() - t_start, 3)
    return result


_EXCHANGE: dict[str, Any] = {"group": None}
"""The gloo group (with its own short timeout) of the final cross-rank exchange, made at init."""
_SUMMARY_KEYS = ("status", "phase", "peak_allocated_bytes", "min_step_peak_bytes", "max_step_peak_bytes", "peak_phase",
                 "phase_peaks_bytes")


def _make_exchange_group(timeout_s: float) -> None:
    """Created right after init_distributed, while every rank is still in step (new_group is
    collective). gloo also on CUDA: the exchange is a handful of small CPU objects."""
    from datetime import timedelta

    import torch.distributed as dist

    _EXCHANGE["group"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _gather_ranks(result: dict, world: int) -> None:
    """Every rank, whatever its status, takes part in one all_gather of its summary (status and
    peaks). A rank that failed before the exchange group existed cannot join: the others then give
    up after the group's timeout ("exchange_timeout_s") instead of waiting forever."""
    row = {k: result.get(k) for k in _SUMMARY_KEYS}
    if world <= 1:
        result["all_ranks"] = {k: [v] for k, v in row.items()}
        return
    group = _EXCHANGE["group"]
    if group is None:
        result["notes"].append("no cross-rank exchange: the process group was never set up on this rank")
        return
    try:
        import torch.distributed as dist

        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, row, group=group)
        result["all_ranks"] = {k: [r[k] for r in rows] for k in _SUMMARY_KEYS}
    except Exception as exc:
        result["notes"].append(f"cross-rank exchange failed: {type(exc).__name__}: "
                               f"{(str(exc).strip().splitlines() or [''])[0][:200]}")


def _maybe_fault(job: WorkerJob, rank: int, phase: str) -> None:
    """Test-only fault injection: ``"fault": {"rank": 1, "phase": "init" | "end", "kind": "error" | "oom"}``."""
    fault = job.fault
    if not fault or int(fault.get("rank", -1)) != rank or fault.get("phase", "end") != phase:
        return
    if fault.get("kind") == "oom":
        raise MemoryError(f"injected out-of-memory fault on rank {rank} at {phase}")
    raise RuntimeError(f"injected fault on rank {rank} at {phase}")


def _run(job: WorkerJob, result: dict, probe: Optional[CpuMemoryProbe], rank: int, world: int, local_rank: int,
         use_cuda: bool, memory_mode: str) -> None:
    import torch

    from autotune.models.reference import count_parameters
    from autotune.models.sources import batch_seed, build_for_job, norm_kernel_refusal
    from autotune.spec import ModelSpec, TrainingSpec
    from autotune.strategy import Strategy

    ctx = Context(job, result, probe, rank, world, local_rank, use_cuda, memory_mode)
    model_spec, training, strategy = ModelSpec(**job.model), TrainingSpec(**job.training), Strategy(**job.strategy)
    refusal = norm_kernel_refusal(model_spec, use_cuda)
    if refusal:
        raise RuntimeError(refusal)
    seed = int(job.setting("seed"))
    torch.manual_seed(seed + rank)
    device = set_dist_env(ctx)
    engine_cls = Fsdp2Engine if strategy.engine == "fsdp2" else DeepSpeedEngine
    engine_cls.init_distributed(ctx)
    if world > 1:
        _make_exchange_group(float(job.setting("exchange_timeout_s")))
    _maybe_fault(job, rank, "init")

    data_seed = seed if job.data_seed is None else int(job.data_seed)
    built = build_for_job(job.to_json(), model_spec, training, seed=batch_seed(data_seed, rank))
    result["model_source"] = built.source
    result["num_parameters"] = count_parameters(built.module)
    engine = engine_cls(ctx, built, model_spec, strategy, device)
    result["notes"].extend(built.notes)
    result["optimizer"] = engine.optimizer_name
    result["optimizer_settings"] = engine.optimizer_settings
    result["gradient_accumulation_steps"] = engine.gas
    if probe is not None:
        probe.gas = engine.gas
    # the batches of this rank (Ulysses / context parallel: its group's sample, sharded by the engine)
    def new_batch() -> dict:
        return engine.prepare_batch(built.batch_fn(engine.mbs, training.seq_len, device))

    batches = [new_batch() for _ in range(2)]
    if job.setting("gc_collect"):
        # collect once, then freeze the survivors (torch, DeepSpeed, transformers modules...) so
        # the per-phase collections below only scan what the steps create (seconds -> ms)
        gc.collect()
        gc.freeze()
    if probe is not None:
        probe.init_end = probe.now()
    if use_cuda:
        torch.cuda.synchronize()
    routing = None
    if strategy.expert_parallel_size > 1:
        from autotune.worker.routing import RoutingRecorder

        routing = RoutingRecorder.install(built.module)
    if not _step_loop(ctx, engine, built, batches, routing, new_batch if job.setting("fresh_batches") else None):
        return
    recorded = routing.result() if routing is not None else None
    if recorded is not None:
        result["routing"] = recorded
    _maybe_fault(job, rank, "end")
    times = sorted(result["step_times_s"])
    if times:
        median = times[len(times) // 2]
        shards = strategy.sequence_parallel_size * strategy.context_parallel_size  # ranks sharing a sequence
        result["tokens_per_s"] = engine.mbs * training.seq_len * engine.gas * world / shards / median
    if strategy.activation_offload != "none":
        from autotune.models.long_context import host_offload_bytes

        result["host_offload_peak_bytes"] = host_offload_bytes()["peak"]
    result["status"] = "ok"
    result["reason"] = None


def _step_loop(ctx: Context, engine: Any, built: Any, batches: list, routing: Any = None,
               new_batch: Any = None) -> bool:
    """Warm-up and measured optimizer steps (each GAS micro-steps of forward, backward, optimizer),
    one engine-neutral loop; False when a loss went non-finite (status nan already set). ``routing``: an
    autotune.worker.routing.RoutingRecorder, told where each measured micro-step begins. ``new_batch``
    (``fresh_batches``): each micro-step after the first replaces the batch it reads (the old one freed first).

    "loop": "keep_outputs" (default) is the loop people write, ``outputs = engine(**batch);
    engine.backward(outputs.loss); engine.step()``: ``outputs`` (and the logits in it) stays alive
    through backward and the step, until the next forward's result is bound to the name;
    "drop_outputs" keeps only the loss (the logits die with the forward)."""
    import torch

    from autotune.models.sources import loss_of

    job, result, probe, use_cuda = ctx.job, ctx.result, ctx.probe, ctx.use_cuda
    warmup, measure = int(job.setting("warmup_steps")), int(job.setting("measure_steps"))
    collect = bool(job.setting("gc_collect"))
    groups = engine.process_groups()
    phase_peaks = {ph: 0 for ph in PHASES}
    peak_reserved = 0
    keep = job.setting("loop") == "keep_outputs"
    result["loop"] = "keep_outputs" if keep else "drop_outputs"
    outputs = loss = None
    for step in range(warmup + measure):
        measured = step >= warmup
        if use_cuda and measured and step == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if probe is not None and measured:
            probe.start()
            probe.last_step_start = probe.now()
        t0 = time.perf_counter()
        step_losses = []
        for micro in range(engine.gas):
            last = micro == engine.gas - 1
            for phase in PHASES:
                result["phase"] = phase
                t_ph = probe.now() if probe is not None else 0
                mark = record_phase(MEASURED_MARK + phase) if (probe is not None and measured) else contextlib.nullcontext()
                with mark:
                    if phase == "forward":
                        if routing is not None and measured:
                            routing.open_micro_step()
                        if new_batch is not None and (step or micro):
                            batches[micro % len(batches)] = None
                            batches[micro % len(batches)] = new_batch()
                        out = engine.forward(batches[micro % len(batches)])
                        loss = loss_of(out, built.source)
                        outputs = out if keep else None
                        del out
                    elif phase == "backward":
                        engine.backward(loss, last)
                    else:
                        engine.step(last)
                if collect and phase != "forward":
                    gc.collect()  # see the "gc_collect" note in the module docstring
                    if not use_cuda:
                        flush_gloo(groups)
                if use_cuda and measured and ctx.memory_mode == "cuda":
                    torch.cuda.synchronize()
                    phase_peaks[phase] = max(phase_peaks[phase], torch.cuda.max_memory_allocated())
                    peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved())
                    torch.cuda.reset_peak_memory_stats()
                if probe is not None and measured:
                    probe.marks.append((phase, t_ph, probe.now()))
            step_losses.append(float(loss.detach().float()))
        if use_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        result["losses"].append(sum(step_losses) / len(step_losses))
        if measured:
            result["step_times_s"].append(dt)
        if not all(math.isfinite(v) for v in step_losses):
            result.update(status="nan", reason=f"non-finite loss {step_losses} at step {step}", phase="forward")
            return False
    del loss, outputs
    if ctx.memory_mode == "cuda":
        result["phase_peaks_bytes"] = phase_peaks
        result["peak_allocated_bytes"] = max(phase_peaks.values())
        result["peak_phase"] = max(phase_peaks, key=phase_peaks.get)
        result["peak_reserved_bytes"] = peak_reserved
    return True


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m autotune.worker JOB.json", file=sys.stderr)
        return 2
    job_path = Path(argv[0])
    try:
        job = WorkerJob.from_json(json.loads(job_path.read_text()))
    except (OSError, ValueError, TypeError) as err:
        print(f"autotune worker: bad job file {job_path}: {err}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    out = result_path_for_rank(job.result_path or job_path.with_name("result.json"), rank)
    def write(res: dict) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str))
        tmp.replace(out)

    result = run_job(job, job_path.parent, write_early=write)
    write(result)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            if result["status"] == "ok" and dist.get_world_size() > 1:
                # every rank done with its collectives before any tears the group down (a rank that
                # destroys it while a peer still sends makes that peer's last collective fail); gloo's
                # monitored barrier gives up after a minute if a peer never comes (it failed: its result says so)
                if dist.get_backend() == "gloo":
                    import datetime

                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
                else:
                    dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
    return 1 if result["status"] == "error" else 0


if __name__ == "__main__":  # python -m autotune.worker.main JOB.json (as python -m autotune.worker)
    sys.exit(main())
