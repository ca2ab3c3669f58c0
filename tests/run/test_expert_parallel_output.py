"""What an expert-parallel front point ships (issue 25's output side): the FSDP2 layout with
torchtitan's ep mesh, the snippet that builds it (compiled; on 2 gloo ranks with a tiny Hugging
Face Mixtral from config, its loss and gradients equal one process's), torchtitan.toml's
expert_parallel_degree, and the default space's moe section for MoE jobs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.config import hf_config_fields, load_config
from autotune.engine_configs import to_fsdp2_config
from autotune.models import fsdp2
from autotune.presets import gpu_from_name, model_from_name
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy

ROOT = Path(__file__).resolve().parents[2]
MIXTRAL = ModelSpec(**hf_config_fields(str(ROOT / "tests/data/hf/moe/mixtral-8x7b-v0.1.json"), exact_check=False))
HW8 = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8)
HW16 = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8, num_nodes=2)
TRAIN = TrainingSpec(seq_len=4096, global_batch_size=64)


def test_ep_layout_is_torchtitans_mesh():
    lay = to_fsdp2_config(Strategy(engine="fsdp2", expert_parallel_size=4), MIXTRAL, TRAIN, HW8)
    ep = lay["expert_parallel"]
    assert ep["mesh"] == {"shape": [2, 4], "dim_names": ["dp_shard_mod_ep", "dp_shard_in_ep"]}
    assert (ep["local_experts"], ep["experts_shard_dim"], ep["gradient_divide_factor"]) == (2, 0, 8)
    assert ep["fully_shard_mesh"] == ["dp_shard_cp"] and ep["experts_fully_shard_mesh"] == ["dp_shard_mod_ep"]
    assert lay["mesh"] == {"shape": [8], "dim_names": ["shard"]}  # the dense parts: every GPU
    # 16 GPUs, EP 2: 8 x 2 > 8 experts -> the experts' FSDP shards their dim 1 (torchtitan apply_fsdp)
    assert to_fsdp2_config(Strategy(engine="fsdp2", expert_parallel_size=2), MIXTRAL, TRAIN,
                           HW16)["expert_parallel"]["experts_shard_dim"] == 1
    hybrid = to_fsdp2_config(Strategy(engine="fsdp2", sharding="hybrid", expert_parallel_size=8), MIXTRAL, TRAIN,
                             HW16)["expert_parallel"]
    assert hybrid["mesh"] == {"shape": [2, 1, 8], "dim_names": ["dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"]}
    assert hybrid["gradient_divide_factor"] == 16
    assert "expert_parallel" not in to_fsdp2_config(Strategy(engine="fsdp2"), MIXTRAL, TRAIN, HW8)


def test_ep_snippet_compiles_and_names_the_calls():
    text = fsdp2.snippet(to_fsdp2_config(Strategy(engine="fsdp2", expert_parallel_size=8), MIXTRAL, TRAIN, HW8))
    compile(text, "snippet.py", "exec")
    for call in ("init_device_mesh(device_type, EP_MESH_SHAPE", '_flatten(mesh_dim_name="dp_shard_cp")',
                 "expert_parallel(experts, EP_MESH.get_group())", "fully_shard(experts, mesh=EXPERTS_MESH",
                 "set_gradient_divide_factor(GRADIENT_DIVIDE_FACTOR)", "all_to_all_single",
                 "EP_MESH_SHAPE = (1, 8)"):
        assert call in text, call
    assert "import autotune" not in text and "from autotune" not in text  # plain torch
    assert "EP_MESH" not in fsdp2.snippet(to_fsdp2_config(Strategy(engine="fsdp2"), MIXTRAL, TRAIN, HW8))


def test_torchtitan_toml_carries_expert_parallel_degree(tmp_path):
    import tomllib

    from autotune.trainers.common import Point
    from autotune.trainers.torchtitan_toml import torchtitan_sections

    def sections(ep):
        cfg = dataclasses.replace(load_config(str(ROOT / "examples/llama2-7b.yaml")), model=MIXTRAL, hardware=HW8,
                                  training=TRAIN)
        return torchtitan_sections(Point(cfg=cfg, strategy=Strategy(engine="fsdp2", expert_parallel_size=ep),
                                         ds_config=None, ds_config_path=None))

    assert sections(4)["parallelism"]["expert_parallel_degree"] == 4
    assert "expert_parallel_degree" not in sections(1)["parallelism"]
    # the key is torchtitan 0.2's (torchtitan/config/job_config.py Parallelism; read as text: importing
    # torchtitan needs triton)
    import importlib.util

    titan = Path(importlib.util.find_spec("torchtitan").submodule_search_locations[0])
    job = (titan / "config" / "job_config.py").read_text()
    assert "class Parallelism" in job and "    expert_parallel_degree: int = 1\n" in job
    from autotune.trainers.torchtitan_toml import toml_text

    assert tomllib.loads(toml_text(sections(4), []))["parallelism"]["expert_parallel_degree"] == 4


def test_trainer_files_of_an_ep_point_say_what_cannot_express_it():
    """HF Trainer and accelerate have no expert dimension: their lines say so and name what can; Lightning's
    autotune.apply splits the experts, and its clipping moves to expert_parallel.clip_grad_norm (torch's
    refuses the two meshes), so lightning.json carries no gradient_clip_val."""
    from autotune.trainers import accelerate_config, hf_trainer, lightning_args
    from autotune.trainers.common import Point

    cfg = dataclasses.replace(load_config(str(ROOT / "examples/llama2-7b.yaml")), model=MIXTRAL, hardware=HW8,
                              training=TRAIN)

    def point(ep):
        return Point(cfg=cfg, strategy=Strategy(engine="fsdp2", expert_parallel_size=ep), ds_config=None,
                     ds_config_path=None)

    for module in (hf_trainer, accelerate_config):
        lines = [d for d in module.differences(point(4)) if d.startswith("expert_parallel_size 4")]
        assert len(lines) == 1 and "torchtitan.toml" in lines[0], module.__name__
        assert not any("expert_parallel_size" in d for d in module.differences(point(1)))
    clip = cfg.training.optimizer.gradient_clipping
    assert clip > 0
    assert any(f"expert_parallel.clip_grad_norm(self.model, {clip})" in d
               for d in lightning_args.differences(point(4)))
    assert "gradient_clip_val" not in lightning_args.lightning_args(point(4))["trainer_args"]
    assert lightning_args.lightning_args(point(1))["trainer_args"]["gradient_clip_val"] == clip


def test_default_space_searches_ep_for_moe_jobs_only():
    from autotune.space import load_space

    space = load_space("default")
    job = (TrainingSpec(seq_len=4096, global_batch_size=64), HardwareSpec(gpu=gpu_from_name("h100-80gb"),
                                                                          gpus_per_node=8))
    moe = space.for_job(MIXTRAL, *job)
    assert space.sections["moe"]["expert_parallel_size"] == (1, 2, 4, 8)
    assert moe.values["expert_parallel_size"] == (1, 2, 4, 8)
    assert space.for_job(model_from_name("llama2-7b"), *job).values["expert_parallel_size"] == (1,)
    eps = {s.expert_parallel_size for s in moe.candidates(MIXTRAL) if s.engine == "fsdp2"}
    assert eps == {1, 2, 4, 8}
    assert {s.expert_parallel_size for s in moe.candidates(MIXTRAL) if s.engine == "deepspeed"} == {1}


def test_experts_modules_finds_the_hf_layout_only():
    """Mixtral's and Qwen3-MoE's experts ([E, 2f, d] / [E, d, f]) are split; gpt-oss's transposed,
    biased ones are not (the EP forward would compute something else)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, \
        Qwen3MoeForCausalLM

    from autotune.models.expert_parallel import experts_modules

    with torch.device("meta"):  # shapes only
        small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64)
        assert len(experts_modules(MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4,
                                                                    **small)))) == 2
        assert len(experts_modules(Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=24, num_experts=4,
                                                                      num_experts_per_tok=2, **small)))) == 2
        oss = GptOssForCausalLM(GptOssConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                             head_dim=8, **small))
    assert experts_modules(oss) == []


