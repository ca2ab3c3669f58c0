"""The fast screen: memory._fast's grid verdicts, the deferred estimates and the simulator's caches
give exactly what estimate_memory and simulate give candidate by candidate, and every cached term
is keyed on exactly the knobs it reads."""

import dataclasses
import os
from functools import partial

import pytest

from autotune.config import load_config
from autotune.engine_configs import default_buckets
from autotune.memory import estimate_memory
from autotune.memory import _fast
from autotune.memory.common import DeferredEstimate, MemoryEstimate
from autotune.presets import gpu_from_name
from autotune.screen import screen
from autotune.simulate import Simulator, _micro_batch_compute, _Rates, simulate
from autotune.space import load_space
from autotune.spec import BYTES_PER_ELEMENT
from autotune.strategy import Strategy, validate
from conftest import ROOT


def _cfg(name: str, **hardware):
    cfg = load_config(os.path.join(ROOT, name))
    model = hardware.pop("model", None)
    if model:
        cfg = dataclasses.replace(cfg, model=cfg.model.replace(**model))
    if hardware:
        cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, **hardware))
    return cfg


JOBS = {
    "llama2-7b": ("examples/llama2-7b.yaml", {}),            # dense llama, 8 GPUs, offload to cpu
    "gpt2": ("examples/gpt2.yaml", {}),                      # tied head, LayerNorm, biases
    "llama-2-nodes": ("examples/llama2-7b.yaml", {"num_nodes": 2}),  # fsdp2 hybrid, inter-node
    "tiny-fsdp2": ("examples/tiny-cpu-fsdp2.yaml", {}),
    "gpt2-2rank": ("data/measured/tiny-gpt2-2rank/config.yaml", {}),
    "llama3.1-long": ("examples/llama3.1-8b-long.yaml", {}),  # the long-context knobs (default space's long_context)
    "qwen3-moe-ep": ("examples/qwen3-30b-a3b.yaml", {}),  # expert parallelism (default space's moe section)
    # latent attention, shared experts, a dense first block (blocks of two kinds, memory/mixed.py)
    "deepseek-v2-lite": ("examples/deepseek-v2-lite.yaml", {}),
    # a step's mean below the busiest dispatch (expert_parallel.ep_excess: the blocks' received rows bounded
    # block by block), uniform and with a dense first block
    "qwen3-moe-ep-step": ("examples/qwen3-30b-a3b.yaml", {"model": {"ep_step_imbalance": 1.1}}),
    "deepseek-v2-lite-step": ("examples/deepseek-v2-lite.yaml", {"model": {"ep_step_imbalance": 1.05}}),
    # every routing factor stated, as a profiled EP trial prints them (docs/moe.md, Measuring the routing)
    "tiny-moe-measured": ("examples/tiny-cpu-moe.yaml", {"model": {
        "moe_load_imbalance": 1.5313, "moe_min_load": 0.4062, "ep_rank_imbalance": 1.1641, "ep_step_imbalance": 1.1221}}),
    # eager attention with sinks (the core's backward instant, ZeRO-0's gradients held there), MoE
    "gpt-oss-20b": ("examples/gpt-oss-20b.yaml", {}),
}


def _pool(cfg, stride: int) -> list[Strategy]:
    """Every candidate of the engines space and every ``stride``-th of the default one."""
    model, precision = cfg.model, cfg.training.precision
    default = load_space("default", precision=precision)
    default = default.for_job(cfg.model, cfg.training, cfg.hardware)  # its long_context values for a long job
    return (list(load_space("engines", precision=precision).candidates(model))
            + list(default.candidates(model))[::stride])


