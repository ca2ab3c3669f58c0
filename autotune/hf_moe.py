"""Mixture-of-experts and latent-attention families of a Hugging Face config.json as ModelSpec
fields (on top of autotune.hf_config's Llama-shaped mapping): routed and shared experts, the
router, dense blocks, MLA, gpt-oss's sinks and biases. Each default below is the family's
transformers configuration class default (models/<kind>/configuration_<kind>.py), used only when
the file leaves the key out."""

from __future__ import annotations

from typing import Any

from autotune.errors import ConfigError

_UNSET = object()

# model_type -> (experts key, its default, top-k default, expert-width key or None (intermediate_size))
_ROUTED: dict[str, tuple[str, int, int, Any]] = {
    "mixtral": ("num_local_experts", 8, 2, None),
    "phimoe": ("num_local_experts", 16, 2, None),
    "granitemoe": ("num_local_experts", 8, 2, None),
    "gpt_oss": ("num_local_experts", 128, 4, None),
    "olmoe": ("num_experts", 64, 8, None),
    "qwen2_moe": ("num_experts", 60, 4, ("moe_intermediate_size", 1408)),
    "qwen3_moe": ("num_experts", 128, 8, ("moe_intermediate_size", 768)),
    "deepseek_v2": ("n_routed_experts", 64, 0, ("moe_intermediate_size", 1407)),
    "deepseek_v3": ("n_routed_experts", 256, 8, ("moe_intermediate_size", 2048)),
}
_EXPERT_ALIASES = ("num_local_experts", "num_experts", "n_routed_experts")
MOE_FAMILIES = tuple(_ROUTED)
ZERO3_LEAF_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""The families whose sparse MoE block DeepSpeed makes a ZeRO-3 leaf module by default (deepspeed 0.19
runtime/zero/leaf_module_config.py ``DEFAULT_LEAF_MODULE_CLASSES``, applied by the engine's
``_configure_distributed_model``): ``ModelSpec.zero3_leaf_block``."""
"""The mixture-of-experts model_type values described here (tests/data/hf/moe: one published
config.json of each, counted exactly against the meta-device model)."""

TRAINING_NOISE: dict[str, tuple[str, ...]] = {"olmoe": ("clip_qkv",), "mixtral": ("router_jitter_noise",)}
"""Keys of a family whose set value adds training-time tensors the memory model does not size: OLMoE's
``clip_qkv`` clamps q, k and v in place (clamp_'s backward keeps copies; modeling_olmoe.py OlmoeAttention),
Mixtral's ``router_jitter_noise`` multiplies the block input by a uniform draw (MixtralSparseMoeBlock.forward)."""


def training_noise(cfg: dict) -> str | None:
    """``key: value`` of the first TRAINING_NOISE key the config.json object ``cfg`` sets; None: none."""
    for key in TRAINING_NOISE.get(cfg.get("model_type", ""), ()):
        if cfg.get(key):
            return f"{key}: {cfg[key]}"
    return None


_MLA_DEFAULTS = {  # DeepseekV2Config / DeepseekV3Config
    "deepseek_v2": dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128, n_shared_experts=2, first_k_dense_replace=0),
    "deepseek_v3": dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128, n_shared_experts=1, first_k_dense_replace=3),
}


