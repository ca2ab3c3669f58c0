"""autotune.models.long_context on a tiny Hugging Face Llama built from its config (fp32, CPU): the
tiled loss and the tiled MLP give the untiled gradients, the activation offload moves the
checkpointed inputs to host memory and keeps the gradients, and Ulysses on 2 gloo ranks (real
DeepSpeed engine) gives one rank's loss and gradients. The 2-rank check runs this file under
torchrun (``_ulysses_rank``)."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autotune.models import long_context as lc  # noqa: E402


def _llama(vocab: int = 256, tied: bool = False) -> "torch.nn.Module":
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=vocab, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model, ids, labels):
    m = copy.deepcopy(model)
    loss = m(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), _grads(m)


def _assert_same(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


def test_tiled_loss_gives_the_untiled_loss_and_gradients():
    model = _llama()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 37), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored tokens, unevenly over the tiles
    want_loss, want = _reference(model, ids, labels)
    m = copy.deepcopy(model)
    lc.use_long_context_loss(m, tiled=True, shards=5)  # 74 tokens in 5 tiles, the last shorter
    out = m(input_ids=ids, labels=labels)
    assert out.logits is None  # the whole logits never exist
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want_loss, rtol=1e-6, atol=1e-6)
    _assert_same(_grads(m), want)
    assert want["lm_head.weight"].abs().sum() > 0


def test_tiled_head_is_told_the_loss_gradient_of_gradient_accumulation():
    model = _llama()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(7))
    ref = copy.deepcopy(model)
    (ref(input_ids=ids, labels=ids, use_cache=False).loss / 4).backward()  # a loop of GAS 4
    want = _grads(ref)
    for gas, ok in ((4, True), (1, False)):  # told GAS 4: exact; not told: the head's gradient 4x too big
        m = copy.deepcopy(model)
        lc.use_long_context_loss(m, tiled=True, shards=3, gradient_accumulation_steps=gas)
        loss = m(input_ids=ids, labels=ids).loss
        (loss / 4).backward()
        torch.testing.assert_close(loss.detach(), ref(input_ids=ids, labels=ids, use_cache=False).loss.detach())
        got = _grads(m)
        torch.testing.assert_close(got["model.norm.weight"], want["model.norm.weight"])  # the hidden path
        head_ok = torch.allclose(got["lm_head.weight"], want["lm_head.weight"], rtol=1e-5, atol=1e-7)
        assert head_ok is ok


@pytest.mark.parametrize("tiled", [True, False])
def test_hf_trainer_with_the_long_context_loss_takes_the_plain_models_step(tmp_path, tiled):
    """HF Trainer over GAS 2 micro-batches with uneven label counts: Trainer passes num_items_in_batch
    and does not divide by GAS (trainer.py training_step), the plain model returns sum / num_items;
    the long-context loss honours it and keeps the model's signature (else Trainer drops the batch's
    columns), so one SGD step equals the plain model's."""
    from transformers import Trainer, TrainingArguments

    model = _llama()
    g = torch.Generator().manual_seed(3)
    data = []
    for i in range(2):
        ids = torch.randint(0, 256, (32,), generator=g)
        labels = ids.clone()
        labels[: 3 + 9 * i] = -100  # 28 and 19 counted tokens: a mean of means is not the token mean
        data.append({"input_ids": ids, "labels": labels})

    def step(m):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                 max_steps=1, learning_rate=0.5, optim="sgd", max_grad_norm=0.0, report_to=[],
                                 use_cpu=True, save_strategy="no", logging_strategy="no", lr_scheduler_type="constant")
        trainer = Trainer(model=m, args=args, train_dataset=data)
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(data)  # the same order
        trainer.train()
        return {n: p.detach().clone() for n, p in m.named_parameters()}

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = step(copy.deepcopy(model))
    m = copy.deepcopy(model)
    lc.use_long_context_loss(m, tiled=tiled, shards=3, gradient_accumulation_steps=2)
    got = step(m)
    assert (want["lm_head.weight"] - start["lm_head.weight"]).abs().max() > 0
    _assert_same({n: got[n] - start[n] for n in got}, {n: want[n] - start[n] for n in want}, rtol=1e-4, atol=1e-7)


def test_tiled_tied_head_gives_the_untiled_gradients():
    model = _llama(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    want_loss, want = _reference(model, ids, ids)
    m = copy.deepcopy(model)
    lc.use_long_context_loss(m, tiled=True, shards=2)
    m(input_ids=ids, labels=ids).loss.backward()
    _assert_same(_grads(m), want)
    assert getattr(m.lm_head.weight, "ds_grad_is_ready", True)  # left ready for DeepSpeed's backward hook


@pytest.mark.parametrize("tiled", [True, False])
def test_tiled_loss_of_granitemoe_divides_by_logits_scaling(tiled):
    """Granite-MoE divides its logits by logits_scaling before the loss (modeling_granitemoe.py
    GraniteMoeForCausalLM.forward): the long-context loss (tiled, and untiled as Ulysses runs it) gives the
    model's own loss and gradients, tied head, embedding and residual multipliers included."""
    from transformers import AutoModelForCausalLM, GraniteMoeConfig

    torch.manual_seed(0)
    cfg = GraniteMoeConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=32, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256, tie_word_embeddings=True, embedding_multiplier=12.0,
                           residual_multiplier=0.22, logits_scaling=6.0, attention_multiplier=0.25)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    want_loss, want = _reference(model, ids, ids)
    m = copy.deepcopy(model)
    lc.use_long_context_loss(m, tiled=tiled, shards=3)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-6, atol=1e-6)
    _assert_same(_grads(m), want)


