"""The two training engines the profiling worker drives through one step loop: DeepSpeed
(``deepspeed.initialize``) and FSDP2 (``autotune.models.fsdp2.apply``), each a small adapter with
``init_distributed``, ``forward``, ``backward``, ``step`` and its process groups; plus the
process-group helpers the worker's measurement needs (gloo flushing, free ports, the job's
config for this process group)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from autotune.worker.cpu_memory import CpuMemoryProbe
from autotune.worker.dist_env import free_port
from autotune.worker.protocol import WorkerJob


def process_groups(engine: Any) -> list:
    """The distinct process groups DeepSpeed uses (None = the default group)."""
    out: list = [None]
    for owner, attr in ((engine, "data_parallel_group"), (engine, "seq_data_parallel_group"),
                        (engine.optimizer, "dp_process_group"), (engine.optimizer, "real_dp_process_group")):
        g = getattr(owner, attr, None)
        for grp in (g if isinstance(g, (list, tuple)) else [g]):
            if grp is not None and all(grp is not o for o in out):
                out.append(grp)
    return out


def flush_gloo(groups: list) -> None:
    """Release the tensors gloo's worker threads keep from their last collective.

    ProcessGroupGloo holds each worker thread's last work (and so its tensors) until that thread
    runs the next one: on the CPU a flat gradient bucket of DeepSpeed's all-reduce outlives the
    step by a random number of steps (0-3 buckets seen). NCCL on a GPU has no such retention, so
    the worker pushes a few 1-element all-reduces through every group to measure the clean state.
    """
    import torch
    import torch.distributed as dist

    for grp in groups:
        for _ in range(4):
            dist.all_reduce(torch.zeros(1), group=grp)


def ds_config_for_job(job: WorkerJob, world_size: int) -> tuple[dict, Any, Any, Any]:
    from autotune.presets import gpu_from_name
    from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
    from autotune.strategy import Strategy
    from autotune.engine_configs import to_deepspeed_config

    model = ModelSpec(**job.model)
    training = TrainingSpec(**job.training)
    strategy = Strategy(**job.strategy)
    cfg = job.deepspeed_config
    if cfg is None:
        hw = HardwareSpec(gpu=gpu_from_name(job.setting("gpu")), gpus_per_node=world_size, num_nodes=1)
        cfg = to_deepspeed_config(strategy, model, training, hw)
    return json.loads(json.dumps(cfg)), model, training, strategy


def fsdp2_config_for_job(job: WorkerJob, world_size: int) -> dict:
    """The strategy's FSDP2 layout (autotune.engine_configs.to_fsdp2_config) over this process group:
    WORLD_SIZE ranks, LOCAL_WORLD_SIZE (torchrun) of them per node."""
    from autotune.presets import gpu_from_name
    from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
    from autotune.strategy import Strategy
    from autotune.engine_configs import to_fsdp2_config

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node < 1 or world_size % per_node:
        per_node = world_size
    hw = HardwareSpec(gpu=gpu_from_name(job.setting("gpu")), gpus_per_node=per_node, num_nodes=world_size // per_node)
    return to_fsdp2_config(Strategy(**job.strategy), ModelSpec(**job.model), TrainingSpec(**job.training), hw)


@dataclass(frozen=True)
class Context:
    """What one rank's run knows about its place and its measurement."""

    job: WorkerJob
    result: dict
    """The rank's result dict, filled in place."""
    probe: Optional[CpuMemoryProbe]
    """The CPU memory probe (memory "profiler"), else None."""
    rank: int
    world: int
    local_rank: int
    use_cuda: bool
    memory_mode: str
    """cuda | profiler | none (resolved from "auto")."""


def set_dist_env(ctx: Context) -> Any:
    """torchrun's variables for a plain ``python`` launch (a 1-process group on a free port); the device."""
    import torch

    os.environ.setdefault("RANK", str(ctx.rank))
    os.environ.setdefault("WORLD_SIZE", str(ctx.world))
    os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    if ctx.use_cuda:
        torch.cuda.set_device(ctx.local_rank)
        return torch.device("cuda", ctx.local_rank)
    return torch.device("cpu")


