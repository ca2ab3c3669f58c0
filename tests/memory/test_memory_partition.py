"""Mechanisms the measured tables exposed (data/measured/*-quiet): ZeRO-1/2's gradient partition
holds whole parameters (checked against DeepSpeed's own partitioning and a real 2-rank step),
gloo's reduce-scatter copy under ZeRO-3 on the CPU, FSDP2's root all-gather copy-out at the start of
backward and its blocks' backward (middle blocks visited, the MLP weight gradients counted once): the
quiet tables recomputed, and real 2-rank steps (marked slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.memory import estimate_memory
from autotune.memory.states import grad_partition_elements, parameter_order, parameter_shapes
from autotune.presets import gpu_from_name
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy
from conftest import ROOT

torch = pytest.importorskip("torch")

# data/measured/tiny-gpt2-2rank-quiet/config.yaml and tiny-llama-engines-2rank-quiet/config.yaml
GPT2 = dict(name="tiny-gpt2-128", num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=512, vocab_size=1024, hidden_act="gelu_new", tie_word_embeddings=True, norm="layernorm",
            bias=True, position_embedding="learned", max_position_embeddings=256)
LLAMA = dict(name="tiny-llama-192", num_hidden_layers=4, hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=512, vocab_size=2048, max_position_embeddings=256)


@pytest.mark.parametrize("spec", [GPT2, LLAMA, dict(LLAMA, bias=True, norm="layernorm", tie_word_embeddings=True)])
def test_parameter_order_is_the_reference_decoders(spec):
    from autotune.models.reference import build_model

    m = ModelSpec(**spec)
    with torch.device("meta"):
        model = build_model(m)
    assert parameter_order(m) == [p.numel() for p in model.parameters()]
    assert list(parameter_shapes(m)) == [(p.shape[0], p.numel()) for p in model.parameters()]  # what FSDP2 chunks


def test_parameter_order_is_the_hf_classes(tmp_path):
    pytest.importorskip("transformers")
    import transformers

    from autotune.config import hf_config_fields

    sys.path.insert(0, str(Path(ROOT) / "benchmarks"))
    try:
        import memory_vs_deepspeed as bench
    finally:
        sys.path.pop(0)
    import memory_rows

    for name in [*bench.HF_FAMILIES, *memory_rows.MOE_FAMILIES]:  # MoE and MLA too (their expert tensors' shapes)
        cfg = bench.hf_config(name)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        m = ModelSpec(**hf_config_fields(str(path)))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
        assert parameter_order(m) == [p.numel() for p in model.parameters()], name
        assert list(parameter_shapes(m)) == [(p.shape[0], p.numel()) for p in model.parameters()], name


@pytest.mark.parametrize("spec", [GPT2, LLAMA])
@pytest.mark.parametrize("dp", [2, 3, 8])
def test_grad_partition_is_deepspeeds_params_in_partition(spec, dp):
    """grads_in_partition (stage_1_and_2.py copy_grads_in_partition) sums the numel of
    ``params_in_partition`` from DeepSpeed's own get_partition_info: the worst rank's."""
    z = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    m = ModelSpec(**spec)
    tensors = [torch.empty(n, device="meta") for n in parameter_order(m)]
    total = sum(parameter_order(m))
    part = -(-total // (2 * dp)) * (2 * dp) // dp
    sizes = [sum(t.numel() for t in z.DeepSpeedZeroOptimizer.get_partition_info(None, tensors, part, r)[0])
             for r in range(dp)]
    assert grad_partition_elements(m, dp) == max(sizes)
    assert max(sizes) >= part  # never less than Psi / N (more where a parameter straddles a boundary)


def _predicted(model: dict, seq: int, strategy: Strategy, nproc: int, gbs: int) -> int:
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=nproc)
    return estimate_memory(ModelSpec(**model), TrainingSpec(seq_len=seq, global_batch_size=gbs, precision="fp32"),
                           hw, strategy, device="cpu").gpu["peak"]


def test_zero2_partition_counts_the_straddling_parameter():
    """tiny-gpt2 on 2 ranks: the first MLP weight straddles the partition boundary (49920 of its
    65536 elements on rank 0's side), so rank 1 holds those too."""
    m = ModelSpec(**GPT2)
    assert grad_partition_elements(m, 2) - m.num_parameters // 2 == 49920
    s = Strategy(zero_stage=2, micro_batch_size=1, precision="fp32")
    s1 = Strategy(zero_stage=2, micro_batch_size=1, precision="fp32", checkpointing="full")
    assert _predicted(GPT2, 64, s, 2, 16) == pytest.approx(13.2735 * 2**20, rel=0.002)  # measured (quiet table)
    assert _predicted(GPT2, 64, s1, 2, 16) == pytest.approx(13.2735 * 2**20, rel=0.002)


def test_ffn_weight_gradients_released_by_stage_and_accumulation():
    """When a feed-forward weight gradient leaves autograd right after its AccumulateGrad (states.py
    ``ffn_grads_released``): ZeRO-1/2's reduce hook (ZeRO-2 every micro-step, ZeRO-1 at the boundary; not for a
    parameter larger than the reduce bucket), and a later micro-step's in-place accumulation under ZeRO-0/1
    (not with optimizer offload, whose walk has no carry); ZeRO-0 without accumulation and ZeRO-3 keep it. The
    MLP instant of a ZeRO-2 step then lacks the down projection's f x h weight gradient."""
    from autotune.memory.activations import activation_breakdown
    from autotune.memory.states import _model_states

    m = ModelSpec(**LLAMA)
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=2, num_nodes=1)

    def released(ga: int, **knobs) -> bool:
        tr = TrainingSpec(seq_len=256, global_batch_size=2 * 2 * ga, precision="bf16")
        return _model_states(m, tr, hw, Strategy(micro_batch_size=2, precision="bf16", **knobs), "cpu").ffn_grads_released

    assert not released(1, zero_stage=0) and released(2, zero_stage=0)
    assert released(1, zero_stage=1) and released(4, zero_stage=1) and released(1, zero_stage=1, offload_optimizer="cpu")
    assert not released(4, zero_stage=1, offload_optimizer="cpu")
    assert released(1, zero_stage=2) and released(4, zero_stage=2) and released(4, zero_stage=2, offload_optimizer="cpu")
    assert not released(1, zero_stage=2, reduce_bucket_size=m.hidden_size * m.intermediate_size - 2)
    assert not released(1, zero_stage=3) and not released(2, zero_stage=3)
    tr = TrainingSpec(seq_len=256, global_batch_size=4, precision="bf16")
    act = activation_breakdown(m, tr, Strategy(micro_batch_size=2, precision="bf16", zero_stage=2), "cpu")
    assert act.mlp_backward_transient - act.mlp_backward_released == 2 * m.hidden_size * m.intermediate_size


