"""A Hugging Face ``config.json`` as ModelSpec fields: reading it, mapping each model family's keys,
and checking the parameter count: against the real model with torch + transformers, else by
accepting only the families whose description is proven exact (EXACT_FAMILIES)."""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from autotune.checks import show
from autotune.errors import ConfigError
from autotune.hf_moe import MOE_FAMILIES, moe_fields, training_noise
from autotune.spec import ModelSpec, TrainingSpec


EXACT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt2",
                  "gpt_neox") + MOE_FAMILIES
"""The model_type values whose analytic description (map_hf_config) is proven to have exactly the
parameters of the transformers model: tests/spec/test_hf_count.py and test_hf_moe.py build a published
config.json of each (tests/data/hf, tests/data/hf/moe) on the meta device and compare. Without torch +
transformers only these are accepted; any other model_type is refused (an unmapped structure would be
sized as the Llama-shaped decoder it is not). The MoE / MLA ones are then refused by
autotune.model_rules.check_modelled, with their exact count, until the memory model sizes them."""

HF_EXTRA = "pip install 'autotune[hf]'"
"""The install command of the optional dependencies that build a config.json's model (pyproject.toml)."""


def model_type(cfg: dict) -> str:
    """A config.json's model_type (transformers' default family, llama, when absent)."""
    return str(cfg.get("model_type") or "llama")


NESTED_TEXT = {"gemma3": "gemma3_text"}
"""Multimodal model_type values whose config.json nests the language model under ``text_config``,
with the model_type that ``text_config`` takes when it names none (transformers
models/gemma3/configuration_gemma3.py: Gemma3Config.sub_configs["text_config"] = Gemma3TextConfig)."""


FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072),
}
"""Architecture defaults of the families whose published files leave them out (Gemma-3's nested
text_config names only what differs): transformers models/gemma3/configuration_gemma3.py
Gemma3TextConfig's field defaults."""


def text_model_config(cfg: dict, path: str) -> dict:
    """The language model's config of a config.json: ``text_config`` (with its model_type) for a
    multimodal file that nests it, else the file itself. The job sizes and trains the text model;
    a nested file without a known text model_type is refused in one line."""
    nested = cfg.get("text_config")
    if not isinstance(nested, dict):
        return cfg
    kind = nested.get("model_type") or NESTED_TEXT.get(model_type(cfg))
    if not kind:
        raise ConfigError(f"{path}: text_config names no model_type and {show(model_type(cfg))} is not among the "
                          f"multimodal families whose text model is known ({', '.join(NESTED_TEXT)})",
                          path="model.hf_config")
    return {**nested, "model_type": kind}


def read_hf_config(path: str) -> dict[str, Any]:
    """The JSON object of an HF config.json; unreadable or not an object is a one-line ConfigError."""
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"file not found: {path}", path="model.hf_config") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"cannot read {path} as JSON ({type(err).__name__})", path="model.hf_config") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} must hold a JSON object", path="model.hf_config")
    return cfg


def check_exact_count(cfg: dict, fields_: dict, path: str) -> None:
    """With torch + transformers: the analytic description must reproduce the parameter count of
    the transformers model built from the file on the meta device (autotune.hf_count), or the file
    is refused in one line naming the difference. Without them: a model_type outside
    EXACT_FAMILIES is refused in one line naming the hf extra. Never silently mis-sized."""
    from autotune.hf_count import HFCountError, describe_difference, hf_parameter_count

    cfg = text_model_config(cfg, path)
    spec = ModelSpec(**{"name": "hf", **fields_})
    kind = model_type(cfg)
    try:
        exact = hf_parameter_count(cfg, spec.num_hidden_layers)
    except HFCountError as err:
        raise ConfigError(f"{path}: {err}", path="model.hf_config") from None
    if exact is None:
        if kind not in EXACT_FAMILIES:
            raise ConfigError(
                f"{path}: model_type {show(kind)} is not among the families described exactly without "
                f"transformers ({', '.join(EXACT_FAMILIES)}); its size cannot be checked: install the hf extra "
                f"({HF_EXTRA}) to build it and compare", path="model.hf_config")
    elif exact != spec.num_parameters:
        raise ConfigError(f"{path}: model_type {show(kind)}: {describe_difference(spec, exact)}",
                          path="model.hf_config")