class DeepSpeedEngine:
    """The deepspeed engine's half of the step loop: ``deepspeed.initialize`` with the job's DeepSpeed
    config; forward / ``engine.backward`` / ``engine.step`` every micro-step (DeepSpeed applies the
    optimizer at the accumulation boundary)."""

    @staticmethod
    def init_distributed(ctx: Context) -> None:
        import deepspeed

        if not ctx.use_cuda:
            try:  # skip the JIT build of the shared-memory allreduce (a private DeepSpeed switch: deepspeed.ops.__compatible_ops__)
                deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
            except Exception:
                pass
        deepspeed.init_distributed(dist_backend="nccl" if ctx.use_cuda else "gloo", verbose=False)
        if not ctx.use_cuda:  # ZeRO-1/2's bucket all-reduce: its flat copy (allreduce_bucket)
            import torch.distributed as dist

            _yield_after_collectives(dist, ("all_reduce",))

    def __init__(self, ctx: Context, built: Any, model_spec: Any, strategy: Any, device: Any) -> None:
        import deepspeed
        import torch

        from autotune.models.sources import set_checkpointing

        ds_config, _, training, _ = ds_config_for_job(ctx.job, ctx.world)
        model = built.module
        n_ckpt = strategy.num_checkpointed(model_spec.num_hidden_layers)
        set_checkpointing(built, strategy.checkpointing if n_ckpt else "none",
                          strategy.checkpoint_selection(model_spec.num_hidden_layers), model_spec.num_hidden_layers)
        self.mpu = apply_long_context(ctx, built, strategy, training.seq_len,
                                      int(ds_config.get("gradient_accumulation_steps") or 1))
        if strategy.sequence_parallel_size > 1:  # DeepSpeed's Ulysses groups (runtime/config.py reads it)
            ds_config.setdefault("sequence_parallel_size", strategy.sequence_parallel_size)
        impl = ctx.job.setting("optimizer_impl")
        if impl == "auto":
            impl = "deepspeed" if ctx.use_cuda else "torch"
        optimizer = None
        if impl == "torch":
            # the config's optimizer section (the job's training.optimizer, as every config writes it)
            name, kwargs = torch_optimizer_of(ds_config.pop("optimizer", None) or {})
            fused = {"fused": True} if name != "SGD" else {}  # like FusedAdam: no full-size temporaries
            optimizer = getattr(torch.optim, name)(model.parameters(), **kwargs, **fused)
            ds_config["zero_allow_untested_optimizer"] = True
            ds_config["zero_force_ds_cpu_optimizer"] = False
        ds_config.pop("activation_checkpointing", None)  # applied by the model (non-reentrant torch checkpoint)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=self.mpu,
                                               model_parameters=None if optimizer is not None else model.parameters())
        self.optimizer_name = type(self.engine.optimizer).__name__
        self.optimizer_settings = optimizer_settings(self.engine.basic_optimizer, self.engine.gradient_clipping())
        self.gas = self.engine.gradient_accumulation_steps()
        self.mbs = self.engine.train_micro_batch_size_per_gpu()

    def prepare_batch(self, batch: dict) -> dict:
        """Ulysses: this rank's sequence shard of its SP group's sample (long_context.shard_batch)."""
        from autotune.models.long_context import shard_batch

        return shard_batch(batch, self.mpu)

    def forward(self, batch: dict) -> Any:
        return self.engine(**batch)

    def backward(self, loss: Any, last_micro: bool) -> None:
        self.engine.backward(loss)

    def step(self, last_micro: bool) -> None:
        self.engine.step()

    def process_groups(self) -> list:
        return process_groups(self.engine)