def moe_fields(cfg: dict, kind: str, out: dict[str, Any], path: str) -> dict[str, Any]:
    """The MoE / MLA fields of a ``kind`` in MOE_FAMILIES, given the Llama-shaped fields ``out``."""

    def val(key: str, default: Any = _UNSET) -> Any:
        if key in cfg:  # an explicit null is a value (DeepSeek-V2-Lite's q_lora_rank: null)
            return cfg[key]
        if default is _UNSET:
            raise ConfigError(f"{path} has no {key} (model_type {kind})", path="model.hf_config")
        return default

    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"{path}: model_type {kind} with {key}: {why}; not described", path="model.hf_config")

    experts_key, experts, top_k, width = _ROUTED[kind]
    layers = int(out["num_hidden_layers"])
    top_k = val("num_experts_per_tok", top_k or _UNSET)
    # the configuration classes alias the count (attribute_map: Qwen3MoeConfig num_experts -> num_local_experts,
    # OlmoeConfig num_local_experts -> num_experts, DeepseekV3Config num_local_experts -> n_routed_experts), and a
    # file saved by transformers 5 can carry it under the alias with the family's key null
    key = next((k for k in (experts_key, *_EXPERT_ALIASES) if cfg.get(k) is not None), experts_key)
    new: dict[str, Any] = dict(num_experts=val(key, experts), num_experts_per_tok=top_k)
    if width is not None:
        new["moe_intermediate_size"] = val(*width)
    if kind in ("qwen2_moe", "qwen3_moe"):
        # modeling_qwen2_moe.py / modeling_qwen3_moe.py Qwen*DecoderLayer: a sparse block unless
        # layer_idx in mlp_only_layers or (layer_idx + 1) % decoder_sparse_step != 0
        only = set(val("mlp_only_layers", None) or [])
        step = int(val("decoder_sparse_step", 1))
        new["dense_layers"] = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if kind in ("qwen2_moe", "qwen3_moe", "olmoe"):
        # Qwen2MoeTopKRouter / Qwen3MoeTopKRouter / OlmoeTopKRouter: top-k renormalised only under
        # norm_topk_prob (each config's default False), cast back to the model dtype; Qwen3-MoE's block
        # registers its experts before its router (Qwen3MoeSparseMoeBlock.__init__)
        new.update(router_norm_topk=bool(val("norm_topk_prob", False)), router_weights_cast=True,
                   router_after_experts=kind == "qwen3_moe")
    if kind == "granitemoe":
        # modeling_granitemoe.py GraniteMoeTopKRouter: topk of the fp32 logits, softmax over those k, cast back
        # (type_as); GraniteMoeMoE registers self.router before self.experts, GraniteMoeDecoderLayer its norms
        # before block_sparse_moe. GraniteMoeModel / DecoderLayer /
        # ForCausalLM: inputs_embeds * embedding_multiplier, residual + h * residual_multiplier, logits /
        # logits_scaling (GraniteMoeConfig's defaults 1.0: the ops run whatever the value)
        new.update(router_topk_softmax=True, router_logits_fp32=True, router_norm_topk=False, router_weights_cast=True,
                   norms_before_mlp=True,
                   embedding_multiplier=val("embedding_multiplier", 1.0),
                   residual_multiplier=val("residual_multiplier", 1.0), logits_scaling=val("logits_scaling", 1.0))
    if kind == "qwen2_moe":
        new.update(shared_expert_intermediate_size=val("shared_expert_intermediate_size", 5632),
                   shared_expert_gate=True, qkv_bias=bool(val("qkv_bias", True)))
    if kind == "qwen3_moe":
        new["qk_norm"] = "head"  # Qwen3MoeAttention q_norm / k_norm: RMSNorm(head_dim)
    if kind == "olmoe":
        # OlmoeAttention: q_norm RMSNorm(q_size), k_norm RMSNorm(kv_size) on the projections' outputs
        new["qk_norm"] = "full"
    if kind == "phimoe":
        # modeling_phimoe.py: LayerNorms with bias, q/k/v/o biased by attention_bias, lm_head_bias
        if not val("attention_bias", False):  # the LayerNorms keep their bias, ModelSpec.bias ties them
            refuse("attention_bias: false", "unbiased linears beside biased LayerNorms")
        # PhimoeTopKRouter (bias-free nn.Linear) -> sparsemixer: two rounds whatever num_experts_per_tok says
        # (memory.moe.not_sized refuses another top-k), the weights in the logits' (model) dtype;
        # input_jitter_noise > 0 multiplies the block input in place by a uniform draw twice
        # (PhimoeSparseMoeBlock.forward, then PhimoeTopKRouter.forward on the same tensor); router_jitter_noise
        # is the sparsemixer's epsilon (a threshold: no tensor)
        new.update(norm="layernorm", bias=True, lm_head_bias=bool(val("lm_head_bias", False)),
                   router_sparsemixer=True, router_weights_cast=True,
                   input_jitter_draws=2 if float(val("input_jitter_noise", 0.0) or 0.0) > 0 else 0)
    if kind == "gpt_oss":
        # modeling_gpt_oss.py: biased q/k/v/o (attention_bias), per-head sinks, router and expert
        # biases; layer_types alternate sliding_attention / full_attention over sliding_window
        # GptOssPreTrainedModel._supports_sdpa False: transformers runs eager attention, whose 4-D additive masks
        # are built per layer type (one full, one sliding: num_attention_masks); GptOssRMSNorm multiplies
        # the weight in fp32
        new.update(bias=bool(val("attention_bias", True)), attention_sinks=True, router_bias=True,
                   expert_bias=True, attn_implementation="eager", norm="rmsnorm_fp32", router_topk_softmax=True,
                   router_weights_cast=True, expert_clamped_swiglu=True, rotary_half_table=True,
                   experts_transposed=True)
        types = val("layer_types", None) or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                             for i in range(layers)]
        window = val("sliding_window", 128)
        sliding = sum(t == "sliding_attention" for t in types[:layers])
        if sliding and window is not None:
            new.update(sliding_window=int(window), sliding_window_layers=sliding,
                       num_attention_masks=2 if sliding < layers else 1)
    if kind in ZERO3_LEAF_FAMILIES:
        new["zero3_leaf_block"] = True
    if kind in ("mixtral", "phimoe") and cfg.get("sliding_window"):
        new["sliding_window"] = int(cfg["sliding_window"])
    if kind in _MLA_DEFAULTS:
        d = _MLA_DEFAULTS[kind]
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                refuse(key, "the biases of latent attention and its MLPs")
        new.update(q_lora_rank=val("q_lora_rank", d["q_lora_rank"]), kv_lora_rank=val("kv_lora_rank", d["kv_lora_rank"]),
                   qk_rope_head_dim=val("qk_rope_head_dim", d["qk_rope_head_dim"]),
                   qk_nope_head_dim=val("qk_nope_head_dim", d["qk_nope_head_dim"]),
                   v_head_dim=val("v_head_dim", d["v_head_dim"]))
        # modeling_deepseek_v2.py / _v3.py DecoderLayer: MoE from layer_idx >= first_k_dense_replace
        # (transformers reads no moe_layer_freq); the shared experts are one MLP of n_shared x width
        first = int(val("first_k_dense_replace", d["first_k_dense_replace"]) or 0)
        new["dense_layers"] = tuple(range(min(first, layers)))
        new["shared_expert_intermediate_size"] = int(val("n_shared_experts", d["n_shared_experts"]) or 0) * int(
            new["moe_intermediate_size"])
        new["router_after_experts"] = True  # DeepseekV2Moe / DeepseekV3MoE: self.experts, then self.gate
        if kind == "deepseek_v2":
            # modeling_deepseek_v2.py DeepseekV2TopkRouter: fp32 linear and softmax, "greedy" or
            # "group_limited_greedy" top-k (any other topk_method leaves its weights undefined)
            method = val("topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):
                refuse(f"topk_method {method}", "DeepseekV2TopkRouter runs greedy or group_limited_greedy only")
            new.update(router_fp32=True, router_group_limited=method == "group_limited_greedy")
        else:
            # modeling_deepseek_v3.py DeepseekV3TopkRouter: fp32 linear, sigmoid + e_score_correction_bias, the
            # noaux_tc group-limited top-k whatever topk_method says; DeepseekV3Attention: cos/sin rotary,
            # on the even/odd slices when rope_interleave (apply_rotary_pos_emb_interleave)
            experts, groups = int(new["num_experts"]), int(val("n_group", 8) or 1)
            if experts % groups:
                refuse(f"n_group {groups}", f"{experts} routed experts do not split into {groups} groups")
            new.update(router_fp32=True, router_sigmoid=True, router_norm_topk=bool(val("norm_topk_prob", True)),
                       mla_rotary="interleave" if val("rope_interleave", True) else "half")
    return new
