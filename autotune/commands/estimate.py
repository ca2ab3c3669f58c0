"""``autotune estimate CONFIG``: the memory breakdown, fit verdict and simulated speed of one strategy."""

from __future__ import annotations

import argparse
import json
from typing import Any

from autotune.commands._job import load_job
from autotune.config import Config, check_strategy
from autotune.errors import ConfigError
from autotune.spec import GIB
from autotune.knobs import knob_fields, literal_choices
from autotune.engine_configs import fsdp_equivalent_text
from autotune.strategy import FLAG_KNOBS, Strategy, ignored_knobs


def add_parser(sub: Any) -> None:
    p = sub.add_parser("estimate", help="memory breakdown, fit verdict and simulated speed of one strategy",
                         description="Print the per-GPU memory breakdown at the peak, the fits verdict "
                         "with reasons, the simulated step time, and the DeepSpeed config of one strategy.")
    p.add_argument("config", help="job file (YAML: model, training, hardware sections)")
    add_strategy_flags(p)
    p.add_argument("--trace", action="store_true",
                     help="take activations from a FakeTensorMode trace of the real model on the CPU (allocates "
                     "nothing; needs torch) and combine them with the analytical model states and buffers")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def add_strategy_flags(p: argparse.ArgumentParser, cls: type = Strategy) -> None:
    """One ``--flag`` per flag knob of ``cls`` (autotune.knobs.flagged), its help the field's
    ``help``; choices from the field's Literal type, else an integer."""
    g = p.add_argument_group("strategy (overrides the config's strategy: section)")
    choices_of = literal_choices(cls)
    for f in knob_fields(cls):
        if not f.metadata["flag"]:
            continue
        choices = choices_of[f.name]
        kwargs: dict[str, Any] = {"help": f.metadata["help"].replace("%", "%%")}
        if choices is None:
            kwargs.update(type=int, metavar="N")
        elif isinstance(choices[0], bool):
            kwargs.update(type=_bool, metavar="true|false")
        else:
            kwargs.update(type=type(choices[0]), choices=choices) if isinstance(choices[0], int) else \
                kwargs.update(choices=choices)
        g.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def _bool(text: str) -> bool:
    """argparse type of a true/false flag."""
    low = text.lower()
    if low not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, but got {text!r}")
    return low == "true"


def estimate_report(cfg: Config, strategy: Strategy, trace: bool = False) -> dict[str, Any]:
    """Everything ``autotune estimate --json`` prints, as one JSON-able dict."""
    from autotune.memory import estimate_memory
    from autotune.simulate import simulate
    from autotune.engine_configs import fsdp_equivalent
    from autotune.engine_configs import gradient_accumulation_steps, to_deepspeed_config, to_fsdp2_config

    provenance = None
    if trace:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ConfigError("needs torch, from the profile extra: pip install torch==2.13.0 "
                              "-e '.[profile]'", path="--trace") from None
        from autotune.trace import traced_estimate

        mem, provenance = traced_estimate(cfg, strategy)
    else:
        mem = estimate_memory(cfg.model, cfg.training, cfg.hardware, strategy, headroom=cfg.search.headroom)
    sim = simulate(cfg.model, cfg.training, cfg.hardware, strategy)
    return {
        "config": cfg.path,
        "model": cfg.model.name,
        "num_parameters": cfg.model.num_parameters,
        "gpu": cfg.hardware.gpu.name,
        "num_gpus": cfg.hardware.num_gpus,
        "strategy": strategy.as_dict(),
        "strategy_text": strategy.describe(cfg.model.num_hidden_layers),
        "gradient_accumulation_steps": gradient_accumulation_steps(strategy, cfg.training, cfg.hardware),
        "gpu_memory_bytes": dict(mem.gpu),
        "gpu_total_bytes": mem.total_gpu_bytes,
        "gpu_capacity_bytes": cfg.hardware.gpu.memory_bytes,
        "gpu_usable_bytes": int(cfg.hardware.gpu.memory_bytes * (1 - cfg.search.headroom)),
        "headroom": cfg.search.headroom,
        "peak_phase": mem.peak_phase,
        "peak_by_phase_bytes": dict(mem.phases),
        "cpu_memory_bytes": mem.cpu_bytes_per_node,
        "data_loader_fork": cfg.training.data_loader_fork,
        "nvme_bytes": mem.nvme_bytes_per_node,
        "fits": mem.fits,
        "reasons": list(mem.reasons),
        "step_time_s": sim.step_time_s,
        "tokens_per_s_per_gpu": sim.tokens_per_s_per_gpu,
        "mfu": sim.mfu,
        "time_breakdown_s": dict(sim.breakdown),
        "calibrated": sim.calibrated,
        **({"fsdp2_config": to_fsdp2_config(strategy, cfg.model, cfg.training, cfg.hardware)}
           if strategy.engine == "fsdp2" else
           {"fsdp": fsdp_equivalent(strategy, cfg.hardware),
            "deepspeed_config": to_deepspeed_config(strategy, cfg.model, cfg.training, cfg.hardware)}),
        "memory_fidelity": "traced" if trace else "analytic",
        **({"memory_provenance": provenance} if provenance else {}),
        **({"routed_load_factors": routed_load_factors(cfg.model, strategy.expert_parallel_size)}
           if strategy.expert_parallel_size > 1 else {}),
    }