def test_gpt2_composite_gelu_released_without_the_dropout_mask(tmp_path):
    """HF GPT-2's composite GELU backward where c_proj's weight gradient is released (ZeRO-0 GA 2, ZeRO-1 GA 1
    and GA 4, traced): the residual dropout's mask was freed by the dropout's backward before c_proj's, so the
    GELU's instant holds neither; the stored rows whose peak it is re-predicted within 0.05% (+0.73 / +0.70 /
    +0.62% with the mask), under only by the worker's int64 token batches (16 B per token)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(ROOT) / "benchmarks"))
    try:
        import memory_vs_deepspeed as bench
    finally:
        sys.path.pop(0)
    stored = {bench.row_key(r): r for r in json.loads(
        (Path(ROOT) / "benchmarks" / "data" / "memory_vs_deepspeed.json").read_text()) if r.get("status") == "ok"}
    for key in (("hf-gpt2", 0, 2, 2, 2, 256, "full", "fp32"), ("hf-gpt2", 1, 2, 1, 2, 256, "op", "fp32"),
                ("hf-gpt2", 1, 1, 4, 4, 128, "full", "fp32")):
        row = bench.predict(dict(stored[key]), tmp_path)
        assert abs(row["error"]) < 0.0005, (key, row["error"])
        assert row["predicted"] < row["measured"] < row["predicted"] + 16 * key[4] * key[5] + 1024


def test_cpu_zero3_reduce_scatter_copy_only_on_cpu():
    s = Strategy(zero_stage=3, micro_batch_size=1, precision="fp32", checkpointing="full")
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=2)
    tr = TrainingSpec(seq_len=64, global_batch_size=2, precision="fp32")
    cpu = estimate_memory(ModelSpec(**GPT2), tr, hw, s, device="cpu").gpu["peak"]
    cuda = estimate_memory(ModelSpec(**GPT2), tr, hw, s, device="cuda").gpu["peak"]
    assert cpu - cuda >= 4 * 512 * 128 // 2  # gloo's copy of the down projection's gradient, net of what is freed


def _measure(tmp_path: Path, model: dict, seq: int, strategy: Strategy, nproc: int = 2) -> int:
    """The worst step of the worst rank, global batch 16 (gradient accumulation 8 at mbs 1, as the
    measured tables ran)."""
    from autotune.backends.launch import WORKER_MODULE, free_port
    from autotune.worker.main import result_path_for_rank

    tmp_path.mkdir(parents=True, exist_ok=True)
    job = {"model": model, "training": {"seq_len": seq, "global_batch_size": 16, "precision": "fp32"},
           "strategy": strategy.as_dict(), "warmup_steps": 2, "measure_steps": 2, "device": "cpu",
           "result_path": str(tmp_path / "result.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", WORKER_MODULE, str(tmp_path / "job.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    path = result_path_for_rank(tmp_path / "result.json", 0)
    assert path.exists(), proc.stderr[-3000:]
    res = json.loads(path.read_text())
    assert res["status"] == "ok", res
    return max(res["all_ranks"]["max_step_peak_bytes"])  # the worst step of the worst rank


@pytest.mark.slow
@pytest.mark.parametrize("model,seq,strategy", [  # the quiet tables' rows (recomputed before the fix)
    (GPT2, 64, Strategy(zero_stage=2, micro_batch_size=1, precision="fp32")),  # was -1.44%
    (GPT2, 64, Strategy(zero_stage=3, micro_batch_size=1, precision="fp32", checkpointing="full")),  # was -1.42%
    (LLAMA, 96, Strategy(engine="fsdp2", reshard_after_forward=False, micro_batch_size=1, precision="fp32")),  # -1.39%
], ids=["zero2-partition", "zero3-gloo-copy", "fsdp2-root-copy-out"])
def test_two_rank_step_matches_model(tmp_path, model, seq, strategy):
    if strategy.engine == "deepspeed":
        pytest.importorskip("deepspeed")
    pred = _predicted(model, seq, strategy, 2, 16)
    # (each was under-predicted by more than 1.3% before; the FSDP2 blocks' fixes are pinned by
    # test_quiet_tables_recomputed.) The model is a quiet step's: on a loaded CPU (CI's two xdist
    # workers on two cores) gloo can release a root all-gather late, one more half-root buffer
    # (CI measured -3.88% once, docs/accuracy.md), so a run outside the band is measured again, up to
    # three runs in all, and one must fall inside it.
    errors = []
    for attempt in range(3):
        worst = _measure(tmp_path / str(attempt), model, seq, strategy)
        errors.append((pred - worst) / worst)
        if -0.01 < errors[-1] < 0.01:
            break
    assert -0.01 < errors[-1] < 0.01, errors


@pytest.mark.parametrize("table", ["tiny-gpt2-2rank-quiet", "tiny-llama-engines-2rank-quiet"])
def test_quiet_tables_recomputed(table):
    """Every measured row of the quiet tables (2 ranks, the worst of 5 steps and both ranks), predicted
    again with today's model: before these mechanisms the worst were -1.44% (ZeRO-2's straddling
    parameter), -1.42% (ZeRO-3's gloo copy), -1.39% (FSDP2's root copy-out), -1.02% (FSDP2's middle
    blocks unvisited) and +3.23% (FSDP2's MLP weight gradients counted twice)."""
    import csv

    from autotune.config import load_config
    from autotune.backends.replay import STRATEGY_FIELDS, _cell
    from autotune.spec import GIB

    d = Path(ROOT) / "data" / "measured" / table
    cfg = load_config(str(d / "config.yaml"))
    errors = []
    with open(d / "trials.csv", newline="") as fh:
        rows = csv.DictReader(fh)
        cols = [c for c in rows.fieldnames if c in STRATEGY_FIELDS]
        for r in rows:
            if r["state"] != "COMPLETE" or r.get("duplicate_of"):
                continue
            s = Strategy(**{c: _cell(c, r[c]) for c in cols})
            est = estimate_memory(cfg.model, cfg.training, cfg.hardware, s, device="cpu")
            errors.append((est.gpu["peak"] / (float(r["peak_memory_gib"]) * GIB) - 1, r["strategy"]))
    assert len(errors) >= 64
    assert min(errors)[0] > -0.006, min(errors)
    assert max(errors)[0] < 0.015, max(errors)


def test_stored_benchmark_within_the_prediction_margin(tmp_path):
    """Every row of the memory benchmark (benchmarks/memory_vs_deepspeed.py, real DeepSpeed and FSDP2
    steps, the worst step and rank) re-predicted from its stored measurement: none is under-predicted
    by more than PREDICTION_MARGIN, the long-sequence checkpointed rows (the final norm's backward)
    included, nor over-predicted by more than 3%; the optimizer phase within 3.5% either way."""
    pytest.importorskip("transformers")
    from autotune.memory import PREDICTION_MARGIN

    sys.path.insert(0, str(Path(ROOT) / "benchmarks"))
    try:
        import memory_vs_deepspeed as bench
    finally:
        sys.path.pop(0)
    stored = {tuple(r.get(k, 1 if k == "ga" else None) for k in bench.ROW_KEYS): r
              for r in json.loads((Path(ROOT) / "benchmarks" / "data" / "memory_vs_deepspeed.json").read_text())
              if r.get("status") == "ok"}
    rows = bench.grid(False) + bench.hf_grid()
    keys = [tuple(r[k] for k in bench.ROW_KEYS) for r in rows]
    assert not [k for k in keys if k not in stored], "grid rows without a stored measurement"
    long_rows = [r for r in rows if r["seq"] >= 1024]
    assert {r["ckpt"] for r in long_rows} >= {"none", "full", "op"} and {r["stage"] for r in long_rows} >= {0, 1, 2, 3}
    assert {r["nproc"] for r in long_rows} == {1, 2} and len({r["model"] for r in long_rows}) >= 3
    predicted = {k: bench.predict(dict(stored[k]), tmp_path) for k in keys}
    errors = {k: r["error"] for k, r in predicted.items()}
    worst = min(errors, key=errors.get)
    assert errors[worst] >= -PREDICTION_MARGIN, (worst, errors[worst])
    # and none over-predicted beyond the benchmark's target of 3% (Gemma-3's MLP backward, after its
    # post-feedforward norm's released that norm's saved tensors, read +3.51% while they were counted)
    highest = max(errors, key=errors.get)
    assert errors[highest] <= 0.03, (highest, errors[highest])
    # the optimizer phase (every engine.step() call of the usual loop: the boundary step's norm, flatten and
    # all-gather, and a non-boundary call entered with the accumulation's carry) on the same rows
    step = {k: (r["phases_predicted"]["optimizer"] - r["phases_measured"]["optimizer"]) / r["phases_measured"]["optimizer"]
            for k, r in predicted.items()}
    assert max(map(abs, step.values())) < 0.035, max(step.items(), key=lambda kv: abs(kv[1]))
