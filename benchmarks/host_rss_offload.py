"""Host memory of DeepSpeed ZeRO-3 with ``offload_optimizer: cpu`` (DeepSpeedCPUAdam), as the process's
resident set sees it, against the memory model's tensor bytes: is there host memory per parameter
beyond the tensors (issue 24: the ALST recipes ran out of host RAM where the model counts less,
docs/long-context.md "Where the recipes ran out of memory")?

    python benchmarks/host_rss_offload.py                 # two model sizes, one process each, CPU accelerator
    python benchmarks/host_rss_offload.py --dl-workers 1  # with a data-loader worker forked after init
    python benchmarks/host_rss_offload.py --device cuda   # on a GPU: the "GPU" partitions on the device

Each size runs in its own process: the reference decoder (bf16, a short sequence so activations are
small), ``deepspeed.initialize`` with the config autotune writes for ZeRO-3 + optimizer offload, and
``--steps`` optimizer steps. Read from /proc/self/status after each phase: VmRSS and VmHWM (peak). On
the CPU accelerator the "GPU" partitions live in host memory too, so the model's figure compared is
its GPU peak plus its host bytes (``estimate_memory(..., device="cpu")``). The slope between the two
sizes (bytes per parameter) cancels the process's fixed memory (libraries, the op builds).
RSS misses short peaks (NOTES: not tensor ground truth); what this reads is the memory that stays.
With ``--dl-workers N`` a torch DataLoader with N worker processes (persistent) is first iterated right
after ``deepspeed.initialize``, as ArcticTraining's Ulysses adapter does; the summed PSS of the process
and its workers then counts the pages a worker keeps when the trainer rewrites them (copy-on-write),
which the trainer's own RSS cannot show (``TrainingSpec.data_loader_fork``). Measured (``--steps 3``):
20.7 B per parameter without a worker, 33.8 B with one. Last, the process's own host memory: its RSS
after the last step less the model's host bytes, at each size and where the line through both meets
zero parameters (the interpreter, torch, DeepSpeed; on CUDA also the CUDA context's host side and the
libraries' kernels), which ``fits`` does not count (docs/long-context.md, host RAM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Optional, Sequence

SIZES = {"small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8),
         "large": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=12)}
"""Two reference decoders (0.17 B and 0.44 B parameters, vocabulary 32000)."""


def _pss(pid: int) -> int:
    """Proportional set size of one process (bytes; /proc/PID/smaps_rollup): summed over processes
    that share pages it counts each physical page once."""
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _status() -> dict[str, int]:
    """This process's VmRSS / VmHWM, and ``tree_pss``: the PSS of it and its children (data-loader
    workers), the physical memory they hold together."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    me = os.getpid()
    kids = []
    for task in os.listdir(f"/proc/{me}/task"):
        with open(f"/proc/{me}/task/{task}/children") as fh:
            kids += [int(x) for x in fh.read().split()]
    out["tree_pss"] = _pss(me) + sum(_pss(k) for k in kids)
    out["children"] = len(kids)
    return out