def _grad_diff(model, ref, rank: int) -> float:
    """The largest relative difference of a gradient from one process's (this rank's 2 routed experts)."""
    diff = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        w = q.grad[rank * 2:(rank + 1) * 2] if ".mlp.experts." in name else q.grad  # not shared_experts
        diff = max(diff, float((g - w).abs().max() / w.abs().max().clamp(min=1e-12)))
    return diff


def _reference(cls, cfg, kv_heads: int) -> tuple:
    """One process's model of ``cls`` (seed 0) after its loss's backward on the whole batch: (model, batch,
    loss, the EP 2 fp32 layout on 2 GPUs)."""
    import torch

    torch.manual_seed(0)
    ref = cls(cfg)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    spec = ModelSpec(name="tiny-moe", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                     num_key_value_heads=kv_heads, intermediate_size=48, vocab_size=64, num_experts=4,
                     num_experts_per_tok=2)
    lay = to_fsdp2_config(Strategy(engine="fsdp2", precision="fp32", expert_parallel_size=2), spec,
                          TrainingSpec(seq_len=16, global_batch_size=2, precision="fp32"),
                          HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=2))
    return ref, ids, want, lay


def _rank_result(model, ref, ids, want) -> dict:
    """This rank's half of the batch through ``model``: the mean loss over the ranks, and the gradients'
    largest relative difference from ``ref``'s."""
    import torch.distributed as dist

    rank = dist.get_rank()
    loss = model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {"loss": float(total) / 2, "want": float(want), "diff": _grad_diff(model, ref, rank)}