def unchecked_note(cfg: dict, path: str, spec: ModelSpec) -> Optional[str]:
    """What autotune could not check of the config.json ``cfg`` (read from ``path``) it sized as ``spec``
    (None: nothing): without torch +
    transformers neither check_exact_count nor check_block_bytes can build the file, so a proven
    family's file is sized from its description alone (a switch no test covers, such as GPT-2's
    ``activation_function: relu``, would go unseen): said, never silent."""
    from autotune.hf_count import available

    if available():
        return None
    what = "parameter count was" if (spec.is_moe or spec.is_mla) else "parameter count and activations were"
    kind = model_type(text_model_config(cfg, path))
    return (f"{path}: sized from autotune's description of model_type {show(kind)} without torch and "
            f"transformers, so its {what} not checked against the transformers model; install the hf "
            f"extra ({HF_EXTRA}) to check them")


def _measured(spec: ModelSpec, cfg: dict) -> bool:
    """Whether check_block_bytes measures the model of the text config ``cfg``: torch and transformers
    installed, and a dense model or a mixture-of-experts / latent-attention one the memory model sizes
    (memory.moe.not_sized, no hf_moe.training_noise: the others are refused in one line by
    model_rules.check_modelled, naming what is not sized)."""
    from autotune import hf_blocks
    from autotune.memory.moe import not_sized

    if (spec.is_moe or spec.is_mla) and (not_sized(spec, model_type(cfg)) or training_noise(cfg)):
        return False
    return hf_blocks.available()


def _shrunk(cfg: dict, path: str, fields_of: Callable[[dict, str], dict]) -> tuple[dict, ModelSpec]:
    """The text model's config shrunk to CPU size (hf_blocks.shrink) and its ModelSpec (ConfigError if the
    shrunk file maps to none)."""
    from autotune import hf_blocks

    small_cfg = hf_blocks.shrink(text_model_config(cfg, path))
    return small_cfg, ModelSpec(**{"name": "hf", **fields_of(small_cfg, path)})


def warm_checks(cfg: dict, fields_: dict, path: str, fields_of: Callable[[dict, str], dict]) -> None:
    """Before check_exact_count and check_block_bytes in a torch-free process: one child process fills the
    cache for both (each would start its own, importing torch and transformers again). Never raises:
    what it could not fill, the checks compute and report themselves."""
    from autotune import hf_blocks

    spec = ModelSpec(**{"name": "hf", **fields_})
    if not _measured(spec, text_model_config(cfg, path)):
        return
    try:
        small_cfg, small = _shrunk(cfg, path, fields_of)
    except ConfigError:
        return
    hf_blocks.warm(text_model_config(cfg, path), spec.num_hidden_layers, small_cfg, small.attn_implementation)


BLOCK_TOLERANCE = 0.005
"""How far (relative) a measured block may be from the memory model's bytes (the per-family test's bound,
tests/memory/test_memory_hf_blocks.py)."""


def _block_bytes(small: ModelSpec, precision: str) -> list[float]:
    """The memory model's bytes of hf_blocks' compared blocks (1..) of the shrunk model ``small``: per block
    of its kind (a MoE model's dense blocks as memory/mixed.py sizes them), CPU, no checkpointing."""
    from autotune import hf_blocks
    from autotune.memory import activation_breakdown, block_activation_bytes_per_token
    from autotune.memory.mixed import kind_spec, layer_kinds
    from autotune.strategy import Strategy

    p, tokens = hf_blocks.PRECISIONS[precision], hf_blocks.BATCH * hf_blocks.SEQ
    if not (small.is_moe or small.is_mla):
        return [block_activation_bytes_per_token(small, p, hf_blocks.SEQ, "none", mask_bytes=p, device="cpu",
                                                 batch=hf_blocks.BATCH) * tokens] * (hf_blocks.BLOCKS - 1)
    training = TrainingSpec(seq_len=hf_blocks.SEQ, global_batch_size=hf_blocks.BATCH, precision=precision)
    strategy = Strategy(micro_batch_size=hf_blocks.BATCH, precision=precision)
    kinds = layer_kinds(small) or (False,) * small.num_hidden_layers  # True: a dense block
    # per_block_plain: the block's saved bytes, its per-block terms (grouped offsets, router weight copy) too
    return [activation_breakdown(kind_spec(small, dense), training, strategy, device="cpu").per_block_plain
            for dense in kinds[1:hf_blocks.BLOCKS]]