@pytest.mark.parametrize("job", sorted(JOBS))
@pytest.mark.parametrize("device, loop", [("cuda", "keep_outputs"), ("cpu", "drop_outputs")])
def test_grid_verdicts_equal_estimate_memory(job, device, loop):
    path, hw = JOBS[job]
    cfg = _cfg(path, **dict(hw))
    m, tr, hwspec = cfg.model, cfg.training, cfg.hardware
    pool = _pool(cfg, 11 if device == "cuda" else 37)
    pool.append(Strategy(checkpointing="full", checkpoint_every=4))  # not on the grid: None
    verdicts = _fast.verdicts(m, tr, hwspec, pool, headroom=0.05, device=device, loop=loop)
    assert verdicts[-1] is None
    computed = fits = 0
    for s, v in zip(pool[:-1], verdicts[:-1]):
        est = estimate_memory(m, tr, hwspec, s, headroom=0.05, device=device, loop=loop)
        if validate(s, m, tr, hwspec):
            assert v == (False, None), s
            continue
        assert v == (est.fits, est.total_gpu_bytes), (s, est.reasons)
        computed += 1
        fits += est.fits
    assert computed > 100 and fits > 0
    # the walk instant by phase: each phase's peak and the activation peak (what the verdict does not show)
    for engine in ("deepspeed", "fsdp2"):
        on = [s for s in pool[:-1] if s.engine == engine]
        phases, act_peak = _fast.phase_peaks(m, tr, hwspec, on, engine, device=device, loop=loop)
        for j, s in enumerate(on):
            est = estimate_memory(m, tr, hwspec, s, device=device, loop=loop)
            assert {ph: v[j] for ph, v in phases.items()} == est.phases and act_peak[j] == est.activation_peak, s
    assert fits < computed or job in ("tiny-fsdp2", "gpt2-2rank", "tiny-moe-measured")  # tiny models fit everywhere


@pytest.mark.parametrize("job", ["llama2-7b", "gpt2", "tiny-fsdp2"])
def test_screen_equals_estimate_memory_and_simulate_per_candidate(job):
    path, hw = JOBS[job]
    cfg = _cfg(path, **dict(hw))
    assert cfg.search.fidelity != "traced" and cfg.search.trace_near_limit <= 0  # the analytic screen
    m, tr, hwspec = cfg.model, cfg.training, cfg.hardware
    params = {"gemm_eff": 0.5, "overlap": 0.2}
    screened = screen(cfg, load_space("engines", precision=tr.precision), 0.05, params)
    assert any(s.memory.fits for s in screened) and not all(s.memory.fits for s in screened)
    for s in screened:
        direct = estimate_memory(m, tr, hwspec, s.strategy, headroom=0.05)
        assert isinstance(s.memory, DeferredEstimate)
        assert s.memory.total_gpu_bytes == direct.total_gpu_bytes or not direct.fits  # known before building
        assert s.memory == direct and direct == s.memory and s.memory.as_dict() == direct.as_dict()
        assert s.memory.reasons == direct.reasons and s.memory.phases == direct.phases
        tps = simulate(m, tr, hwspec, s.strategy, params).tokens_per_s_per_gpu if direct.fits else 0.0
        assert s.tokens_per_s_per_gpu == tps


def test_deferred_estimate_checks_the_verdict_it_was_given():
    cfg = _cfg("examples/llama2-7b.yaml")
    s = Strategy(zero_stage=3, micro_batch_size=1, checkpointing="full")
    args = (partial(estimate_memory, headroom=0.05), cfg.model, cfg.training, cfg.hardware, s)
    real = estimate_memory(cfg.model, cfg.training, cfg.hardware, s, headroom=0.05)
    assert DeferredEstimate.of(real.fits, real.total_gpu_bytes, *args).gpu == real.gpu
    with pytest.raises(AssertionError, match="screen verdict"):
        DeferredEstimate.of(real.fits, real.total_gpu_bytes + 1, *args).gpu
    with pytest.raises(AssertionError, match="screen verdict"):
        DeferredEstimate.of(not real.fits, None, *args).reasons
    assert isinstance(dataclasses.replace(DeferredEstimate.of(real.fits, None, *args), fits=False), MemoryEstimate)


def test_candidates_are_the_strategies_their_values_make():
    cfg = _cfg("examples/llama2-7b.yaml")
    cands = list(load_space("default").candidates(cfg.model))
    assert len(cands) == len({s.key() for s in cands}) > 10_000
    assert all(type(s) is Strategy for s in cands)
    assert [Strategy(**s.as_dict()) for s in cands] == cands  # __post_init__ ran: the same identities
    assert any(s.engine == "fsdp2" and s.zero_stage == 3 for s in cands)


# ---------------------------------------------------------------- the cache keys