def test_loss_tiles_are_one_gib_of_fp32_logits():
    assert lc.loss_tiles(1, 1000) == 1
    assert lc.loss_tiles(131072, 128256) == 63  # 62.6 GiB of fp32 logits (Llama-3 vocab, 128k tokens)
    assert lc.loss_tiles(2 ** 30 // (4 * 1000), 1000) == 1
    assert lc.loss_tiles(2 ** 30 // (4 * 1000) + 1, 1000) == 2


def test_tiled_mlp_gives_the_plain_output_and_gradients():
    model = _llama()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    want_loss, want = _reference(model, ids, ids)
    m = copy.deepcopy(model)
    assert lc.tile_mlp(m, shards=3) == 2
    x = torch.randn(2, 40, 64, requires_grad=True)
    plain = copy.deepcopy(model).model.layers[0].mlp
    torch.testing.assert_close(m.model.layers[0].mlp(x), plain(x), rtol=1e-6, atol=1e-6)
    loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss)
    _assert_same(_grads(m), want)
    assert lc.tile_mlp(m) == 2 and m.model.layers[0].mlp._autotune_tiled  # applied once, not twice


def test_tiled_mlp_of_gpt2_takes_strided_tiles():
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(6))  # batch 2: strided seq tiles
    want_loss, want = _reference(model, ids, ids)
    m = copy.deepcopy(model)
    assert lc.tile_mlp(m) == 2  # ceil(48 / 32) = 2 tiles (Conv1D views its input)
    m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    _assert_same(_grads(m), want)


def test_offload_moves_the_checkpointed_inputs_to_host_and_keeps_the_gradients():
    model = _llama()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    want_loss, want = _reference(model, ids, ids)
    m = copy.deepcopy(model)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    lc.host_offload_bytes(reset=True)
    before = lc.host_offload_bytes()["live"]
    with lc.offload_activations():
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    # each block's input hidden states [2, 32, 64] fp32 (the other inputs are keyword arguments)
    assert lc.host_offload_bytes()["live"] - before == 2 * (2 * 32 * 64 * 4)
    loss.backward()
    assert lc.host_offload_bytes()["live"] == before  # released with the graph
    _assert_same(_grads(m), want)
    torch.testing.assert_close(loss.detach(), want_loss)


def test_ulysses_refuses_eager_attention_in_one_line():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_llama().config, attn_implementation="eager")
    with pytest.raises(ValueError) as err:
        lc.register_ulysses(model, 2, 1, 64)
    assert "eager" in str(err.value) and "\n" not in str(err.value)
    assert lc.register_ulysses(model, 1, 1, 64) is None  # degree 1: nothing to register


# ------------------------------------------------------------------------------------ Ulysses, 2 ranks


def _ulysses_rank(stage: int, tiled: bool, out: str) -> None:
    """One rank of the 2-rank check: the 1-rank reference on the whole sample first (before the
    attention function is replaced), then Ulysses SP 2 through a DeepSpeed engine."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = torch.distributed.get_rank()
    model = _llama(tied=True)  # as Llama-3.2-1B: the tiled head's gradient meets the embedding's in backward
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, 40:50] = -100  # the second rank's shard counts fewer tokens
    want_loss, want = _reference(model, ids, labels)
    mpu = lc.register_ulysses(model, 2, 1, 64)
    lc.use_long_context_loss(model, mpu, tiled=tiled, shards=3 if tiled else None, zero_stage=stage)
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "sequence_parallel_size": 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config, mpu=mpu)
    batch = lc.shard_batch({"input_ids": ids, "labels": labels}, mpu)
    loss = engine(**batch).loss
    engine.backward(loss)
    got = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
    diff = {n: float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-12)) for n in want}
    # a DataLoader through DeepSpeed's adapter: each rank's sample in turn, shared by the group
    loader = torch.utils.data.DataLoader([{"input_ids": ids[0] + rank, "labels": ids[0] + rank}], batch_size=1)
    shards = [(b["input_ids"][0, 0].item(), b["position_ids"][0, 0].item(), b["position_ids"].shape[1])
              for b in lc.shard_batch(loader, mpu)]
    Path(f"{out}.{rank}").write_text(json.dumps({"loss": float(loss), "want_loss": float(want_loss),
                                                 "shape": list(batch["input_ids"].shape),
                                                 "max_rel_grad_diff": max(diff.values()), "loader": shards,
                                                 "first_ids": [int(ids[0, 0]), int(ids[0, 32])]}))
    torch.distributed.barrier()  # both ranks past their last collective: then tear down (gloo can abort at exit)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("stage,tiled", [(3, True)])  # ZeRO-3's reduce and the tiled head: the seed's scale
def test_ulysses_on_two_ranks_gives_one_ranks_loss_and_gradients(tmp_path, stage, tiled):
    from autotune.backends.launch import free_port

    out = tmp_path / "rank"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, str(stage), str(int(tiled)), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads(Path(f"{out}.{rank}").read_text())
        assert r["shape"] == [1, 32]  # half the sequence on each rank
        assert r["loss"] == pytest.approx(r["want_loss"], rel=1e-6)  # every rank: the whole sample's loss
        assert r["max_rel_grad_diff"] < 1e-5
        # the loader's two samples (rank 0's, then rank 1's: ids + 1), this rank's half of each
        first = r["first_ids"][rank]
        assert r["loader"] == [[first, 32 * rank, 32], [first + 1, 32 * rank, 32]]


if __name__ == "__main__":  # a rank of test_ulysses_on_two_ranks_gives_one_ranks_loss_and_gradients
    _ulysses_rank(int(sys.argv[1]), bool(int(sys.argv[2])), sys.argv[3])