def check_block_bytes(cfg: dict, fields_: dict, path: str, fields_of: Callable[[dict, str], dict]) -> None:
    """With torch + transformers, for a dense model (any model_type: a proven family's file can set a
    switch no test covers, as GPT-2's ``activation_function: relu``) and a MoE / latent-attention model of
    a family the memory model sizes (a switch of a sized family, as a future router option, is caught the
    same way): the memory model's per-block activations (``_block_bytes``, CPU, no checkpointing) must be
    what the file's blocks keep for backward, shrunk to CPU size (autotune.hf_blocks), in bf16 and fp32
    and in every compared block, within BLOCK_TOLERANCE; else the file is refused in one line naming the
    worst block. A file the measurement cannot run is refused too: its activations cannot be checked.
    ``fields_of(cfg, path)``: ModelSpec fields of a config.json object (autotune.config's checked map)."""
    from autotune import hf_blocks
    from autotune.hf_count import HFCountError

    if not _measured(ModelSpec(**{"name": "hf", **fields_}), text_model_config(cfg, path)):
        return

    try:
        small_cfg, small = _shrunk(cfg, path, fields_of)
        measured = hf_blocks.saved_bytes_of_blocks(small_cfg, small.attn_implementation)
    except (ConfigError, HFCountError) as err:
        kind = model_type(text_model_config(cfg, path))
        why = str(err).split(": ", 1)[-1] if isinstance(err, ConfigError) else str(err)
        raise ConfigError(f"{path}: model_type {show(kind)}: its activations cannot be checked against transformers "
                          f"({why})",
                          path="model.hf_config") from None
    worst = (0.0, "", 0, 0, 0.0)
    for precision, blocks in measured.items():
        for i, (got, predicted) in enumerate(zip(blocks, _block_bytes(small, precision)), start=1):
            err_ = predicted / got - 1 if got else float("inf")
            if abs(err_) > abs(worst[0]):
                worst = (err_, precision, i, got, predicted)
    if abs(worst[0]) > BLOCK_TOLERANCE:
        err_, precision, i, got, predicted = worst
        raise ConfigError(
            f"{path}: model_type {show(model_type(text_model_config(cfg, path)))}: the memory model's block activations are {err_:+.2%} off what "
            f"transformers keeps for backward ({precision}, block {i} of the model shrunk to width 128: "
            f"{predicted:,.0f} predicted, {got:,} measured bytes); this file's forward is not described "
            f"exactly, its memory would be mis-sized", path="model.hf_config")


_Getter = Callable[..., Any]
"""``get(*keys, default=None)``: the first of ``keys`` the config sets, else ``default`` (required
when None: a one-line error names the file and the keys)."""


