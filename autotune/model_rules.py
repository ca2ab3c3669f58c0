"""What the memory model can size of a described model: the rules autotune.config applies to the
model section (a mixture-of-experts or latent-attention model other than Mixtral / Qwen3-MoE /
Qwen2-MoE / DeepSeek-V2's uniform blocks is refused; a mix of sliding and full
layers at a sequence that builds the sliding masks is refused), and the model section's list checker."""

from __future__ import annotations

from typing import Any, Optional

from autotune.checks import Checker, int_, show
from autotune.errors import ConfigError
from autotune.hf_moe import training_noise
from autotune.spec import ModelSpec, TrainingSpec


def int_tuple(low: int, high: int) -> Checker:
    """A list of integers in [low, high] as a tuple (ModelSpec is frozen and hashed)."""
    item = int_(low, high)

    def check(value: Any, path: str) -> tuple[int, ...]:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list of integers, but got {show(value)}"[:200], path=path)
        return tuple(item(v, f"{path}[{i}]") for i, v in enumerate(value))

    return check


def _text_config(hf_path: Optional[str]) -> dict:
    """The config.json (its text_config when nested); {} without a readable file."""
    if not hf_path:
        return {}
    import json

    try:
        with open(hf_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if "num_hidden_layers" in cfg or "text_config" not in cfg else cfg["text_config"]


def check_stated_balance(spec: ModelSpec) -> None:
    """The stated load-imbalance factors fit the model: only a MoE model has them; the busiest expert
    cannot take more than every token (moe_load_imbalance <= experts / top-k: top-k picks distinct
    experts); an EP rank's received rows average its experts, so not above the busiest expert's, and its
    rows over a step's blocks average its dispatches, so not above the busiest dispatch's."""
    expert, rank, least = spec.moe_load_imbalance, spec.ep_rank_imbalance, spec.moe_min_load
    if (expert or rank or spec.ep_step_imbalance or least is not None) and not spec.is_moe:
        key = ("moe_load_imbalance" if expert else "ep_rank_imbalance" if rank else
               "ep_step_imbalance" if spec.ep_step_imbalance else "moe_min_load")
        raise ConfigError(f"{key} is stated for a model without routed experts (num_experts 0)", path=f"model.{key}")
    if not spec.is_moe:
        return
    from autotune.memory.moe import expert_cap, expert_imbalance

    most = expert_cap(spec)
    if expert and expert > most:
        raise ConfigError(f"moe_load_imbalance {expert} is above experts / top-k = {most:g}: the busiest expert "
                          f"would take more than every token", path="model.moe_load_imbalance")
    if rank and rank > expert_imbalance(spec):
        raise ConfigError(f"ep_rank_imbalance {rank} is above the busiest expert's factor "
                          f"{expert_imbalance(spec):g} (moe_load_imbalance): a rank's received rows average "
                          f"its experts", path="model.ep_rank_imbalance")
    step, busiest = spec.ep_step_imbalance, rank or expert_imbalance(spec)
    if step and step > busiest:
        raise ConfigError(f"ep_step_imbalance {step} is above the busiest rank's dispatch factor {busiest:g} "
                          f"({'ep_rank_imbalance' if rank else 'moe_load_imbalance'}): a rank's rows over a "
                          f"step's blocks average its dispatches", path="model.ep_step_imbalance")


LIGER_KERNEL_CONFIG: dict[str, bool] = {"rms_norm": True, "rope": False, "swiglu": False, "cross_entropy": False,
                                        "fused_linear_cross_entropy": False}
"""Liger's kernels ``rms_norm_kernel: liger`` swaps into a Hugging Face model: the RMSNorm alone, what the
memory model sizes (its other kernels change tensors it sizes as transformers'). The ``kernel_config`` of
transformers.integrations.liger ``apply_liger_kernel``, which HF Trainer calls with
``TrainingArguments.liger_kernel_config`` when ``use_liger_kernel`` is set."""


def check_norm_kernel(spec: ModelSpec) -> None:
    """Liger's RMSNorm (``rms_norm_kernel: liger``) is sized for a dense decoder's ``rmsnorm`` (Liger's llama
    casting mode): another norm, or a MoE / latent-attention model, is refused in one line."""
    if spec.rms_norm_kernel == "torch":
        return
    if spec.norm != "rmsnorm":
        raise ConfigError(f"rms_norm_kernel liger is sized for norm rmsnorm (Liger's llama casting), but the model's "
                          f"norm is {spec.norm}", path="model.rms_norm_kernel")
    if spec.is_moe or spec.is_mla:
        raise ConfigError("rms_norm_kernel liger is sized for dense decoders, not a mixture-of-experts or "
                          "latent-attention model", path="model.rms_norm_kernel")


def norm_kernel_note(spec: ModelSpec) -> Optional[str]:
    """What ``rms_norm_kernel: liger`` leaves as an upper bound (None under torch's RMSNorm)."""
    if spec.rms_norm_kernel != "liger":
        return None
    return ("model.rms_norm_kernel liger: the norms' backward makes no temporaries (Liger writes dX into dY); "
            "their saved tensors are sized as torch's RMSNorm, 4 h bytes per token and norm above Liger's")


def check_modelled(spec: ModelSpec, hf_path: Optional[str]) -> None:
    """A mixture-of-experts or latent-attention model is described exactly (its parameter count);
    the memory model sizes the routed MoE blocks of Mixtral / Qwen3-MoE (autotune.memory.moe
    ``not_sized``, docs/moe.md), Qwen2-MoE's (its gated shared expert) and DeepSeek-V2's (its shared
    experts and latent attention, autotune.memory.mla), no other layout's activations (dense layers,
    biases, other routers): those are refused in one line, never sized as the dense decoder
    they are not."""
    from autotune.memory.moe import not_sized

    parts = []
    cfg = _text_config(hf_path)
    why = not_sized(spec, cfg.get("model_type"))
    if spec.is_moe and why:
        parts.append(f"mixture-of-experts ({spec.num_experts} experts, top-{spec.num_experts_per_tok})")
    if spec.is_mla and why:
        parts.append(f"multi-head latent attention (kv_lora_rank {spec.kv_lora_rank})")
    if spec.is_moe and not parts and cfg.get("output_router_logits"):
        # the model then keeps every layer's router logits for load_balancing_loss_func (modeling_mixtral.py)
        raise ConfigError(f"{hf_path}: output_router_logits: true adds the auxiliary load-balancing loss, whose "
                          "tensors (every layer's router logits, kept to the loss) are not sized; set it false",
                          path="model.hf_config")
    noise = training_noise(cfg) if spec.is_moe and not parts else None
    if noise:
        raise ConfigError(f"{hf_path}: {noise} adds training-time tensors that are not sized; set it to null or 0",
                          path="model.hf_config")
    if parts:
        where = f"{hf_path}: " if hf_path else ""
        raise ConfigError(f"{where}{' with '.join(parts)} is described exactly ({spec.num_parameters:,} parameters) "
                          f"but its activations are not modelled yet" + (f" (sized: {why})" if why else ""),
                          path="model.hf_config" if hf_path else ("model.num_experts" if spec.is_moe
                                                                  else "model.kv_lora_rank"))


def check_model_training(model: ModelSpec, training: TrainingSpec) -> None:
    """What the memory model cannot size for this model at this training setup: one-line error."""
    from autotune.memory.activations import _sliding_mask_built

    mixed = model.sliding_window_layers is not None and model.sliding_window_layers < model.num_hidden_layers
    if mixed and _sliding_mask_built(model, training.seq_len):
        # HF sdpa from this length builds the sliding layers' masks and passes is_causal to the full
        # layers (transformers masking_utils.py _ignore_causal_mask_sdpa); activations.py sizes a mask
        # for every layer or for none. Eager attention's masks are num_attention_masks, exact.
        raise ConfigError(
            f"{model.sliding_window_layers} of {model.num_hidden_layers} layers slide over {model.sliding_window} "
            f"tokens: at seq_len {training.seq_len} transformers builds their masks and not the other layers'; "
            f"that mix is not modelled: use seq_len < {model.sliding_window}", path="training.seq_len")