def _deepseek_v3(mode: str) -> dict:
    """A tiny HF DeepSeek-V3 (a dense first block, a shared expert, latent attention, the grouped sigmoid
    router) through the snippet's shard() or apply with EP 2, in the initialised gloo group: loss and
    gradients."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                           topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                           v_head_dim=8, max_position_embeddings=64, attn_implementation="sdpa")
    ref, ids, want, lay = _reference(DeepseekV3ForCausalLM, cfg, 4)
    model = DeepseekV3ForCausalLM(cfg)
    model.load_state_dict(ref.state_dict())
    if mode == "snippet":
        ns: dict = {}
        exec(compile(fsdp2.snippet(lay), "snippet.py", "exec"), ns)
        ns["shard"](model, model.model.layers)
    else:
        notes = fsdp2.apply(model, lay)
        assert any("expert parallel 2: 1 experts modules" in n for n in notes), notes  # block 0 is dense
    return _rank_result(model, ref, ids, want)


def _ep_rank(out: str) -> None:
    """One of 2 gloo ranks: the snippet's shard() and autotune.models.fsdp2.apply (what the profiling
    worker runs), EP 2 in fp32, each on a tiny HF Mixtral with each rank half the batch; the loss and
    every gradient against one process running the whole batch unsharded."""
    import torch.distributed as dist
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, attn_implementation="sdpa")
    ref, ids, want, lay = _reference(MixtralForCausalLM, cfg, 2)
    results = {}
    for mode in ("snippet", "apply"):
        model = MixtralForCausalLM(cfg)
        model.load_state_dict(ref.state_dict())
        if mode == "snippet":
            ns: dict = {}
            exec(compile(fsdp2.snippet(lay), "snippet.py", "exec"), ns)
            ns["shard"](model, model.model.layers)  # initialises the gloo group
        else:
            notes = fsdp2.apply(model, lay)
            assert any("expert parallel 2: 2 experts modules" in n for n in notes), notes
        results[mode] = _rank_result(model, ref, ids, want)
    results.update({f"deepseek_v3 {mode}": _deepseek_v3(mode) for mode in ("snippet", "apply")})
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(results))
    dist.barrier()  # both ranks done with every collective before either tears the group down
    dist.destroy_process_group()


@pytest.mark.slow
def test_ep_on_two_ranks_gives_one_process_loss_and_gradients(tmp_path):
    """The snippet and the worker's apply, on 2 gloo ranks: one process's loss and gradients (a Mixtral,
    and a DeepSeek-V3 with a dense block, a shared expert and latent attention)."""
    from autotune.backends.launch import free_port

    out = tmp_path / "rank"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        for mode, r in json.loads(Path(f"{out}.{rank}").read_text()).items():
            assert r["loss"] == pytest.approx(r["want"], rel=1e-5), mode
            assert r["diff"] < 1e-4, mode


@pytest.mark.slow
def test_the_fsdp2_training_script_prints_the_routing_it_dispatched(tmp_path):
    """An EP point's launch script (autotune.examples.train_fsdp2) on 2 gloo ranks, fed the job's own tokens
    (profile.tokens: the UTF-8 bytes of this repository's README): it trains and prints the routing its steps
    dispatched as the factors a job states, which the job's rules accept."""
    import textwrap

    import numpy as np
    import yaml

    from autotune.backends.launch import free_port
    from autotune.model_rules import check_stated_balance

    raw = yaml.safe_load((ROOT / "examples" / "tiny-cpu-moe.yaml").read_text())
    raw["model"]["hf_config"] = str(ROOT / "examples" / raw["model"]["hf_config"])
    raw["search"]["space"] = str(ROOT / "examples" / raw["search"]["space"])
    np.save(tmp_path / "tokens.npy", np.frombuffer((ROOT / "README.md").read_bytes(), dtype=np.uint8))
    raw["profile"]["tokens"] = "tokens.npy"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(job))
    layout = tmp_path / "ep.json"
    layout.write_text(json.dumps(to_fsdp2_config(Strategy(engine="fsdp2", expert_parallel_size=2, micro_batch_size=2),
                                                 cfg.model, cfg.training, cfg.hardware)))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "autotune.examples.train_fsdp2", "--job", str(job), "--fsdp2",
                           str(layout), "--steps", "1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    (at,) = [i for i, x in enumerate(out) if x.startswith("routing measured over 1 step(s) of 2 rank(s)")]
    stated = yaml.safe_load(textwrap.dedent("\n".join(out[at + 1:at + 6])))  # the lines to paste into the job
    assert list(stated["model"]) == ["moe_load_imbalance", "moe_min_load", "ep_rank_imbalance", "ep_step_imbalance"]
    factors = {k: float(v) for k, v in stated["model"].items()}
    assert 1.0 <= factors["ep_step_imbalance"] <= factors["ep_rank_imbalance"] and factors["moe_min_load"] <= 1.0
    check_stated_balance(cfg.model.replace(**factors))


if __name__ == "__main__":  # a rank of test_ep_on_two_ranks_gives_one_process_loss_and_gradients
    _ep_rank(sys.argv[1])
    # the results are written and the group destroyed: leave without the interpreter's teardown. Rank 0
    # aborted once in a fresh-clone CI with "terminate called without an active exception" (SIGABRT, no
    # Python error before it: a std::thread destroyed while joinable, as at static destruction); 0 of 14
    # runs here reproduced it. A missing result file still fails the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