def child(size: str, steps: int, dl_workers: int = 0, device: str = "cpu") -> dict:
    """One size in this process (run by main in a subprocess)."""
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from autotune.worker.dist_env import one_process_env

    one_process_env()
    import deepspeed

    from autotune.engine_configs import to_deepspeed_config
    from autotune.memory import estimate_memory
    from autotune.models.reference import build_model, count_parameters, synthetic_batch
    from autotune.presets import gpu_from_name
    from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
    from autotune.strategy import Strategy

    spec = ModelSpec(name=f"rss-{size}", num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                     **SIZES[size])
    training = TrainingSpec(seq_len=64, global_batch_size=1, precision="bf16")
    hardware = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=1, cpu_memory_gib=64)  # sizes only
    strategy = Strategy(zero_stage=3, offload_optimizer="cpu", precision="bf16")
    est = estimate_memory(spec, training, hardware, strategy, device=device)
    base = _status()
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    model = build_model(spec)
    built = count_parameters(model)  # before ZeRO-3 partitions the module's parameters
    config = to_deepspeed_config(strategy, spec, training, hardware)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x_host, y_host = synthetic_batch(spec, 1, training.seq_len)
    x, y = x_host.to(engine.device), y_host.to(engine.device)
    batches = None
    if dl_workers:
        # ArcticTraining's loader (arctic_training/data/factory.py create_dataloader: num_workers
        # dl_num_workers, persistent_workers) is first iterated after deepspeed.initialize
        # (UlyssesSPDataLoaderAdapter.__init__: ``self.iter = iter(dl)``): its workers fork then
        import torch

        data = torch.utils.data.TensorDataset(x_host.repeat(steps, 1), y_host.repeat(steps, 1))
        batches = iter(torch.utils.data.DataLoader(data, batch_size=1, num_workers=dl_workers,
                                                   persistent_workers=True))
    after_init = _status()
    per_step = []
    for step in range(steps):
        if batches is not None:
            x, y = (t.to(engine.device) for t in next(batches))
        loss = engine(x, y)["loss"]  # the reference decoder returns its loss and logits
        engine.backward(loss)
        engine.step()
        per_step.append(_status())
    return {"size": size, "parameters": spec.num_parameters, "built_parameters": built,
            "predicted_tensor_bytes": int(est.gpu["peak"] + est.cpu_bytes_per_node),
            "predicted_host_bytes": int(est.cpu_bytes_per_node), "base": base, "after_init": after_init,
            "steps": per_step}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per size (default 3)")
    ap.add_argument("--dl-workers", type=int, default=0,
                    help="data-loader worker processes, forked after deepspeed.initialize (default 0)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: DeepSpeed's CPU accelerator (default); cuda: the first GPU, NCCL")
    ap.add_argument("--child", choices=sorted(SIZES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.dl_workers, args.device)))
        return 0
    results = {}
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    for size in SIZES:
        proc = subprocess.run([sys.executable, __file__, "--child", size, "--steps", str(args.steps),
                               "--dl-workers", str(args.dl_workers), "--device", args.device],
                              capture_output=True, text=True, timeout=1800, env=env)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(f"{size}: failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
            return 1
        results[size] = json.loads(line[0][7:])
    gib = float(1 << 30)
    print(f"{'size':<7}{'params':>14}{'model tensors GiB':>19}{'RSS after init':>16}{'RSS after steps':>17}"
          f"{'peak RSS':>10}")
    for r in results.values():
        last = r["steps"][-1]
        print(f"{r['size']:<7}{r['parameters']:>14,}{r['predicted_tensor_bytes'] / gib:>19.2f}"
              f"{r['after_init']['VmRSS'] / gib:>16.2f}{last['VmRSS'] / gib:>17.2f}{last['VmHWM'] / gib:>10.2f}")
    s, b = results["small"], results["large"]
    dn = b["parameters"] - s["parameters"]

    def slope(get) -> float:
        return (get(b) - get(s)) / dn

    print(f"per parameter (large - small, {dn:,} parameters): model tensors "
          f"{slope(lambda r: r['predicted_tensor_bytes']):.1f} B; RSS after init "
          f"{slope(lambda r: r['after_init']['VmRSS']):.1f} B; RSS after the last step "
          f"{slope(lambda r: r['steps'][-1]['VmRSS']):.1f} B; peak RSS "
          f"{slope(lambda r: r['steps'][-1]['VmHWM']):.1f} B; PSS of the process and its workers after init "
          f"{slope(lambda r: r['after_init']['tree_pss']):.1f} B, after the last step "
          f"{slope(lambda r: r['steps'][-1]['tree_pss']):.1f} B")
    for i in range(len(s["steps"])):
        print(f"  after step {i + 1}: RSS {slope(lambda r: r['steps'][i]['VmRSS']):.1f} B/param, peak "
              f"{slope(lambda r: r['steps'][i]['VmHWM']):.1f} B/param, PSS with workers "
              f"{slope(lambda r: r['steps'][i]['tree_pss']):.1f} B/param")
    # what the process holds beyond its host tensors (on the CPU accelerator the "GPU" ones are host too)
    own = {k: r["steps"][-1]["VmRSS"] - (r["predicted_tensor_bytes"] if args.device == "cpu"
                                          else r["predicted_host_bytes"]) for k, r in results.items()}
    fixed = own["small"] - s["parameters"] * (own["large"] - own["small"]) / dn
    print(f"the process's own host memory after the last step ({args.device}): RSS less the model's host bytes "
          f"{own['small'] / gib:.2f} GiB (small), {own['large'] / gib:.2f} GiB (large); at zero parameters "
          f"{fixed / gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
