"""An fsdp2 strategy applied to a model: ``apply(model, strategy)`` and a ready-to-paste ``snippet``.

``apply`` and ``make_optimizer`` are what the profiling worker runs for an fsdp2 trial and what a
front point ships, so a point reproduces exactly as it was measured::

    import autotune
    from autotune.models.fsdp2 import make_optimizer
    layout = autotune.engine_configs.to_fsdp2_config(strategy, model_spec, training, hardware)
    notes = autotune.apply(model, layout)          # or a Strategy (then no optimizer settings)
    optimizer = make_optimizer(model, layout)      # the job's optimizer (training.optimizer), foreach

The layout follows torchtitan (torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``): the
activation checkpointing first, then ``fully_shard`` on every decoder block, then on the root
module, all with one ``MixedPrecisionPolicy`` (and ``CPUOffloadPolicy`` when the parameters are
offloaded) over a 1-D mesh, or for hybrid sharding a 2-D ``(replicate, shard)`` mesh (replicate
across nodes, shard within a node).

torch is imported only inside the functions (the simulate path never imports it).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

from autotune.models.checkpointing import SUBMODULE_NAMES
from autotune.strategy import Strategy
from autotune.engine_configs import TORCH_DTYPES

StrategyOrConfig = Union[Strategy, Mapping[str, Any]]
"""A fsdp2 Strategy, or the JSON layout ``to_fsdp2_config`` makes of one."""


def _layout(strategy_or_config: StrategyOrConfig, num_blocks: int) -> dict[str, Any]:
    """The parts of the layout ``apply`` needs, from a Strategy or a to_fsdp2_config dict."""
    if isinstance(strategy_or_config, Strategy):
        s = strategy_or_config
        if s.engine != "fsdp2":
            raise ValueError(f"autotune.models.fsdp2.apply needs engine fsdp2, but got engine {s.engine}")
        blocks = s.checkpointed_blocks(num_blocks)
        return {"granularity": s.checkpointing if blocks else "none", "blocks": blocks,
                "reshard_after_forward": s.reshard_after_forward, "hybrid": s.sharding == "hybrid",
                "mesh_shape": None, "param_dtype": TORCH_DTYPES[s.precision],
                "reduce_dtype": TORCH_DTYPES[s.reduce_dtype], "offload": s.offload_params == "cpu",
                "pin_memory": s.pin_memory, "ep": s.expert_parallel_size}
    cfg = strategy_or_config
    if cfg.get("engine") != "fsdp2":
        raise ValueError(f"autotune.models.fsdp2.apply needs an fsdp2 layout (to_fsdp2_config), but got engine "
                         f"{cfg.get('engine')!r}")
    ckpt = cfg.get("activation_checkpointing") or {}
    blocks = list(ckpt.get("blocks") or [])
    return {"granularity": ckpt.get("granularity", "none") if blocks else "none", "blocks": blocks,
            "reshard_after_forward": bool(cfg["fully_shard"]["reshard_after_forward"]),
            "hybrid": len(cfg["mesh"]["shape"]) == 2, "mesh_shape": list(cfg["mesh"]["shape"]),
            "param_dtype": cfg["mp_policy"]["param_dtype"], "reduce_dtype": cfg["mp_policy"]["reduce_dtype"],
            "offload": cfg.get("offload_policy") == "CPUOffloadPolicy",
            "pin_memory": cfg.get("offload_pin_memory") is not False,
            "ep": int((cfg.get("expert_parallel") or {}).get("expert_parallel_size", 1))}


def make_mesh(hybrid: bool, shape: Optional[list[int]] = None, device_type: Optional[str] = None) -> Any:
    """The device mesh of the process group: 1-D ``("shard",)`` over every rank, or hybrid a 2-D
    ``("replicate", "shard")`` mesh of (nodes, ranks per node). ``shape``: the layout's mesh shape,
    used when it matches the group's size; otherwise the nodes are counted from LOCAL_WORLD_SIZE
    (torchrun's ranks per node)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not hybrid:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if shape and len(shape) == 2 and shape[0] * shape[1] == world:
        dims = (int(shape[0]), int(shape[1]))
    else:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if per_node < 1 or world % per_node:
            raise ValueError(f"hybrid sharding needs the world size ({world}) to be a multiple of the ranks per "
                             f"node (LOCAL_WORLD_SIZE {per_node})")
        dims = (world // per_node, per_node)
    return init_device_mesh(device_type, dims, mesh_dim_names=("replicate", "shard"))


def apply(model: Any, strategy_or_config: StrategyOrConfig, mesh: Any = None) -> list[str]:
    """Apply an fsdp2 strategy (a Strategy or a ``to_fsdp2_config`` dict) to ``model`` in place;
    returns notes on how it was applied. Needs an initialised default process group.

    1. activation checkpointing (``autotune.models.checkpointing.apply_checkpointing``) of the strategy's
       blocks at its granularity, before sharding (as torchtitan does: the checkpoint wraps the
       block's forward, FSDP's hooks run inside it, so a recomputed block all-gathers again);
    2. ``fully_shard`` on each decoder block (``autotune.models.checkpointing.blocks_of``: the longest
       ``nn.ModuleList``) with the strategy's ``reshard_after_forward``. Every block keeps that
       value: unlike torchtitan, the last block is *not* set to ``reshard_after_forward=False``
       (torchtitan does it because backward needs the last block's parameters at once); the
       measured and predicted memory then describe exactly the strategy's one knob;
    3. ``fully_shard`` on the root with ``reshard_after_forward=True`` (embeddings, final norm and
       head; torchtitan's value without pipeline parallelism).

    All with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (the sharded parameters stay
    fp32), ``CPUOffloadPolicy()`` when ``offload_params == "cpu"`` (pinned on CUDA, unpinned on a CPU mesh), and ``mesh`` (None:
    ``make_mesh``, a 1-D mesh over every rank or the hybrid 2-D mesh).
    """
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from autotune.models.checkpointing import apply_checkpointing, blocks_of

    blocks = list(blocks_of(model))
    lay = _layout(strategy_or_config, len(blocks))
    notes = apply_checkpointing(model, lay["granularity"], lay["blocks"]) if lay["granularity"] != "none" else []
    experts_mesh = ep_group = None
    if lay["ep"] > 1:  # torchtitan's ep mesh; the dense parts shard over its flattened dp_shard_cp
        world = make_ep_mesh(lay["hybrid"], lay["ep"], lay["mesh_shape"])
        rep = ("dp_replicate",) if lay["hybrid"] else ()
        mesh, experts_mesh = world[rep + ("dp_shard_cp",)], world[rep + ("dp_shard_mod_ep",)]
        ep_group = world["dp_shard_in_ep"].get_group()
    if mesh is None:
        mesh = make_mesh(lay["hybrid"], lay["mesh_shape"])
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(
        param_dtype=getattr(torch, lay["param_dtype"]), reduce_dtype=getattr(torch, lay["reduce_dtype"]))}
    if lay["offload"]:  # pinned host memory needs an accelerator (a CPU-only torch refuses to pin)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=lay["pin_memory"] and mesh.device_type == "cuda")
    n_experts = 0
    for block in blocks:
        if ep_group is not None:
            n_experts += _shard_experts(block, ep_group, experts_mesh, lay, kwargs)
        fully_shard(block, reshard_after_forward=lay["reshard_after_forward"], **kwargs)
    fully_shard(model, reshard_after_forward=True, **kwargs)
    notes.append(f"fully_shard on {len(blocks)} blocks (reshard_after_forward={lay['reshard_after_forward']}) and the "
                 f"root, mesh {tuple(mesh.shape)}, param {lay['param_dtype']}, reduce {lay['reduce_dtype']}"
                 + (", CPUOffloadPolicy" if lay["offload"] else ""))
    if ep_group is not None:
        if not n_experts:
            raise ValueError("expert_parallel_size > 1 needs routed-experts modules (gate_up_proj / down_proj of "
                             "[num_experts, ...]: a transformers 5 MoE model), but the model has none")
        notes.append(f"expert parallel {lay['ep']}: {n_experts} experts modules split on dim 0, all_to_all_single "
                     f"dispatch / combine, fully_shard over mesh {tuple(experts_mesh.shape)}")
    return notes


def make_ep_mesh(hybrid: bool, ep: int, shape: Optional[list[int]] = None, device_type: Optional[str] = None) -> Any:
    """torchtitan's mesh with expert parallelism (torchtitan/distributed/parallel_dims.py
    ``_build_mesh_with_ep``): ``(dp_replicate,) dp_shard_mod_ep x dp_shard_in_ep``, the last two also
    flattened to ``dp_shard_cp``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    nodes = 1
    if hybrid:  # as make_mesh counts them: the layout's mesh, or torchrun's ranks per node
        fits = shape and len(shape) == 2 and shape[0] * shape[1] == world
        nodes = int(shape[0]) if fits else world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if (world // nodes) % ep:
        raise ValueError(f"expert_parallel_size {ep} must divide the ranks FSDP shards over ({world // nodes})")
    dims, names = (world // nodes // ep, ep), ("dp_shard_mod_ep", "dp_shard_in_ep")
    if hybrid:
        dims, names = (nodes, *dims), ("dp_replicate", *names)
    mesh = init_device_mesh(device_type, dims, mesh_dim_names=names)
    mesh[("dp_shard_mod_ep", "dp_shard_in_ep")]._flatten(mesh_dim_name="dp_shard_cp")
    return mesh


def _shard_experts(block: Any, ep_group: Any, experts_mesh: Any, lay: Mapping[str, Any], kwargs: dict) -> int:
    """A block's experts split over ep, then fully_shard over GPUs / ep (their dim 1 when those
    ranks outnumber the local experts), gradients divided by every data-parallel rank
    (torchtitan/models/llama4/infra/parallelize.py apply_fsdp)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from autotune.models.expert_parallel import expert_parallel, experts_modules

    found = experts_modules(block)
    for experts in found:
        expert_parallel(experts, ep_group)
        dim = 1 if experts_mesh.size() > experts.gate_up_proj.shape[0] else 0
        fully_shard(experts, reshard_after_forward=lay["reshard_after_forward"],
                    shard_placement_fn=lambda param, dim=dim: Shard(dim), **{**kwargs, "mesh": experts_mesh})
        experts.set_gradient_divide_factor(dist.get_world_size())
    return len(found)


