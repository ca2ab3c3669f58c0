"""What a long-context front point ships (issue 24's output side): the DeepSpeed config of a Ulysses
point (parsed by DeepSpeed, in one process and on 2 gloo ranks through autotune.examples.train_deepspeed),
the FSDP2 layout and snippet of a context-parallel point, and each trainer's files naming the
long-context calls or saying in one line that the trainer cannot express the knob."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from autotune.config import load_config
from autotune.engine_configs import to_deepspeed_config, to_fsdp2_config
from autotune.models import fsdp2
from autotune.presets import gpu_from_name, model_from_name
from autotune.spec import HardwareSpec, TrainingSpec
from autotune.strategy import Strategy, validate
from autotune.trainers import FILES, write_trainer_files
from conftest import run_ranks

ROOT = Path(__file__).resolve().parents[2]
LLAMA = model_from_name("llama2-7b")
HW8 = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8)
LONG = TrainingSpec(seq_len=32768, global_batch_size=16, precision="bf16")


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_ulysses_config_keys_parse_in_deepspeed(precision):
    """sequence_parallel_size and the SP gradient dtype (the point's precision) are written, the
    batch counts GPUs / sp data-parallel ranks, and DeepSpeedConfig reads both; a 2-GPU sp 2
    config is the one DeepSpeed parses outside a launch (world size 1 = 2 / 2)."""
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    s = Strategy(zero_stage=3, sequence_parallel_size=4, precision=precision, micro_batch_size=1)
    training = TrainingSpec(seq_len=32768, global_batch_size=16, precision=precision)
    assert validate(s, LLAMA, training, HW8) == []
    cfg = to_deepspeed_config(s, LLAMA, training, HW8)
    assert cfg["sequence_parallel_size"] == 4 and cfg["seq_parallel_communication_data_type"] == precision
    assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 8  # 16 / (1 x 8 / 4)
    hw2 = HardwareSpec(gpu=HW8.gpu, gpus_per_node=2)
    s2 = Strategy(zero_stage=3, sequence_parallel_size=2, precision=precision, micro_batch_size=1)
    ds = DeepSpeedConfig(to_deepspeed_config(s2, LLAMA, training, hw2))
    assert ds.world_size == 1 and ds.train_batch_size == 16 and ds.gradient_accumulation_steps == 16
    assert ds.seq_parallel_communication_data_type == {"bf16": torch.bfloat16, "fp16": torch.float16,
                                                       "fp32": torch.float32}[precision]
    plain = to_deepspeed_config(Strategy(zero_stage=3, precision=precision, micro_batch_size=1), LLAMA, training, HW8)
    assert "sequence_parallel_size" not in plain and "seq_parallel_communication_data_type" not in plain
    assert plain["gradient_accumulation_steps"] == 2


def test_context_parallel_layout_and_snippet():
    """The CP point's layout: FSDP2 still shards over every GPU (``mesh``), the device mesh is
    torchtitan's dp_shard x cp with fully_shard over the flattened dp_shard_cp; hybrid adds
    dp_replicate. The snippet compiles and builds exactly that mesh and the context."""
    s = Strategy(engine="fsdp2", context_parallel_size=4, checkpointing="full", micro_batch_size=1)
    assert validate(s, LLAMA, LONG, HW8) == []
    lay = to_fsdp2_config(s, LLAMA, LONG, HW8)
    assert lay["mesh"] == {"shape": [8], "dim_names": ["shard"]}
    cp = lay["context_parallel"]
    assert cp["context_parallel_size"] == 4 and cp["mesh"] == {"shape": [2, 4], "dim_names": ["dp_shard", "cp"]}
    assert cp["fully_shard_mesh"] == ["dp_shard_cp"] and lay["gradient_accumulation_steps"] == 8  # 16 / (8 / 4)
    text = fsdp2.snippet(lay)
    compile(text, "fsdp2_snippet.py", "exec")
    assert "CP_MESH_SHAPE = (2, 4)" in text and "CP_MESH_DIM_NAMES = ('dp_shard', 'cp')" in text
    assert 'world[("dp_shard", "cp")]._flatten(mesh_dim_name="dp_shard_cp")' in text
    assert "FULLY_SHARD_MESH_DIMS = ('dp_shard_cp',)" in text and 'CP_MESH = world["cp"]' in text
    assert "with context_parallel_batch(model, batch):" in text and "from autotune" not in text
    two = HardwareSpec(gpu=HW8.gpu, gpus_per_node=8, num_nodes=2)
    hybrid = to_fsdp2_config(Strategy(engine="fsdp2", context_parallel_size=4, sharding="hybrid"), LLAMA, LONG, two)
    assert hybrid["mesh"] == {"shape": [2, 8], "dim_names": ["replicate", "shard"]}
    assert hybrid["context_parallel"]["mesh"] == {"shape": [2, 2, 4], "dim_names": ["dp_replicate", "dp_shard", "cp"]}
    assert "FULLY_SHARD_MESH_DIMS = ('dp_replicate', 'dp_shard_cp')" in fsdp2.snippet(hybrid)
    assert "context_parallel" not in to_fsdp2_config(Strategy(engine="fsdp2"), LLAMA, LONG, HW8)


def test_snippet_long_context_calls():
    """Tiling and activation offload: the snippet imports and calls autotune.models.long_context
    (tile_mlp and the tiled loss before sharding, the forward inside offload_activations)."""
    s = Strategy(engine="fsdp2", tiled_loss=True, tiled_mlp=True, checkpointing="full", activation_offload="cpu")
    lay = to_fsdp2_config(s, LLAMA, LONG, HW8)
    assert lay["long_context"] == {"tiled_loss": True, "tiled_mlp": True, "activation_offload": "cpu"}
    text = fsdp2.snippet(lay)
    compile(text, "fsdp2_snippet.py", "exec")
    assert "from autotune.models.long_context import offload_activations, tile_mlp, use_long_context_loss" in text
    assert text.index("    tile_mlp(model)") < text.index("fully_shard(block")
    assert "use_long_context_loss(model, tiled=True, gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS)" in text
    assert "        with offload_activations():" in text and "context_parallel_batch" not in text


def _job(tmp_path: Path, gpus: int, seq_len: int = 32, gbs: int = 2) -> object:
    job = tmp_path / "job.yaml"
    job.write_text(f"""model:
  hf_config: {ROOT / 'examples' / 'tiny-llama-hf.json'}
training: {{seq_len: {seq_len}, global_batch_size: {gbs}, precision: fp32}}
hardware:
  gpu: {{name: cpu, memory_gib: 4, peak_tflops_fp16: 0.2, peak_tflops_fp32: 0.1, hbm_bandwidth_gbps: 20}}
  gpus_per_node: {gpus}
  cpu_memory_gib: 16
""")
    return load_config(str(job))


def _write(tmp_path: Path, cfg, s: Strategy, k: int = 0) -> tuple[Path, dict]:
    run = tmp_path / "run"
    if s.engine == "deepspeed":
        rel = f"ds_configs/{k}.json"
        (run / "ds_configs").mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(json.dumps(to_deepspeed_config(s, cfg.model, cfg.training, cfg.hardware)))
    else:
        rel = f"fsdp2_configs/{k}.json"
        (run / "fsdp2_configs").mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(json.dumps(to_fsdp2_config(s, cfg.model, cfg.training, cfg.hardware)))
    keys = write_trainer_files(str(run), cfg, s, k, rel)
    return run / keys["trainers"], keys


def test_trainer_files_of_a_ulysses_point(tmp_path):
    """An SP point with tiling and offload: checkpointing.json carries the knobs as apply_long_context
    reads them, the README names the call, accelerate's file holds ParallelismConfig's sp keys,
    HF Trainer's README line the ParallelismConfig, and Lightning says it cannot."""
    import yaml

    cfg = _job(tmp_path, 2)
    s = Strategy(zero_stage=1, micro_batch_size=1, sequence_parallel_size=2, tiled_loss=True, tiled_mlp=True,
                 checkpointing="full", activation_offload="cpu", precision="fp32")
    assert validate(s, cfg.model, cfg.training, cfg.hardware) == []
    folder, keys = _write(tmp_path, cfg, s)
    assert "--checkpointing" in keys["launch"] and keys["long_context"].startswith("mpu = autotune.models.")
    spec = json.loads((folder / FILES["checkpointing"]).read_text())["long_context"]
    assert Strategy(**spec["strategy"]) == s and spec["seq_length"] == 32
    assert spec["knobs"] == {"sequence_parallel_size": 2, "tiled_loss": True, "tiled_mlp": True,
                             "activation_offload": "cpu"}
    readme = (folder / FILES["readme"]).read_text()
    assert "autotune.models.long_context.apply_long_context(model, autotune.Strategy(zero_stage=1, " \
           "sequence_parallel_size=2, tiled_loss=True, tiled_mlp=True, activation_offload='cpu', " \
           "checkpointing='full', micro_batch_size=1), seq_length=32, gradient_accumulation_steps=2)" in readme
    assert "; deepspeed.initialize(..., mpu=mpu); batch = autotune.models.long_context.shard_batch(batch, mpu)`" \
        in readme
    acc = yaml.safe_load((folder / FILES["accelerate"]).read_text())
    assert acc["parallelism_config"] == {"parallelism_config_dp_shard_size": 1, "parallelism_config_sp_size": 2,
                                         "parallelism_config_sp_backend": "deepspeed",
                                         "parallelism_config_sp_seq_length": 32,
                                         "parallelism_config_sp_attn_implementation": "sdpa"}
    assert 'parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2' in readme
    assert "Lightning's DeepSpeedStrategy takes no mpu, so it cannot run DeepSpeed Ulysses" in readme
    lightning = json.loads((folder / FILES["lightning"]).read_text())
    assert "sequence_parallel_size" not in lightning["strategy_args"]["config"]
    # the tiled head back-propagates inside the forward: the calls carry the point's GAS (2 = 2 / (2 / sp 2))
    for call in ("tile_mlp(model)", "use_long_context_loss(model, tiled=True, gradient_accumulation_steps=2)",
                 "use_long_context_loss(model, mpu=deepspeed.runtime.sequence_parallel.parallel_state_sp, "
                 "tiled=True, gradient_accumulation_steps=2)", "offload_in_forward(model)"):
        assert call in readme, call
    hf_ds = json.loads((folder / FILES["hf_ds_config"]).read_text())
    assert hf_ds["sequence_parallel_size"] == 2


def test_trainer_files_of_a_context_parallel_point(tmp_path):
    """A CP point: torchtitan's TOML has context_parallel_degree and the shard degree over it,
    accelerate's file cp_size over dp_shard, Lightning says it cannot."""
    import tomllib

    import yaml

    cfg = _job(tmp_path, 8, seq_len=64, gbs=8)
    s = Strategy(engine="fsdp2", context_parallel_size=4, micro_batch_size=1, precision="fp32")
    assert validate(s, cfg.model, cfg.training, cfg.hardware) == []
    folder, _ = _write(tmp_path, cfg, s)
    toml = tomllib.loads((folder / FILES["torchtitan"]).read_text())
    par = toml["parallelism"]
    assert par["context_parallel_degree"] == 4 and par["data_parallel_shard_degree"] == 2
    acc = yaml.safe_load((folder / FILES["accelerate"]).read_text())["parallelism_config"]
    assert acc["parallelism_config_cp_size"] == 4 and acc["parallelism_config_dp_shard_size"] == 2
    readme = (folder / FILES["readme"]).read_text()
    assert "Lightning cannot express it" in readme and "accelerator.maybe_context_parallel(" in readme
    assert "parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=4" in readme


@pytest.mark.slow
def test_the_example_script_trains_a_ulysses_point_on_two_ranks(tmp_path):
    """autotune.examples.train_deepspeed, as the point's launch line runs it, on 2 gloo ranks: Ulysses
    (sp 2, so DeepSpeed counts 1 data-parallel rank), the tiled loss and MLP, and the offload of
    checkpointed inputs, through apply_long_context and shard_batch (each rank 16 of the 32 tokens)."""
    pytest.importorskip("transformers")
    cfg = _job(tmp_path, 2)
    s = Strategy(zero_stage=1, micro_batch_size=1, sequence_parallel_size=2, tiled_loss=True, tiled_mlp=True,
                 checkpointing="full", activation_offload="cpu", precision="fp32")
    _, keys = _write(tmp_path, cfg, s)
    launch = keys["launch"].split()
    args = launch[launch.index("--module") + 1:]
    out = run_ranks(tmp_path, [sys.executable, "-m", *args, "--steps", "2"], timeout=300, cwd=ROOT)[0]
    assert "long context: mpu = autotune.models.long_context.apply_long_context(" in out
    assert "step 1: loss" in out and "micro-batches of 16 tokens per rank" in out