def routed_load_factors(model: Any, ep: int) -> dict[str, Any]:
    """What an expert-parallel estimate assumed of the routing it cannot know: the busiest and the
    least-loaded expert's tokens and the busiest EP rank's received rows, in one dispatch and over a step's
    blocks, over their means (memory.moe.expert_imbalance, ModelSpec.moe_min_load,
    memory.expert_parallel.rank_imbalance, step_imbalance), and whether the job stated them."""
    from autotune.memory.expert_parallel import STATED_LOAD_KEYS, sized_routing

    stated = [k for k in STATED_LOAD_KEYS if getattr(model, k) is not None]
    f = sized_routing(model, ep)
    return {"busiest_expert": f.moe_load_imbalance, "least_expert": f.moe_min_load,
            "busiest_rank": f.ep_rank_imbalance, "busiest_rank_step": f.ep_step_imbalance,
            "stated": bool(stated), "stated_keys": stated}


def routed_load_line(f: dict[str, Any]) -> str:
    """The routing an expert-parallel estimate assumed, in one line."""
    from autotune.memory.expert_parallel import STATED_LOAD_KEYS, MeasuredRouting

    missing = [k for k in STATED_LOAD_KEYS if k not in f["stated_keys"]]
    how = ("as the job states them" if not missing else
           ("autotune's defaults" if not f["stated"] else "the rest autotune's defaults")
           + ": state " + ", ".join(f"model.{k}" for k in missing[:-1]) + (" and " if len(missing) > 1 else "")
           + f"model.{missing[-1]} from your model's routing on your data: an EP point's launch script "
           "measures them, docs/moe.md")
    sized = MeasuredRouting(f["busiest_expert"], f["least_expert"], f["busiest_rank"], f["busiest_rank_step"])
    return f"routed loads: {sized.describe()} ({how})"


def fsdp2_line(layout: dict[str, Any]) -> str:
    """An FSDP2 layout in one line: the mesh, and the expert / context-parallel meshes when it has them."""
    line = f"FSDP2: fully_shard per decoder layer + root, mesh {layout['mesh']['shape']}"
    ep, cp = layout.get("expert_parallel"), layout.get("context_parallel")
    if ep:
        line += (f"; expert parallel {ep['expert_parallel_size']}: {ep['local_experts']} of {ep['num_experts']} "
                 f"experts per GPU, mesh {ep['mesh']['shape']} ({' x '.join(ep['mesh']['dim_names'])}), "
                 f"{ep['dispatch']} dispatch")
    if cp:
        line += (f"; context parallel {cp['context_parallel_size']}: mesh {cp['mesh']['shape']} "
                 f"({' x '.join(cp['mesh']['dim_names'])}), ring {cp['rotate_method']}")
    return line