# ------------------------------------------------------------------------------------ snippet

def _checkpointing_source(name: str) -> str:
    """The source of a function of autotune.models.checkpointing (``op_sac_context``: torchtitan's op-level
    policy; ``checkpoint_attention_core``: HF selective), as the profiler applied it, for the
    snippet, so the two cannot drift."""
    import inspect
    import textwrap

    from autotune.models import checkpointing

    return "\n\n" + textwrap.dedent(inspect.getsource(getattr(checkpointing, name)))


_WRAP = '''

def checkpoint_forward(module, **extra):
    """Recompute ``module`` in backward (non-reentrant torch.utils.checkpoint around its forward)."""
    inner = module.forward
    module.forward = lambda *a, **kw: checkpoint(inner, *a, use_reentrant=False, **extra, **kw)
'''

def _checkpoint_lines(granularity: str, blocks: list[int]) -> tuple[str, list[str]]:
    """Helper definitions and the per-block lines (inside ``for i, block in enumerate(blocks):``)."""
    if granularity == "none" or not blocks:
        return "", []
    lines = [f"        if i in CHECKPOINTED:  # {granularity} activation checkpointing"]
    if granularity == "full":
        return _WRAP, lines + ["            checkpoint_forward(block)"]
    if granularity == "op":
        return _WRAP + _checkpointing_source("op_sac_context"), lines + ["            checkpoint_forward(block, context_fn=op_sac_context)"]
    if granularity in SUBMODULE_NAMES:
        names = SUBMODULE_NAMES[granularity]
        return _WRAP, lines + [f"            sub = next(getattr(block, n) for n in {names!r} if hasattr(block, n))",
                               "            checkpoint_forward(sub)"]
    # selective (attention core only): before the loop, the model's set_checkpointing or, for a
    # Hugging Face model, its attention function checkpointed through AttentionInterface
    return _checkpointing_source("checkpoint_attention_core"), []