def map_hf_config(cfg: dict, path: str) -> dict[str, Any]:
    """ModelSpec fields of a Hugging Face config.json object (unchecked values; autotune.config
    checks them like explicit fields)."""
    cfg = text_model_config(cfg, path)
    kind = model_type(cfg)
    defaults = FAMILY_DEFAULTS.get(kind, {})
    cfg = {**defaults, **{k: v for k, v in cfg.items() if not (v is None and k in defaults)}}

    def get(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise ConfigError(f"{path} has none of {', '.join(keys)} (model_type {kind})", path="model.hf_config")
        return default

    name = str(cfg.get("_name_or_path") or kind)
    family = {"gpt2": _gpt2, "mpt": _mpt, "gpt_neox": _gpt_neox}.get(kind, _llama_like)
    out = family(cfg, get, name, kind)
    if kind == "gemma3_text":
        out.update(_gemma3_layers(cfg, path, int(out["num_hidden_layers"])))
    if kind in MOE_FAMILIES:
        out.update(moe_fields(cfg, kind, out, path))
    sliding = _qwen_sliding_layers(cfg, kind, int(out["num_hidden_layers"]))
    if sliding:
        raise ConfigError(f"{path}: model_type {kind} with use_sliding_window: true slides {sliding} of "
                          f"{out['num_hidden_layers']} layers (those from max_window_layers on); their masks "
                          f"are not modelled, so it cannot be sized exactly: set use_sliding_window: false",
                          path="model.hf_config")
    out["implementation"] = "hf"  # trained as the transformers class of this model_type
    return out


def _qwen_sliding_layers(cfg: dict, kind: str, layers: int) -> int:
    """Layers of a Qwen2/Qwen3 config that use sliding-window attention: with use_sliding_window, every
    layer from max_window_layers on (transformers models/qwen2/configuration_qwen2.py ``layer_types``),
    or those its explicit ``layer_types`` name."""
    if kind not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") or not cfg.get("use_sliding_window") or cfg.get("sliding_window", 4096) is None:
        return 0
    if cfg.get("layer_types"):
        return sum(t == "sliding_attention" for t in cfg["layer_types"])
    return max(0, layers - int(cfg.get("max_window_layers", 28)))


def _gpt2(cfg: dict, get: _Getter, name: str, kind: str) -> dict[str, Any]:
    """GPT-2 (transformers models/gpt2)."""
    d = get("n_embd", "hidden_size")
    out = dict(name=name, num_hidden_layers=get("n_layer"), hidden_size=d, num_attention_heads=get("n_head"),
               intermediate_size=cfg.get("n_inner") or 4 * d, vocab_size=get("vocab_size"),
               hidden_act=get("activation_function", default="gelu_new"),
               tie_word_embeddings=get("tie_word_embeddings", default=True), norm="layernorm", bias=True,
               position_embedding="learned", max_position_embeddings=get("n_positions", default=1024),
               attention_dropout=float(get("attn_pdrop", default=0.1)),
               hidden_dropout=float(max(get("resid_pdrop", default=0.1), get("embd_pdrop", default=0.1))))
    out["num_key_value_heads"] = out["num_attention_heads"]
    out["linear_addmm"] = True  # Conv1D: torch.addmm(bias, x, weight)
    return out


def _mpt(cfg: dict, get: _Getter, name: str, kind: str) -> dict[str, Any]:
    """MPT (llm-foundry / transformers models/mpt)."""
    d = get("d_model")
    attn = cfg.get("attn_config") or {}
    out = dict(name=name, num_hidden_layers=get("n_layers"), hidden_size=d, num_attention_heads=get("n_heads"),
               intermediate_size=int(get("expansion_ratio", default=4) * d), vocab_size=get("vocab_size"),
               hidden_act="gelu", tie_word_embeddings=True, norm="layernorm", bias=not get("no_bias", default=True),
               position_embedding="alibi" if attn.get("alibi") else "learned",
               max_position_embeddings=get("max_seq_len", default=2048))
    out["num_key_value_heads"] = attn.get("kv_n_heads") or out["num_attention_heads"]
    return out


def _gpt_neox(cfg: dict, get: _Getter, name: str, kind: str) -> dict[str, Any]:
    """GPT-NeoX."""
    # transformers models/gpt_neox: LayerNorms with bias, biased fused qkv / dense / MLP,
    # plain GELU MLP, partial rotary (no parameters), untied embed_out, parallel residual
    heads = get("num_attention_heads")
    out = dict(name=name, num_hidden_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"),
               num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=get("intermediate_size"),
               vocab_size=get("vocab_size"), hidden_act=get("hidden_act", default="gelu"), mlp_gated=False,
               tie_word_embeddings=bool(get("tie_word_embeddings", default=False)), norm="layernorm",
               bias=bool(get("attention_bias", default=True)), position_embedding="rope",
               max_position_embeddings=get("max_position_embeddings", default=2048),
               parallel_residual=bool(get("use_parallel_residual", default=True)), fused_qkv=True,
               rotary_concat=True,
               attention_dropout=float(cfg.get("attention_dropout") or 0.0),
               hidden_dropout=float(cfg.get("hidden_dropout") or 0.0))
    return out


def _llama_like(cfg: dict, get: _Getter, name: str, kind: str) -> dict[str, Any]:
    """llama, mistral, qwen2/3, gemma/2, phi3, olmo2 and other Llama-shaped decoders
    (transformers models/<kind>/modeling_<kind>.py: gate/up/down MLP whatever the activation)."""
    heads = get("num_attention_heads")
    act = get("hidden_activation", "hidden_act", default="silu")
    attn_bias = bool(cfg.get("attention_bias"))
    out = dict(name=name, num_hidden_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"),
               num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads", default=heads),
               intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
               hidden_act=act, mlp_gated=True,
               tie_word_embeddings=bool(get("tie_word_embeddings",
                                            default=kind in ("gemma", "gemma2", "gemma3_text"))),
               norm="rmsnorm", bias=bool(attn_bias and cfg.get("mlp_bias")),
               qkv_bias=kind == "qwen2" or attn_bias,
               position_embedding="rope", max_position_embeddings=get("max_position_embeddings", default=4096),
               attention_dropout=float(cfg.get("attention_dropout") or 0.0),
               hidden_dropout=float(max(cfg.get("resid_pdrop") or 0.0, cfg.get("embd_pdrop") or 0.0)))
    if kind in ("gemma", "gemma2", "gemma3_text", "olmo2"):
        out["norm"] = "rmsnorm_fp32"  # GemmaRMSNorm / Gemma3RMSNorm / Olmo2RMSNorm: weight applied in fp32
    if kind == "mistral" and cfg.get("sliding_window", 4096):  # MistralConfig's default: 4096
        out["sliding_window"] = int(cfg.get("sliding_window", 4096))
    if kind == "phi3":
        out["fused_qkv"] = True  # qkv_proj, sliced
        out["rotary_concat"] = True  # apply_rotary_pos_emb: torch.cat([rotated, q_pass])
    if kind == "gemma2":
        out["norms_per_block"] = 4  # input, post_attention, pre_feedforward, post_feedforward
        out["attn_implementation"] = "eager"  # transformers has no sdpa path for Gemma2
        out["num_attention_masks"] = 2  # sliding_attention and full_attention layers alternate
        if cfg.get("attn_logit_softcapping", 50.0):  # Gemma2Config's default
            out["attn_logit_softcapping"] = float(cfg.get("attn_logit_softcapping", 50.0))
        if cfg.get("final_logit_softcapping", 30.0):
            out["final_logit_softcapping"] = float(cfg.get("final_logit_softcapping", 30.0))
    if kind in ("qwen3", "gemma3_text"):
        out["qk_norm"] = "head"  # q_norm / k_norm: RMSNorm(head_dim)
    if kind == "olmo2":
        out["qk_norm"] = "full"  # q_norm: RMSNorm(heads * head_dim), k_norm: RMSNorm(kv_heads * head_dim)
    if cfg.get("head_dim"):
        out["head_dim"] = cfg["head_dim"]
    elif kind in ("gemma", "gemma2", "gemma3_text"):
        out["head_dim"] = 256  # GemmaConfig / Gemma2Config / Gemma3TextConfig default
    return out


def _gemma3_layers(cfg: dict, path: str, layers: int) -> dict[str, Any]:
    """Gemma-3's blocks (transformers models/gemma3/modeling_gemma3.py Gemma3DecoderLayer: four
    norms; configuration_gemma3.py: ``layer_types``, by default every ``sliding_window_pattern``-th
    layer (6) full and the others sliding over ``sliding_window`` (4096) tokens)."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise ConfigError(f"{path}: model_type gemma3_text with {key}: its attention is not modelled "
                              f"(set {key}: null)",
                          path="model.hf_config")
    types = cfg.get("layer_types")
    if not isinstance(types, list):
        pattern = int(cfg.get("_sliding_window_pattern") or cfg.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    sliding = sum(t == "sliding_attention" for t in types[:layers])
    out: dict[str, Any] = dict(norms_per_block=4)  # input, post_attention, pre_feedforward, post_feedforward
    if cfg.get("final_logit_softcapping"):  # Gemma3TextConfig's default: None
        out["final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    window = cfg.get("sliding_window", 4096)  # null: no window, the sliding layers attend fully
    if sliding and window is not None:
        out.update(sliding_window=int(window), sliding_window_layers=sliding)
        if sliding < layers:
            out["num_attention_masks"] = 2  # a sliding_attention and a full_attention mask per forward
    return out