class Fsdp2Engine:
    """The fsdp2 engine's half of the step loop: ``autotune.models.fsdp2.apply`` (checkpointing, fully_shard
    per block and the root) with the strategy's layout (``to_fsdp2_config``, data-parallel size =
    WORLD_SIZE), the job's optimizer (``autotune.models.fsdp2.make_optimizer``: training.optimizer's class and
    hyper-parameters, ``foreach=True``); every micro-step
    ``(loss / GAS).backward()``, which reduce-scatters the gradients (as torchtitan's train_step does:
    no ``set_requires_gradient_sync(False)``, so no unsharded gradients accumulate); on the last
    micro-step clipping (``clip_grad_norm_`` over the sharded DTensor gradients, unless 0), ``optimizer.step()``
    and ``zero_grad(set_to_none=True)``. fp16: ``ShardedGradScaler`` (dynamic loss scaling)."""

    @staticmethod
    def init_distributed(ctx: Context) -> None:
        import torch.distributed as dist

        # gloo for CPU tensors next to NCCL on CUDA: CPUOffloadPolicy keeps sharded state on the host
        if ctx.use_cuda:
            dist.init_process_group(backend="cpu:gloo,cuda:nccl")
            return
        # one gloo worker thread: each thread keeps its last work's tensors alive until it runs the
        # next one, so with gloo's default two a unit's flat all-gather buffer can outlive its
        # copy-out at random (never so with NCCL); with one, the next collective releases it
        options = dist.ProcessGroupGloo._Options()
        options._threads = 1
        dist.init_process_group(backend="gloo", pg_options=options)
        _yield_after_collectives(dist)

    def __init__(self, ctx: Context, built: Any, model_spec: Any, strategy: Any, device: Any) -> None:
        from autotune.models import fsdp2

        config = fsdp2_config_for_job(ctx.job, ctx.world)
        self.model = built.module
        self.cp_mesh = None
        if strategy.context_parallel_size > 1:
            self.cp_mesh = context_parallel_mesh(ctx, strategy.context_parallel_size)
        from autotune.spec import TrainingSpec

        apply_long_context(ctx, built, strategy, TrainingSpec(**ctx.job.training).seq_len,
                           int(config["gradient_accumulation_steps"]))
        ctx.result["notes"].extend(fsdp2.apply(self.model, config))
        self.optimizer = fsdp2.make_optimizer(self.model, config)
        self.scaler = None
        if config["loss_scaling"]:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device.type)
        self.clip = float(config["gradient_clipping"])
        self.ep = int(strategy.expert_parallel_size)
        self.optimizer_name = type(self.optimizer).__name__
        self.optimizer_settings = optimizer_settings(self.optimizer, self.clip)
        self.gas = int(config["gradient_accumulation_steps"])
        self.mbs = int(config["micro_batch_size"])

    def prepare_batch(self, batch: dict) -> dict:
        """Context parallel: the same sample on every rank of a cp group, labels pre-shifted (the
        shards lose their neighbours), position ids explicit; torch shards them in forward."""
        if self.cp_mesh is None:
            return batch
        import torch
        import torch.distributed as dist

        out = dict(batch)
        ids = out["input_ids"]
        labels = out.pop("labels", ids)
        out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        out.setdefault("position_ids", torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous())
        group = self.cp_mesh.get_group()
        for key in ("input_ids", "shift_labels", "position_ids"):
            dist.broadcast(out[key], src=dist.get_global_rank(group, 0), group=group)
        return out

    def forward(self, batch: dict) -> Any:
        if self.cp_mesh is None:
            return self.model(**batch)
        # torch's ring attention (context_parallel) around forward and backward, as torchtitan's
        # train_context: it shards the [batch, seq] buffers in place (head-tail load balancing)
        import contextlib

        from torch.distributed.tensor.experimental import context_parallel

        bufs = [batch[k] for k in ("input_ids", "shift_labels", "position_ids")]
        self._cp = contextlib.ExitStack()
        self._cp.enter_context(context_parallel(self.cp_mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1],
                                                no_restore_buffers=set(bufs)))
        return self.model(**batch)

    def backward(self, loss: Any, last_micro: bool) -> None:
        scaled = loss / self.gas
        try:
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        finally:
            if getattr(self, "_cp", None) is not None:
                self._cp.close()
                self._cp = None

    def step(self, last_micro: bool) -> None:
        import torch

        if not last_micro:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip > 0 and self.ep > 1:  # gradients on two meshes (the experts', the dense parts')
            from autotune.models.expert_parallel import clip_grad_norm

            clip_grad_norm(self.model, self.clip)
        elif self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def process_groups(self) -> list:
        import torch.distributed as dist

        out: list = [None]
        for grp in ([] if dist.get_world_size() == 1 else mesh_groups(self.model)):
            if all(grp is not o for o in out):
                out.append(grp)
        return out


def long_context_on(strategy: Any) -> list[str]:
    """The strategy's long-context knobs that are not at their defaults."""
    from autotune.engine_configs import long_context_knobs

    return list(long_context_knobs(strategy))


def apply_long_context(ctx: Context, built: Any, strategy: Any, seq_len: int, gas: int = 1) -> Any:
    """The strategy's long-context knobs on the model (autotune.models.long_context.apply_long_context,
    after checkpointing, before the engine wraps it; ``gas``: the engine's accumulation steps, whose
    1 / GAS the tiled head is told), with a note each; the Ulysses mpu or None.
    Only a Hugging Face model (hf_config) has the structure they patch: any other source is refused
    in one line."""
    on = long_context_on(strategy)
    if not on:
        return None
    from autotune.models import long_context as lc
    from autotune.models.sources import UserModelError

    if built.source != "hf":
        raise UserModelError(f"{', '.join(on)}: the worker applies the long-context knobs to Hugging Face models "
                             f"(hf_config), but the model is {built.source}")
    model = built.module
    mpu = lc.apply_long_context(model, strategy, seq_length=seq_len, gradient_accumulation_steps=gas)
    notes = ctx.result["notes"]
    sp = strategy.sequence_parallel_size
    if sp > 1:
        notes.append(f"Ulysses sequence parallel {sp} (UlyssesSPAttentionHF over "
                     f"{model.config._attn_implementation}): {seq_len // sp} tokens of each sequence per rank")
    if strategy.context_parallel_size > 1:
        notes.append(f"context parallel {strategy.context_parallel_size} (torch context_parallel, ring attention)")
    tokens = seq_len // max(1, sp * strategy.context_parallel_size)
    if strategy.tiled_loss:
        notes.append(f"tiled loss: {lc.loss_tiles(strategy.micro_batch_size * tokens, model.config.vocab_size)} "
                     f"tile(s) of TiledFusedLogitsLoss")
    if strategy.tiled_mlp:
        notes.append(f"tiled MLP: {len(lc.decoder_mlps(model))} MLPs through TiledMLP, "
                     f"{-(-tokens // model.config.hidden_size)} tile(s) each")
    if strategy.activation_offload != "none":
        notes.append("activation offload: the checkpointed blocks' inputs in host memory"
                     + ("" if ctx.use_cuda else " (numpy buffers outside torch's allocator: not in the CPU peak, "
                                                "counted in host_offload_peak_bytes)"))
    return mpu