_OPTIMIZER_CLASSES = ("AdamW", "Adam", "SGD")
"""The torch.optim classes a layout's optimizer may name (autotune.spec.OptimizerSpec.torch_class)."""


def _optimizer_block(config: Mapping[str, Any]) -> tuple[str, dict[str, Any], bool]:
    """(torch.optim class name, its keyword arguments, foreach) of a layout's ``optimizer`` entry,
    checked: the snippet writes them out as code."""
    opt = config["optimizer"]
    name, params = opt["type"], dict(opt["params"])
    if name not in _OPTIMIZER_CLASSES:
        raise ValueError(f"layout optimizer type must be one of {', '.join(_OPTIMIZER_CLASSES)}, but got {name!r}")
    for key, value in params.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if not key.isidentifier() or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"layout optimizer parameter {key!r} must be a number or a list of numbers")
        params[key] = tuple(value) if isinstance(value, (list, tuple)) else value
    return name, params, bool(opt.get("foreach", True))


def make_optimizer(model: Any, config: Mapping[str, Any]) -> Any:
    """The optimizer of a ``to_fsdp2_config`` layout (the job's ``training.optimizer``: class and
    hyper-parameters, ``foreach=True``) over ``model``'s (sharded) parameters."""
    import torch

    name, params, foreach = _optimizer_block(config)
    return getattr(torch.optim, name)(model.parameters(), **params, foreach=foreach)