def _keyed(pool, key, direct):
    """Group ``pool`` by ``key``: strategies with one key give one result (the key is complete)."""
    seen = {}
    for s in pool:
        seen.setdefault(key(s), (s, direct(s)))
        first, result = seen[key(s)]
        assert direct(s) == result, (key(s), first, s)
    return seen


def _moves(base: Strategy, knob: str, value, direct) -> bool:
    return direct(base) != direct(base.replace(**{knob: value}))


KEYS = {  # key -> (direct function of (cfg, strategy), engine, {knob: (base strategy, other value)}, job, hardware)
    "rules_key": (lambda c, s: validate(s, c.model, c.training, c.hardware), None, {
        "engine": (Strategy(offload_params="nvme"), "fsdp2"),
        "zero_stage": (Strategy(zero_stage=3, offload_optimizer="cpu"), 0),
        "micro_batch_size": (Strategy(), 3),
        "offload_params": (Strategy(zero_stage=2), "cpu"),
        "offload_optimizer": (Strategy(zero_stage=0), "cpu"),
        "checkpoint_layers": (Strategy(checkpointing="full"), 1000),
        "checkpoint_every": (Strategy(checkpointing="full", checkpoint_layers=4), 2),
        "sharding": (Strategy(engine="fsdp2"), "hybrid"),
        "precision": (Strategy(), "fp16"),  # on a GPU without bf16
        "checkpointing": (Strategy(activation_offload="cpu"), "full"),
        "sequence_parallel_size": (Strategy(), 3),
        "context_parallel_size": (Strategy(engine="fsdp2"), 3),
        "activation_offload": (Strategy(checkpointing="op"), "cpu"),
        "expert_parallel_size": (Strategy(engine="fsdp2"), 2),  # GPT-2 is dense
    }, "examples/gpt2.yaml", {"gpu": gpu_from_name("v100-32gb")}),
    "activation_key": (lambda c, s: _fast.activation_row(c.model, c.training, s, "cuda"), None, {
        "micro_batch_size": (Strategy(), 2),
        "precision": (Strategy(), "fp32"),
        "checkpointing": (Strategy(checkpointing="full"), "op"),
        "checkpoint_layers": (Strategy(checkpointing="full"), 4),
        "checkpoint_every": (Strategy(checkpointing="full"), 4),
        "engine": (Strategy(zero_stage=3, checkpointing="op"), "fsdp2"),  # GPT-2: ZeRO-3's linears
        "zero_stage": (Strategy(zero_stage=3, checkpointing="op"), 1),
        "sequence_parallel_size": (Strategy(), 2),
        "context_parallel_size": (Strategy(engine="fsdp2"), 2),
        "tiled_loss": (Strategy(), True),
        "tiled_mlp": (Strategy(), True),
        "activation_offload": (Strategy(checkpointing="full"), "cpu"),
        "pin_memory": (Strategy(checkpointing="full", activation_offload="cpu"), False),  # pinned host copies
        "expert_parallel_size": (Strategy(engine="fsdp2"), 2, "examples/qwen3-30b-a3b.yaml"),  # on a MoE
    }, "examples/gpt2.yaml", {}),  # GPT-2: biased linears (ZeRO-3's matmul)
    "states_key": (lambda c, s: _fast.states_row(c.model, c.training, c.hardware, s, "cuda"),
                   "deepspeed", {
        "zero_stage": (Strategy(zero_stage=1), 2),
        "offload_optimizer": (Strategy(zero_stage=2), "cpu"),
        "offload_params": (Strategy(zero_stage=3), "cpu"),
        "precision": (Strategy(), "fp32"),
        "micro_batch_size": (Strategy(zero_stage=1, micro_batch_size=4), 8),  # accumulation 2 -> 1
        "reduce_bucket_size": (Strategy(zero_stage=2), 1000),
        "prefetch_bucket_size": (Strategy(zero_stage=3), 10 ** 8, "examples/llama3-8b.yaml"),  # llama2-7b: one
        # parameter per prefetch whatever the bucket, and none at the peak (memory/zero3_fetch.py)
        "param_persistence_threshold": (Strategy(zero_stage=3), 10 ** 9),
        # ZeRO-3's blocks checkpointed whole fetch their modules again in the backward (memory/zero3_fetch.py)
        "checkpointing": (Strategy(zero_stage=3), "full"),
        "checkpoint_every": (Strategy(zero_stage=3, checkpointing="full"), 4, "examples/llama3-8b.yaml"),
        "checkpoint_layers": (Strategy(zero_stage=3, checkpointing="full"), 4),
        "sequence_parallel_size": (Strategy(zero_stage=1, micro_batch_size=8), 2),  # accumulation 1 -> 2
        "pin_memory": (Strategy(zero_stage=3, offload_optimizer="cpu"), False),  # pinned blocks: powers of two
    }, "examples/llama2-7b.yaml", {}),  # 7B parameters: more than ZeRO-3 keeps gathered
    "units_key": (lambda c, s: _fast.units_row(c.model, c.training, c.hardware, s, "cuda"), "fsdp2", {
        "precision": (Strategy(engine="fsdp2"), "fp32"),
        "reduce_dtype": (Strategy(engine="fsdp2"), "bf16"),
        "offload_params": (Strategy(engine="fsdp2"), "cpu"),
        "sharding": (Strategy(engine="fsdp2"), "hybrid"),  # on 2 nodes
        "micro_batch_size": (Strategy(engine="fsdp2", micro_batch_size=32), 64),  # accumulation 2 -> 1
        "reshard_after_forward": (Strategy(engine="fsdp2"), False),
        "context_parallel_size": (Strategy(engine="fsdp2", micro_batch_size=64), 2),  # accumulation 1 -> 2
        "expert_parallel_size": (Strategy(engine="fsdp2"), 2, "examples/qwen3-30b-a3b.yaml"),  # on a MoE
        "pin_memory": (Strategy(engine="fsdp2", offload_params="cpu"), False),  # pinned shards: powers of two
    }, "examples/gpt2.yaml", {"num_nodes": 2}),
}