def context_parallel_mesh(ctx: Context, cp: int) -> Any:
    """The cp dimension of torchtitan's ``(dp_shard, cp)`` mesh (FSDP2 still shards over every rank,
    the flattened ``dp_shard_cp``). CUDA only: on the CPU torch's ring attention has no kernel."""
    if not ctx.use_cuda:
        raise RuntimeError(CP_ON_CPU)
    if ctx.world % cp:
        raise ValueError(f"context_parallel_size must divide the ranks, but got {cp} for {ctx.world}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (ctx.world // cp, cp), mesh_dim_names=("dp_shard", "cp"))
    return mesh["cp"]


CP_ON_CPU = ("context_parallel_size > 1 needs CUDA: torch's context_parallel (ring attention) has no CPU "
             "kernel (torch 2.13: NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu."
             "default does not have a sharding strategy registered)")
"""The one-line refusal of context parallel on a CPU worker (the error torch raises, measured)."""


def torch_optimizer_of(section: dict) -> tuple[str, dict]:
    """(torch.optim class name, keyword arguments) of a DeepSpeed config's ``optimizer`` section, as
    DeepSpeed reads it (runtime/engine.py ``_configure_basic_optimizer``): adam and adamw by any
    case, Adam being AdamW unless ``adam_w_mode`` is false; another name is a torch.optim class."""
    name = str(section.get("type", "AdamW"))
    kwargs = dict(section.get("params") or {})
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    if name.lower() in ("adam", "adamw"):
        name = "AdamW" if name.lower() == "adamw" or adam_w_mode else "Adam"
    return name, kwargs


def optimizer_settings(optimizer: Any, gradient_clipping: float) -> dict:
    """What the engine trains with, read back from the optimizer it built: its class and its first
    parameter group's hyper-parameters (the result's ``optimizer_settings``)."""
    group = optimizer.param_groups[0]
    out: dict[str, Any] = {"class": type(optimizer).__name__}
    for key in ("lr", "betas", "eps", "weight_decay", "momentum"):
        if key in group:
            value = group[key]
            out[key] = [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)
    out["gradient_clipping"] = float(gradient_clipping or 0.0)
    return out


def mesh_groups(model: Any) -> list:
    """The process groups of the device meshes FSDP2 shards over (gloo flushes them)."""
    from torch.distributed.fsdp import FSDPModule

    groups: list = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()._fsdp_param_group
            if state is not None:
                groups.extend(state.mesh_info.mesh.get_all_groups())
    return groups


def _yield_after_collectives(dist: Any, names: tuple = ("all_gather_single", "reduce_scatter_single")) -> None:
    """CPU measurement only: after each of FSDP2's all-gathers and reduce-scatters (DeepSpeed: its
    all-reduces, ``names``), give gloo's
    worker thread a moment to drop its reference to the collective's buffers. gloo wakes the
    waiting thread before its worker releases the finished work, so with more runnable threads
    than cores (2 ranks x 2 threads on 2 cores) a buffer the main thread has already dropped can
    stay allocated into the next phase at random (seen: one root all-gather buffer at the start of
    backward). NCCL has no such thread; this keeps the measured peak what a GPU job holds."""
    import time

    for name in names:
        inner = getattr(dist, name, None)
        if inner is None or getattr(inner, "_autotune_yield", False):
            continue

        def call(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            out = _inner(*args, **kwargs)
            if not kwargs.get("async_op", False):
                time.sleep(0.001)
            return out

        call._autotune_yield = True  # type: ignore[attr-defined]
        setattr(dist, name, call)