def snippet(config: Mapping[str, Any]) -> str:
    """A self-contained Python snippet (plain torch; no autotune import) that builds the layout of
    ``config`` (a ``to_fsdp2_config`` dict): device mesh, activation checkpointing (``op``: torchtitan's
    policy inlined), ``fully_shard`` per block and on the root, the job's optimizer (``foreach=True``)
    and one training step with gradient accumulation, clipping (unless 0) and (fp16) a ShardedGradScaler.
    ``selective`` (attention core): the model's own ``set_checkpointing`` (autotune's reference
    decoders have one), otherwise (a Hugging Face model) ``checkpoint_attention_core`` inlined.

    A context-parallel layout (``context_parallel``) builds torchtitan's device mesh (``dp_shard x cp``,
    ``fully_shard`` over the flattened ``dp_shard_cp``) and runs each micro-batch in torch's
    ``context_parallel`` (_context_parallel_text); tiling and activation offload (``long_context``)
    call ``autotune.models.long_context`` (the only autotune import, and only then). An expert-parallel
    layout (``expert_parallel``) builds torchtitan's ``dp_shard_mod_ep x dp_shard_in_ep`` mesh and, per
    block, splits the experts over ep (autotune.models.expert_parallel inlined) and shards them over
    dp_shard_mod_ep before the block's fully_shard."""
    lay = _layout(config, 0)
    cp = config.get("context_parallel")
    ep = config.get("expert_parallel")
    lc = dict(config.get("long_context") or {})
    opt_cls, opt_params, foreach = _optimizer_block(config)
    args = [f"{k}={v!r}" for k, v in opt_params.items()] + [f"foreach={foreach!r}"]
    opt_args = ", ".join(args[:3]) + "".join(f",\n{' ' * 31}" + ", ".join(args[3:]) if args[3:] else "")
    gas = int(config["gradient_accumulation_steps"])
    helpers, ckpt = _checkpoint_lines(lay["granularity"], lay["blocks"])
    shape = tuple(int(x) for x in config["mesh"]["shape"])
    names = tuple(config["mesh"]["dim_names"])
    pin = "device_type == \"cuda\"" if lay["pin_memory"] else "False"
    offload = f", offload_policy=CPUOffloadPolicy(pin_memory={pin})" if lay["offload"] else ""
    selective = lay["granularity"] == "selective"
    text = f'''"""FSDP2 layout found by autotune. Launch: torchrun --nnodes {shape[0] if len(shape) == 2 else 1} \\
    --nproc_per_node {shape[-1]} train.py ...; call shard(model) after building the model (fp32
    parameters) and use train_step with {gas} micro-batch(es) of {config["micro_batch_size"]} sequence(s).
Layout (autotune.engine_configs.to_fsdp2_config): {json.dumps(dict(config), sort_keys=True)}
"""
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
{_long_context_imports(cp, lc)}{"from torch.distributed.tensor import Shard" + chr(10) if ep else ""}
MESH_SHAPE = {shape!r}
MESH_DIM_NAMES = {names!r}
{_context_parallel_constants(cp)}{_expert_parallel_constants(ep)}CHECKPOINTED = {sorted(lay["blocks"])!r}  # block indices, granularity {lay["granularity"]!r}
RESHARD_AFTER_FORWARD = {lay["reshard_after_forward"]!r}
GRADIENT_ACCUMULATION_STEPS = {gas}
{helpers}{_context_parallel_text() if cp else ""}{_expert_parallel_text() if ep else ""}

def shard(model, blocks=None):
    """Checkpoint, then fully_shard every decoder block and the root; returns the optimizer."""
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
{_expert_parallel_mesh_lines() if ep else _mesh_lines(cp)}
    if blocks is None:  # the decoder blocks: the model's longest nn.ModuleList
        blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
'''
    if lc.get("tiled_mlp"):
        text += "    tile_mlp(model)  # every decoder MLP over sequence tiles (DeepSpeed TiledMLP)\n"
    if lc.get("tiled_loss"):
        text += ("    use_long_context_loss(model, tiled=True, gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS)"
                 "  # model(**batch).loss from logits in sequence tiles (TiledFusedLogitsLoss)\n")
    if selective:
        text += f'''    if hasattr(model, "set_checkpointing"):  # attention core recomputed (autotune's reference decoders)
        model.set_checkpointing("selective", CHECKPOINTED)
    else:  # a Hugging Face model: its attention function checkpointed through AttentionInterface
        names = {SUBMODULE_NAMES["attention"]!r}
        checkpoint_attention_core(model, [next(getattr(blocks[i], n) for n in names if hasattr(blocks[i], n))
                                          for i in CHECKPOINTED])
'''
    text += f'''    mp = MixedPrecisionPolicy(param_dtype=torch.{lay["param_dtype"]}, reduce_dtype=torch.{lay["reduce_dtype"]})
    for i, block in enumerate(blocks):
{chr(10).join(ckpt) + chr(10) if ckpt else "" if ep else "        pass" + chr(10)}\
{_expert_parallel_block_lines(offload) if ep else ""}        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=RESHARD_AFTER_FORWARD{offload})
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True{offload})
    return torch.optim.{opt_cls}(model.parameters(), {opt_args})

'''
    return text + _train_step_text(bool(config.get("loss_scaling")), float(config["gradient_clipping"]),
                                   context_parallel=bool(cp), offload=lc.get("activation_offload", "none") != "none",
                                   expert_parallel=bool(ep), pin_memory=lay["pin_memory"])