def format_estimate(r: dict[str, Any]) -> str:
    """The breakdown as a table whose rows add up: the components at the peak sum to the peak
    allocated; the overhead on top of it gives the memory the GPU must hold, which is what the
    verdict compares with the usable capacity."""
    from autotune.memory import GPU_COMPONENTS

    mem = r["gpu_memory_bytes"]
    total = r["gpu_total_bytes"]
    unit, scale = ("GiB", GIB) if total >= GIB / 4 else ("MiB", GIB / 1024)
    lines = [
        f"{r['model']} ({r['num_parameters']:,} parameters) on {r['num_gpus']} x {r['gpu']}",
        f"strategy: {r['strategy_text']} (gradient accumulation {r['gradient_accumulation_steps']})",
        f"FSDP equivalent: {fsdp_equivalent_text(r['fsdp'])}" if "fsdp" in r else
        fsdp2_line(r["fsdp2_config"]),
        *([routed_load_line(r["routed_load_factors"])] if "routed_load_factors" in r else []),
        "",
        f"{'component (at the peak)':<30}{unit:>10}{'share':>9}",
    ]
    for key in GPU_COMPONENTS:
        if key != "overhead":
            lines.append(f"  {key.replace('_', ' '):<28}{mem[key] / scale:>10.2f}{100 * mem[key] / total:>8.1f}%")
    lines.append(f"{'= peak allocated':<30}{mem['peak'] / scale:>10.2f}{100 * mem['peak'] / total:>8.1f}%   "
                 f"(in {r['peak_phase']}; by phase: "
                 + ", ".join(f"{k} {v / scale:.2f}" for k, v in r["peak_by_phase_bytes"].items()) + ")")
    lines.append(f"{'+ context and allocator':<30}{mem['overhead'] / scale:>10.2f}{100 * mem['overhead'] / total:>8.1f}%")
    lines.append(f"{'= GPU memory needed':<30}{total / scale:>10.2f}")
    lines.append(f"{'usable of the GPU':<30}{r['gpu_usable_bytes'] / scale:>10.2f}   "
                 f"({r['gpu_capacity_bytes'] / scale:.2f} {unit} less {100 * r['headroom']:g}% headroom)")
    if r["cpu_memory_bytes"]:
        s = r["strategy"]
        lower = s["engine"] == "deepspeed" and s["offload_optimizer"] == "cpu"
        lines.append(f"{'CPU RAM / node':<18}{r['cpu_memory_bytes'] / scale:>10.2f}"
                     + ("   (tensor bytes: a lower bound under ZeRO optimizer offload, docs/long-context.md)"
                        if lower else ""))
        lines.append(f"  with training.data_loader_fork: {r['data_loader_fork']} (a data loader's workers forked "
                     "after the engine is built keep a copy of the host partitions; docs/config.md)")
    if r["nvme_bytes"]:
        lines.append(f"{'NVMe / node':<18}{r['nvme_bytes'] / scale:>10.2f}")
    if r.get("memory_provenance"):
        prov = r["memory_provenance"]
        lines.append(f"memory sources: traced ({', '.join(prov.get('traced', {}))}); "
                     f"analytic ({', '.join(k for k in prov.get('analytic', {}) if k in GPU_COMPONENTS)})")
    lines.append("")
    lines.append("verdict: FITS" if r["fits"] else "verdict: DOES NOT FIT")
    lines.extend(f"  - {reason}" for reason in r["reasons"])
    lines.append("")
    cal = "" if r["calibrated"] else "  [uncalibrated GPU: datasheet defaults]"
    lines.append(f"step time {r['step_time_s']:.3f} s, {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                 f"MFU {100 * r['mfu']:.1f}%{cal}")
    lines.append("  " + ", ".join(f"{k} {v:.3f} s" for k, v in r["time_breakdown_s"].items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = load_job(args.config)
    overrides = {k: getattr(args, k) for k in FLAG_KNOBS if getattr(args, k) is not None}
    strategy = cfg.strategy.replace(**overrides)
    for key, message in ignored_knobs(overrides, strategy):
        raise ConfigError(message, file=args.config, path="--" + key.replace("_", "-"))
    try:
        check_strategy(strategy, cfg.model, cfg.training, cfg.hardware)
    except ConfigError as err:
        flag = "--" + (err.path or "").replace("_", "-")
        raise ConfigError(err.message, file=args.config, path=flag if err.path in overrides else f"strategy.{err.path}")
    report = estimate_report(cfg, strategy, trace=args.trace)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_estimate(report))
    return 0
