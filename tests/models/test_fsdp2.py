"""autotune.models.fsdp2: a real fully_shard on a 1-process gloo group (CPU), real training steps, and the
ready-to-paste snippet (compiled, and executed on the same group)."""

import math

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import autotune  # noqa: E402
from autotune.models import fsdp2  # noqa: E402
from autotune.presets import gpu_from_name  # noqa: E402
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402
from autotune.engine_configs import to_fsdp2_config

TINY = ModelSpec(name="tiny", num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=172, vocab_size=512, max_position_embeddings=128)
TRAINING = TrainingSpec(seq_len=32, global_batch_size=4)


def _model():
    from autotune.models.reference import build_model, synthetic_batch

    torch.manual_seed(0)
    model = build_model(TINY)
    batches = []
    for seed in range(2):
        x, y = synthetic_batch(TINY, 2, TRAINING.seq_len, seed=seed)
        batches.append({"input_ids": x, "labels": y})
    return model, batches


def _train(model, optimizer, batches, steps=3):
    losses = []
    for step in range(steps):
        loss = model(**batches[step % 2])["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("knobs", [dict(checkpointing="op", checkpoint_every=2, reshard_after_forward=False),
                                   dict(checkpointing="full", reduce_dtype="bf16")])
def test_apply_shards_every_block_and_trains(group, knobs):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    model, batches = _model()
    strategy = Strategy(engine="fsdp2", micro_batch_size=2, **knobs)
    notes = autotune.apply(model, strategy)
    assert autotune.apply is fsdp2.apply
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.layers)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())
    state = model.layers[0]._get_fsdp_state()._fsdp_param_group
    # reshard_after_forward=False: no post-forward mesh (the unsharded parameters stay until backward)
    assert (state.post_forward_mesh_info is None) == (knobs.get("reshard_after_forward") is False)
    assert state.mp_policy.param_dtype == torch.bfloat16
    assert state.mp_policy.reduce_dtype == (torch.bfloat16 if knobs.get("reduce_dtype") == "bf16" else torch.float32)
    ckpt = ["op" if i % 2 == 1 else None for i in range(4)] if knobs["checkpointing"] == "op" else ["full"] * 4
    assert model._ckpt_block == ckpt  # the reference decoder's own checkpointing, before sharding
    assert any("fully_shard on 4 blocks" in n for n in notes)
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    losses = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), batches)
    assert all(math.isfinite(v) for v in losses) and losses[2] < losses[0]  # batch 0 again, after two steps
    assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters()))


def test_apply_takes_the_config_layout_and_refuses_deepspeed(group):
    model, batches = _model()
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=1)
    cfg = to_fsdp2_config(Strategy(engine="fsdp2", checkpointing="mlp", checkpoint_layers=1), TINY, TRAINING, hw)
    fsdp2.apply(model, cfg)
    assert model.layers[0].checkpoint_module == "mlp" and model.layers[1].checkpoint_module is None
    assert math.isfinite(_train(model, torch.optim.AdamW(model.parameters(), foreach=True), batches, steps=1)[0])
    with pytest.raises(ValueError, match="engine fsdp2"):
        fsdp2.apply(_model()[0], Strategy(engine="deepspeed"))
    with pytest.raises(ValueError, match="fsdp2 layout"):
        fsdp2.apply(_model()[0], {"engine": "deepspeed"})


def _config(**knobs):
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=1)
    return to_fsdp2_config(Strategy(engine="fsdp2", micro_batch_size=2, **knobs), TINY, TRAINING, hw)


@pytest.mark.parametrize("knobs", [dict(checkpointing="op", checkpoint_every=2, reshard_after_forward=False),
                                   dict(checkpointing="attention", reduce_dtype="bf16"),
                                   dict(precision="fp16", offload_params="cpu", checkpointing="full")])
def test_snippet_compiles_and_names_the_knobs(knobs):
    cfg = _config(**knobs)
    text = fsdp2.snippet(cfg)
    compile(text, "fsdp2_snippet.py", "exec")
    assert "import autotune" not in text and "from autotune" not in text
    assert f"RESHARD_AFTER_FORWARD = {cfg['fully_shard']['reshard_after_forward']}" in text
    assert f"reduce_dtype=torch.{cfg['mp_policy']['reduce_dtype']}" in text
    assert f"param_dtype=torch.{cfg['mp_policy']['param_dtype']}" in text
    assert f"CHECKPOINTED = {cfg['activation_checkpointing']['blocks']}" in text
    assert "foreach=True" in text and "clip_grad_norm_(model.parameters(), 1.0)" in text
    assert ('offload_policy=CPUOffloadPolicy(pin_memory=device_type == "cuda")' in text) == (knobs.get("offload_params") == "cpu")
    assert ("scaler = ShardedGradScaler(device=" in text) == (knobs.get("precision") == "fp16")
    assert ("def op_sac_context" in text) == (knobs.get("checkpointing") == "op")


@pytest.mark.parametrize("knobs", [dict(checkpointing="op", checkpoint_every=2, reshard_after_forward=False),
                                   dict(checkpointing="attention", reduce_dtype="bf16"),
                                   dict(precision="fp16", offload_params="cpu", checkpointing="full")])