def _long_context_imports(cp: Optional[Mapping[str, Any]], lc: Mapping[str, Any]) -> str:
    """The snippet's extra imports: torch's context parallel, autotune's long-context calls."""
    lines = []
    if cp:
        lines += ["from torch.distributed.tensor.experimental import context_parallel",
                  "from torch.distributed.tensor.experimental._attention import set_rotate_method"]
    names = [n for n, on in (("offload_activations", lc.get("activation_offload", "none") != "none"),
                             ("tile_mlp", lc.get("tiled_mlp")), ("use_long_context_loss", lc.get("tiled_loss"))) if on]
    if names:
        lines.append(f"from autotune.models.long_context import {', '.join(names)}")
    return "\n".join(lines) + "\n" if lines else ""


def _context_parallel_constants(cp: Optional[Mapping[str, Any]]) -> str:
    """The context-parallel mesh of the layout (torchtitan's dims) and the dims FSDP shards over."""
    if not cp:
        return ""
    return (f"CP_MESH_SHAPE = {tuple(int(x) for x in cp['mesh']['shape'])!r}  # torchtitan's world mesh\n"
            f"CP_MESH_DIM_NAMES = {tuple(cp['mesh']['dim_names'])!r}\n"
            f"FULLY_SHARD_MESH_DIMS = {tuple(cp['fully_shard_mesh'])!r}  # flattened dp_shard x cp: every rank "
            "of a replica\n"
            f"ROTATE_METHOD = {cp.get('rotate_method', 'allgather')!r}  # ring attention's key/value exchange\n"
            "CP_MESH = None  # the cp dimension, set by shard()\n")


