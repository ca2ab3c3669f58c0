"""autotune.apply_checkpointing on real modules: a plain nn.Module with a ModuleList of blocks, the
reference decoder (set_checkpointing) and a Hugging Face model. Checkpointing must keep the
gradients exactly and reduce what autograd saves for backward."""

import os

import pytest

torch = pytest.importorskip("torch")

import autotune  # noqa: E402
from autotune.models.checkpointing import apply_checkpointing  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x, scale=1.0):
        return x + scale * self.down(torch.nn.functional.gelu(self.up(x)))


class Plain(torch.nn.Module):
    """No set_checkpointing, no HF API: only a list of blocks."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.ModuleList([torch.nn.Linear(d, 1)])  # a shorter list: not the blocks

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x, scale=0.5)
        return self.head[0](x).pow(2).mean()


def saved_bytes_and_grads(model, x):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x)
    model.zero_grad()
    loss.backward()
    return sum(saved), [p.grad.clone() for p in model.parameters()]


def test_plain_module_first_n_blocks_checkpointed_same_gradients_less_saved():
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32)
    model = Plain()
    base_saved, base_grads = saved_bytes_and_grads(model, x)
    notes = autotune.apply_checkpointing(model, "full", num_layers=2)
    assert notes == ["forward of the first 2 of 4 blocks wrapped in torch.utils.checkpoint"]
    half_saved, half_grads = saved_bytes_and_grads(model, x)
    apply_checkpointing(model, "full")  # all blocks (the first two are not wrapped twice)
    all_saved, all_grads = saved_bytes_and_grads(model, x)
    assert all_saved < half_saved < base_saved
    for grads in (half_grads, all_grads):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(base_grads, grads))


def test_refusals_are_value_errors_that_say_what_to_do():
    with pytest.raises(ValueError, match="must be one of none, selective, attention, mlp, op, full"):
        apply_checkpointing(Plain(), "sometimes")
    with pytest.raises(ValueError, match="set_checkpointing"):
        apply_checkpointing(Plain(), "selective", 2)
    with pytest.raises(ValueError, match="cannot checkpoint 9 blocks"):
        apply_checkpointing(Plain(), "full", 9)
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        apply_checkpointing(torch.nn.Linear(2, 2), "full")
    with pytest.raises(ValueError, match="block 0 .Block. has no attention module .looked for self_attn"):
        apply_checkpointing(Plain(), "attention")
    assert apply_checkpointing(Plain(), "none") == [] and apply_checkpointing(Plain(), "full", 0) == []


def test_reference_decoder_uses_its_own_set_checkpointing():
    from autotune.presets import model_from_name
    from autotune.models.reference import build_model

    model = build_model(model_from_name("tiny-llama"))
    apply_checkpointing(model, "selective", 1)
    blocks = [m for m in model.modules() if hasattr(m, "checkpoint_core")]
    assert [b.checkpoint_core for b in blocks][:2] == [True, False]


def test_hf_model_prefix_of_layers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    notes = apply_checkpointing(model, "full", 2)
    assert notes == ["HF per-layer gradient_checkpointing flags: first 2 of 3 layers"]
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, True, False]


def _tiny_llama(transformers, **kw):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, **kw)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


@pytest.mark.parametrize("layers, recomputed", [(2, [0, 1]), ([0, 2], [0, 2])])
def test_hf_selective_recomputes_the_attention_core_of_the_chosen_layers_only(layers, recomputed):
    """selective on a Hugging Face model: the attention function (here a counting one registered
    with transformers' AttentionInterface, wrapping sdpa) runs once more, in backward, for exactly
    the chosen layers; loss and gradients are the uncheckpointed model's; transformers' own
    functions stay as they were."""
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def counting(module, *args, **kwargs):
        calls.append((phase[0], module.layer_idx))
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("autotune_test_counting", counting)
    phase = ["forward"]
    ids = torch.randint(0, 128, (2, 16))
    results = []
    for g in ("none", "selective"):
        model = _tiny_llama(transformers, attn_implementation="autotune_test_counting")
        notes = apply_checkpointing(model, g, layers)
        calls.clear()
        phase[0] = "forward"
        loss = model(input_ids=ids, labels=ids).loss
        phase[0] = "backward"
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()], sorted(calls)))
    (base_loss, base_grads, base_calls), (loss, grads, sel_calls) = results
    assert base_calls == [("forward", i) for i in range(3)]
    assert sel_calls == sorted([("forward", i) for i in range(3)] + [("backward", i) for i in recomputed])
    assert model.config._attn_implementation == "autotune_selective_autotune_test_counting"
    assert "AttentionInterface function 'autotune_selective_autotune_test_counting'" in notes[0]
    assert loss == pytest.approx(base_loss)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(base_grads, grads))
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert ALL_ATTENTION_FUNCTIONS["autotune_test_counting"] is counting
    apply_checkpointing(model, "selective", [1])  # applied again: that choice replaces the first
    assert [getattr(layer.self_attn, "_autotune_recompute_core", False) for layer in model.model.layers] == [
        False, True, False]
    assert model.config._attn_implementation == "autotune_selective_autotune_test_counting"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_selective_keeps_gradients_and_saves_less(attn):
    """sdpa and eager (the model file's own eager_attention_forward, with its mask): the checkpointed
    attention core no longer saves its internals (the s x s probabilities for eager)."""
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 128, (2, 32))
    results = []
    for g in ("none", "selective"):
        model = _tiny_llama(transformers, attn_implementation=attn)
        apply_checkpointing(model, g)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((sum(saved), loss.item(), [p.grad.clone() for p in model.parameters()]))
    (base_saved, base_loss, base_grads), (saved, loss, grads) = results
    assert model.config._attn_implementation == f"autotune_selective_{attn}"
    assert saved < base_saved and loss == pytest.approx(base_loss)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(base_grads, grads))


def test_hf_selective_refuses_a_model_without_the_attention_interface():
    transformers = pytest.importorskip("transformers")
    model = _tiny_llama(transformers)
    model.set_attn_implementation = lambda name: None  # as transformers does for such models: a warning, no change
    with pytest.raises(ValueError, match="does not dispatch its attention through transformers' AttentionInterface"):
        apply_checkpointing(model, "selective", 1)


@pytest.mark.parametrize("granularity", ["attention", "mlp", "op"])
def test_module_granularities_keep_gradients_and_save_less(granularity):
    """attention / mlp / op on the reference decoder (its set_checkpointing) and on Hugging Face models
    (the module of each layer, or the layer under the op-level policy, wrapped; Granite-MoE's feed-forward
    is its ``block_sparse_moe``, where mlp checkpointing once failed): same loss and gradients, less saved
    for backward."""
    transformers = pytest.importorskip("transformers")
    from autotune.presets import model_from_name
    from autotune.models.reference import build_model

    ids = torch.randint(0, 128, (2, 16))
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=128)
    granite = transformers.GraniteMoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                                            num_local_experts=4, num_experts_per_tok=2)
    builders = [lambda: build_model(model_from_name("tiny-llama")),
                lambda: transformers.AutoModelForCausalLM.from_config(cfg),
                lambda: transformers.AutoModelForCausalLM.from_config(granite)]
    for build in builders:
        results = []
        for g in ("none", granularity):
            torch.manual_seed(0)
            model = build().train()
            notes = apply_checkpointing(model, g, 2)
            if g != "none" and hasattr(model, "config"):  # HF: the KV cache is off under recompute
                assert model.config.use_cache is False and "use_cache" in notes[0]
            saved = []

            def pack(t):
                saved.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(input_ids=ids, labels=ids)
            loss = out["loss"] if isinstance(out, dict) else out.loss
            loss.backward()
            results.append((sum(saved), loss.item(), [p.grad.clone() for p in model.parameters()]))
        (base_saved, base_loss, base_grads), (saved, loss, grads) = results
        assert saved < base_saved and loss == pytest.approx(base_loss)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(base_grads, grads))


_ZERO3_OP = """
import os, warnings
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed, torch
import autotune
deepspeed.init_distributed(dist_backend="gloo")
class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
    model = Blocks()
plain = Blocks()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    partitioned = autotune.apply_checkpointing(model, "op")
    autotune.apply_checkpointing(plain, "op")
print(sum("ZeRO-3" in str(w.message) for w in caught), sum("ZeRO-3" in n for n in partitioned))
"""


@pytest.mark.slow  # a DeepSpeed process
def test_op_on_a_zero3_partitioned_model_warns(tmp_path):
    """A hand-written apply_checkpointing(model, "op") on parameters ZeRO-3 has partitioned (zero.Init) warns
    and says so in its notes (the strategy rules refuse the combination: docs/engines.md); a plain model does
    not."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    script = tmp_path / "z3op.py"
    script.write_text(_ZERO3_OP)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PORT": str(29600 + os.getpid() % 300)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["1", "1"], out.stdout