def test_snippet_runs(group, knobs):
    """The snippet itself shards the model and trains it (one process, gloo)."""
    cfg = _config(**knobs)
    ns: dict = {}
    exec(compile(fsdp2.snippet(cfg), "fsdp2_snippet.py", "exec"), ns)
    model, batches = _model()
    optimizer = ns["shard"](model)
    if "scaler" in ns:  # fp16: the loss scaler is on (a CUDA-only scaler would disable itself here)
        assert ns["scaler"].is_enabled() and ns["scaler"].get_scale() == 2.0 ** 16
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.layers)
    before = float(model(**batches[0])["loss"].detach())
    for _ in range(3):
        ns["train_step"](model, optimizer, batches[:1])
    after = float(model(**batches[0])["loss"].detach())
    assert math.isfinite(after) and after < before


def _hf_model():
    """A tiny Hugging Face Llama (sdpa) and two batches of its own kind."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    batches = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 128, (2, 16)) for _ in range(2))]
    return model, batches


@pytest.mark.parametrize("through", ["apply", "snippet"])
def test_hf_selective_through_apply_and_the_snippet(group, through):
    """selective on a Hugging Face model under fsdp2: the attention function of every 2nd block
    checkpointed through AttentionInterface (autotune.apply, or the snippet's inlined copy), then
    sharded and trained."""
    from torch.distributed.fsdp import FSDPModule

    model, batches = _hf_model()
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=1)
    spec = ModelSpec(name="tiny-hf", num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=128, max_position_embeddings=128, implementation="hf")
    cfg = to_fsdp2_config(Strategy(engine="fsdp2", micro_batch_size=2, checkpointing="selective", checkpoint_every=2),
                          spec, TRAINING, hw)
    if through == "apply":
        notes = fsdp2.apply(model, cfg)
        assert "AttentionInterface function 'autotune_selective_sdpa'" in notes[0]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    else:
        text = fsdp2.snippet(cfg)
        assert "def checkpoint_attention_core" in text and "import autotune" not in text
        ns: dict = {}
        exec(compile(text, "fsdp2_snippet.py", "exec"), ns)
        optimizer = ns["shard"](model)
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.model.layers)
    assert model.config._attn_implementation == "autotune_selective_sdpa"
    assert [getattr(b.self_attn, "_autotune_recompute_core", False) for b in model.model.layers] == [False, True, False]
    losses = _train(model, optimizer, batches)
    assert all(math.isfinite(v) for v in losses) and losses[2] < losses[0]


_CP_RANK = """
import json, os, sys
import torch
import torch.distributed as dist
from autotune.engine_configs import to_fsdp2_config
from autotune.models import fsdp2
from autotune.models.reference import build_model, synthetic_batch
from autotune.presets import gpu_from_name
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy

spec = ModelSpec(name="tiny", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=172, vocab_size=512, max_position_embeddings=128)
hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=2)
layout = to_fsdp2_config(Strategy(engine="fsdp2", context_parallel_size=2, precision="fp32", micro_batch_size=1),
                         spec, TrainingSpec(seq_len=32, global_batch_size=1), hw)
dist.init_process_group("gloo")
ns = {}
exec(compile(fsdp2.snippet(layout), "fsdp2_snippet.py", "exec"), ns)
torch.manual_seed(0)
model = build_model(spec)
ns["shard"](model)
p = next(model.parameters())
x, y = synthetic_batch(spec, 1, 32, seed=0)
batch = {"input_ids": x.clone(), "labels": y.clone()}
out = {"cp_mesh": [ns["CP_MESH"].mesh_dim_names, ns["CP_MESH"].size()],
       "param_mesh": [p.device_mesh.mesh_dim_names, p.device_mesh.size()]}
try:
    with ns["context_parallel_batch"](model, batch):
        out["shard"] = batch["input_ids"][0].tolist()
        model(**batch)["loss"].backward()
    out["error"] = None
except NotImplementedError as err:
    out["error"] = str(err).splitlines()[0]
out["full"] = x[0].tolist()
print("RESULT " + json.dumps(out))
dist.barrier()  # both ranks past their last collective before the teardown (gloo can abort at exit)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_context_parallel_snippet_on_two_cpu_ranks(tmp_path):
    """The CP snippet on 2 gloo ranks: shard() builds torchtitan's dp_shard x cp mesh (cp of 2) and
    shards every parameter over the flattened dp_shard_cp; context_parallel_batch splits the batch
    head-tail (rank 0: chunks 0 and 3 of 4). torch's ring attention then needs CUDA's sdpa kernels:
    on the CPU the forward stops at the first attention with the error the README names."""
    import json
    import sys

    from conftest import run_ranks

    results = []
    for text in run_ranks(tmp_path, [sys.executable, "-c", _CP_RANK], timeout=180):
        line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    for rank, r in enumerate(results):
        assert r["cp_mesh"] == [["cp"], 2] and r["param_mesh"] == [["dp_shard_cp"], 2]
        chunks = [r["full"][i * 8:(i + 1) * 8] for i in range(4)]
        assert r["shard"] == chunks[rank] + chunks[3 - rank]  # torch's _HeadTailLoadBalancer
        if not torch.cuda.is_available():
            assert r["error"] == ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a "
                                  "sharding strategy registered.")