def _expert_parallel_constants(ep: Optional[Mapping[str, Any]]) -> str:
    """The expert-parallel mesh of the layout (torchtitan's dims) and the dims each part shards over."""
    if not ep:
        return ""
    return (f"EP_MESH_SHAPE = {tuple(int(x) for x in ep['mesh']['shape'])!r}  # torchtitan's world mesh with ep\n"
            f"EP_MESH_DIM_NAMES = {tuple(ep['mesh']['dim_names'])!r}\n"
            f"FULLY_SHARD_MESH_DIMS = {tuple(ep['fully_shard_mesh'])!r}  # dense parts: every rank of a replica\n"
            f"EXPERTS_MESH_DIMS = {tuple(ep['experts_fully_shard_mesh'])!r}  # the experts: GPUs / ep\n"
            f"EXPERTS_SHARD_DIM = {int(ep['experts_shard_dim'])}\n"
            f"GRADIENT_DIVIDE_FACTOR = {int(ep['gradient_divide_factor'])}  # every data-parallel rank\n"
            "EP_MESH = EXPERTS_MESH = None  # set by shard()\n")


def _expert_parallel_text() -> str:
    """The snippet's expert-parallel helpers: autotune.models.expert_parallel's source, inlined."""
    import inspect

    from autotune.models import expert_parallel as module

    return "\n\n" + "\n\n".join(inspect.getsource(f) for f in (module.experts_modules, module.expert_parallel,
                                                                module.clip_grad_norm))


def _expert_parallel_mesh_lines() -> str:
    """shard()'s meshes with expert parallelism (torchtitan/distributed/parallel_dims.py
    ``_build_mesh_with_ep``): dp_shard_mod_ep x dp_shard_in_ep flattened to dp_shard_cp for the dense
    parts, dp_shard_mod_ep for the experts, dp_shard_in_ep for the all-to-alls."""
    return '''    global EP_MESH, EXPERTS_MESH
    world = init_device_mesh(device_type, EP_MESH_SHAPE, mesh_dim_names=EP_MESH_DIM_NAMES)
    world[("dp_shard_mod_ep", "dp_shard_in_ep")]._flatten(mesh_dim_name="dp_shard_cp")  # torchtitan parallel_dims.py
    mesh = world[FULLY_SHARD_MESH_DIMS]
    EXPERTS_MESH = world[EXPERTS_MESH_DIMS]
    EP_MESH = world["dp_shard_in_ep"]'''


def _expert_parallel_block_lines(offload: str) -> str:
    """Per block, before its fully_shard: its experts split over ep, then sharded over
    dp_shard_mod_ep (torchtitan/models/llama4/infra/parallelize.py apply_fsdp)."""
    return (f'''        for experts in experts_modules(block):  # this rank's experts, then FSDP over GPUs / ep
            expert_parallel(experts, EP_MESH.get_group())
            fully_shard(experts, mesh=EXPERTS_MESH, mp_policy=mp, reshard_after_forward=RESHARD_AFTER_FORWARD{offload},
                        shard_placement_fn=lambda param: Shard(EXPERTS_SHARD_DIM))
            experts.set_gradient_divide_factor(GRADIENT_DIVIDE_FACTOR)
''')