@pytest.mark.parametrize("name", sorted(KEYS))
def test_each_cached_term_is_keyed_on_exactly_the_knobs_it_reads(name):
    direct_of, engine, moving, job, hardware = KEYS[name]
    key = getattr(_fast, name)
    cfg = _cfg(job, **hardware)
    direct = lambda s: direct_of(cfg, s)  # noqa: E731
    pool = [s for s in _pool(cfg, 3) if engine in (None, s.engine)]
    pool += [s.replace(**{knob: value}) for knob, (s, value, *_) in moving.items()]
    _keyed(pool, key, direct)
    assert set(moving) == set(key.__reduce__()[1])  # every knob of the key is checked below
    for knob, (base, value, *other_job) in moving.items():  # a knob that moves only another job's result: that job
        moved = partial(direct_of, _cfg(other_job[0])) if other_job else direct
        assert _moves(base, knob, value, moved), f"{name}: {knob} does not move the result"


def test_simulator_caches_are_keyed_on_the_knobs_they_read():
    cfg = _cfg("examples/llama2-7b.yaml")
    m, tr, hw = cfg.model, cfg.training, cfg.hardware
    sim = Simulator(m, tr, hw)
    strategies = list(load_space("default").candidates(m))[::5]
    for s in strategies:
        assert sim.buckets(s) == default_buckets(m, s)
        rates, mb = sim.micro_batch(s)
        peak = hw.gpu.peak_flops(s.precision)
        assert rates == _Rates(peak, hw.gpu.hbm_bandwidth_gbps * 1e9 * sim.p["hbm_eff"], BYTES_PER_ELEMENT[s.precision])
        assert mb == _micro_batch_compute(m, tr.seq_len, float(s.micro_batch_size * tr.seq_len), rates, sim.p)
        assert sim(s) == simulate(m, tr, hw, s)
    base = Strategy(zero_stage=2)
    assert sim.micro_batch(base) != sim.micro_batch(base.replace(micro_batch_size=2))
    assert sim.micro_batch(base) != sim.micro_batch(base.replace(precision="fp32"))
    for knob, value in (("zero_stage", 3), ("reduce_bucket_size", 10), ("allgather_bucket_size", 10)):
        assert sim.buckets(base) != sim.buckets(base.replace(**{knob: value})), knob
    z3 = Strategy(zero_stage=3)
    for knob in ("prefetch_bucket_size", "param_persistence_threshold"):
        assert sim.buckets(z3) != sim.buckets(z3.replace(**{knob: 10})), knob