def _mesh_lines(cp: Optional[Mapping[str, Any]]) -> str:
    """shard()'s mesh: the layout's (1-D or hybrid 2-D), or torchtitan's context-parallel mesh with
    ``dp_shard x cp`` flattened for fully_shard (torchtitan/distributed/parallel_dims.py)."""
    if not cp:
        return "    mesh = init_device_mesh(device_type, MESH_SHAPE, mesh_dim_names=MESH_DIM_NAMES)"
    return '''    global CP_MESH
    world = init_device_mesh(device_type, CP_MESH_SHAPE, mesh_dim_names=CP_MESH_DIM_NAMES)
    world[("dp_shard", "cp")]._flatten(mesh_dim_name="dp_shard_cp")  # torchtitan parallel_dims.py
    mesh = world[FULLY_SHARD_MESH_DIMS]
    CP_MESH = world["cp"]
    set_rotate_method(ROTATE_METHOD)
    drop_attention_masks(model)'''


def _context_parallel_text() -> str:
    """The snippet's context-parallel helpers: the HF attention-mask hook and the per-micro-batch
    context (torchtitan train.py ``forward_backward_step``; HF Trainer
    ``_prepare_context_parallel_inputs`` for a Hugging Face model's batch)."""
    return '''

def drop_attention_masks(model):
    """Ring attention takes no mask: every ``self_attn`` drops the (causal) mask a Hugging Face model
    builds and runs is_causal (accelerate big_modeling.py ``_attach_context_parallel_hooks``)."""
    def hook(module, args, kwargs):
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
            kwargs["is_causal"] = True
        return args, kwargs

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def context_parallel_batch(model, batch):
    """torch's context parallel around one micro-batch (forward and backward inside it): every
    (batch, seq) tensor of ``batch`` split along dim 1 over the cp ranks (head-tail load balanced),
    sdpa replaced by ring attention. A Hugging Face causal LM first gets pre-shifted
    ``shift_labels`` and explicit ``position_ids`` (a shard can shift neither); a model that
    computes positions from its input length needs them passed the same way."""
    ids = batch["input_ids"]
    if getattr(model, "config", None) is not None:
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
        if "labels" in batch and "shift_labels" not in batch:
            batch["shift_labels"] = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    buffers = [v for v in batch.values() if torch.is_tensor(v) and v.shape[:2] == ids.shape[:2]]
    return context_parallel(CP_MESH, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                            no_restore_buffers=set(buffers))
'''


def _train_step_text(scaler: bool, clip: float, context_parallel: bool = False, offload: bool = False,
                     expert_parallel: bool = False, pin_memory: bool = True) -> str:
    """The snippet's ``train_step``: gradient accumulation, clipping (``clip`` 0: none), the step
    (fp16: a ShardedGradScaler); ``context_parallel``: each micro-batch inside
    ``context_parallel_batch``; ``offload``: its forward inside ``offload_activations``."""
    clip_call = "clip_grad_norm(model, " if expert_parallel else "torch.nn.utils.clip_grad_norm_(model.parameters(), "
    clip_line = (f"    {clip_call}{clip!r})\n" if clip > 0 else "    # no gradient clipping (gradient_clipping 0)\n")
    text = ""
    if scaler:
        text += ("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n\n"
                 "scaler = ShardedGradScaler(device=\"cuda\" if torch.cuda.is_available() else \"cpu\")  # fp16: dynamic "
                 "loss scaling\n\n")
    forward = ['loss = model(**batch)["loss"] / GRADIENT_ACCUMULATION_STEPS']
    if offload:  # only the forward: what it saves carries its own unpack hook into backward
        forward = [f"with offload_activations({'' if pin_memory else 'pin_memory=False'}):  # checkpointed block "
                   "inputs kept in host memory",
                   "    " + forward[0]]
    step = forward + ["scaler.scale(loss).backward()" if scaler else "loss.backward()"]
    if context_parallel:  # forward and backward inside the context (torchtitan train.py)
        step = ["with context_parallel_batch(model, batch):"] + ["    " + line for line in step]
    body = "".join(f"        {line}\n" for line in step)
    text += f'''
def train_step(model, optimizer, micro_batches):
    """One optimizer step over GRADIENT_ACCUMULATION_STEPS micro-batches (dicts of model kwargs);
    gradients are reduce-scattered every micro-step (as torchtitan does)."""
    for batch in micro_batches:
{body}'''
    if scaler:
        return text + f'''    scaler.unscale_(optimizer)
{clip_line}    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
'''
    return text + f'''{clip_line}    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''
