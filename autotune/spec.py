"""Typed descriptions of the job: the model, the training setup and the hardware.

Pure data plus derived quantities (parameter counts, FLOP counts); no I/O, no torch.
Field names follow Hugging Face ``config.json`` where one exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, get_args

Precision = Literal["bf16", "fp16", "fp32"]
DataLoaderFork = Literal["none", "after_init", "each_epoch"]
Norm = Literal["rmsnorm", "layernorm", "rmsnorm_fp32"]
PositionEmbedding = Literal["rope", "learned", "alibi", "none"]
AttnImplementation = Literal["sdpa", "eager"]
HiddenAct = Literal["silu", "swiglu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"]

GIB = 1 << 30
"""Bytes per GiB."""
BYTES_PER_ELEMENT: dict[Precision, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one tensor element at each compute precision."""

GATED_ACTS = ("silu", "swiglu", "swish")
"""Activations whose MLP is gated (SwiGLU, Shazeer 2020): three projections instead of two."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described the way HF ``config.json`` does."""

    name: str
    """Display name (preset name, HF ``_name_or_path`` or ``custom``)."""
    num_hidden_layers: int
    """Number of transformer blocks L."""
    hidden_size: int
    """Model width d."""
    num_attention_heads: int
    """Query heads a."""
    num_key_value_heads: int
    """Key/value heads (GQA/MQA when smaller than num_attention_heads)."""
    intermediate_size: int
    """MLP inner width."""
    vocab_size: int
    """Vocabulary size V."""
    hidden_act: HiddenAct = "silu"
    """``silu`` means a gated SwiGLU MLP (Llama); ``gelu*``/``relu`` a plain 2-matrix MLP (GPT/MPT)."""
    tie_word_embeddings: bool = False
    """Whether the LM head shares the token-embedding matrix."""
    norm: Norm = "rmsnorm"
    """Normalisation layer kind; ``rmsnorm_fp32``: RMSNorm whose weight is applied in fp32 before
    the cast back (HF GemmaRMSNorm, Olmo2RMSNorm; same parameters as rmsnorm, more saved bytes)."""
    rms_norm_kernel: Literal["torch", "liger"] = "torch"
    """Which code runs an ``rmsnorm``: ``torch``, the model's own (HF LlamaRMSNorm's eager ops, whose
    backward makes fp32 h-wide temporaries); ``liger``, Liger-Kernel's LigerRMSNormFunction (what
    ``AutoLigerKernelForCausalLM`` and ArcticTraining's liger model factory swap in), whose backward writes
    dX into dY (liger_kernel/ops/rms_norm.py ``rms_norm_backward``): no token-sized temporaries. Its saved
    tensors (X, fp32 rstd, Y: 2 p h + 4 bytes per token) are sized as torch's (4 h + 2 p h + 4), an upper
    bound that ``estimate`` states."""
    bias: bool = False
    """Whether linear layers (and LayerNorms) carry a bias."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections only (Qwen2); implied when ``bias`` is true."""
    position_embedding: PositionEmbedding = "rope"
    """``learned`` adds a max_position_embeddings x d table; rope/alibi/none add no parameters."""
    max_position_embeddings: int = 4096
    """Longest sequence the model supports (size of the learned table)."""
    attn_implementation: AttnImplementation = "sdpa"
    """``sdpa``/flash: no s^2 matrix kept for backward; ``eager``: softmax probabilities kept."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (HF ``attn_pdrop``/``attention_dropout``)."""
    hidden_dropout: float = 0.0
    """Dropout on residual branches and embeddings (HF ``resid_pdrop``/``embd_pdrop``)."""
    implementation: Literal["reference", "hf"] = "reference"
    """Code the model runs: autotune's reference decoders, or the Hugging Face transformers classes
    (set for ``model.hf_config``); the memory model adds HF's composite-op activations for ``hf``."""
    head_dim: Optional[int] = None
    """Per-head width; defaults to hidden_size // num_attention_heads."""
    mlp_gated: Optional[bool] = None
    """Gated MLP (gate, up and down projections: SwiGLU / GeGLU); None: gated iff ``hidden_act`` is
    silu/swiglu/swish. HF Llama-family classes (llama, mistral, qwen2/3, gemma/2, phi3, olmo2) are
    gated whatever the activation (Gemma: GeGLU with gelu_pytorch_tanh)."""
    norms_per_block: int = 2
    """Norm layers per block (Gemma2: 4, pre and post norms around attention and MLP)."""
    qk_norm: Literal["none", "head", "full"] = "none"
    """RMSNorm on queries and keys: ``head`` over each head (Qwen3, weights of head_dim),
    ``full`` over the whole projection (OLMo2, weights of q_size and kv_size)."""
    fused_qkv: bool = False
    """q, k and v come from one fused projection and are sliced from it (Phi3 ``qkv_proj``,
    GPT-NeoX ``query_key_value``): with rotary embeddings, v stays a view of the fused output, so
    attention keeps that whole output alive."""
    parallel_residual: bool = False
    """Attention and MLP read the same block input (GPT-NeoX ``use_parallel_residual``)."""
    rotary_concat: bool = False
    """The rotary code concatenates the rotated and the pass-through parts of q and k (HF Phi-3 and
    GPT-NeoX ``apply_rotary_pos_emb``: ``torch.cat([..., q_pass], dim=-1)``): q comes out
    contiguous per head, so attention's output does too, and ``transpose(1, 2).contiguous()``
    before the output projection copies it."""
    linear_addmm: bool = False
    """The block's linears call ``torch.addmm`` themselves (HF GPT-2's ``Conv1D``), so DeepSpeed
    ZeRO-3's linear replacement does not turn them into ``mm`` (op-level checkpointing keeps
    every other ``mm`` output)."""
    num_attention_masks: int = 1
    """Distinct attention masks the model builds per forward (Gemma2: 2, its sliding-window and full
    layers alternate). Under HF eager attention each is a (batch, 1, s, s) additive mask in the
    model dtype; checkpointed blocks keep them (their inputs) until their backward."""
    sliding_window: Optional[int] = None
    """Sliding-window attention span of every layer (HF Mistral's ``sliding_window``). Under HF sdpa
    a sequence at least this long makes transformers build the attention mask (s x s) instead of
    relying on ``is_causal``, and every layer's attention keeps an additive copy of it."""
    sliding_window_layers: Optional[int] = None
    """How many layers attend over ``sliding_window`` (HF ``layer_types``' sliding_attention
    entries; Gemma-3: five in six); None: every layer (Mistral). The memory model sizes the
    sliding masks of every layer or of none, so autotune.config refuses a model whose layers
    differ at a sequence long enough to build them."""
    attn_logit_softcapping: Optional[float] = None
    """``cap * tanh(scores / cap)`` on the attention scores before the softmax (Gemma2, eager
    attention): tanh keeps its s x s output for backward."""
    final_logit_softcapping: Optional[float] = None
    """``cap * tanh(logits / cap)`` before the loss (Gemma2); its intermediates are kept for backward."""
    embedding_multiplier: Optional[float] = None
    """The token embeddings are multiplied by this scalar before the first block (Granite
    ``inputs_embeds * embedding_multiplier``); None: not multiplied. Any value, 1.0 included, makes a new
    tensor (and its gradient another); the value itself sizes nothing."""
    residual_multiplier: Optional[float] = None
    """Each sub-layer's output is multiplied by this scalar before the residual add (Granite
    ``residual + hidden_states * residual_multiplier``); None: added as it is."""
    logits_scaling: Optional[float] = None
    """The logits are divided by this scalar before the loss (Granite ``logits / logits_scaling``);
    None: not divided."""
    norms_before_mlp: bool = False
    """The HF decoder layer registers its norms before its feed-forward, so ``parameters()`` lists them
    between the attention and the MLP (Granite-MoE ``GraniteMoeDecoderLayer``: self_attn,
    input_layernorm, post_attention_layernorm, block_sparse_moe); False: after it (Llama and kin)."""
    # ---- mixture-of-experts, latent attention (defaults: a dense decoder) ----
    num_experts: int = 0
    """Routed experts per MoE block (HF ``num_local_experts`` / ``num_experts`` /
    ``n_routed_experts``); 0: every block has the dense MLP."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: Optional[int] = None
    """Width of one routed expert's (gated) MLP; None: intermediate_size (Mixtral, OLMoE, phimoe)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared-expert MLP every token of a MoE block also passes (Qwen2-MoE's
    ``shared_expert_intermediate_size``; DeepSeek: ``n_shared_experts x moe_intermediate_size``,
    built as one MLP); 0: none."""
    shared_expert_gate: bool = False
    """A sigmoid gate ``Linear(d, 1)`` scales the shared expert's output (Qwen2-MoE)."""
    dense_layers: tuple[int, ...] = ()
    """Indices of the blocks of a MoE model that keep the dense MLP of intermediate_size (DeepSeek's
    first ``first_k_dense_replace``; Qwen-MoE's ``mlp_only_layers`` and the blocks off its
    ``decoder_sparse_step``)."""
    moe_load_imbalance: Optional[float] = None
    """Stated load imbalance: the busiest expert's routed tokens over the mean (tokens x top-k /
    experts), what per-expert buffers are sized with (expert parallelism's per-chunk rows); at most
    experts / top-k; None: experts / top-k (``memory.moe.expert_imbalance``: routers that see text send some
    block's every token of a rank to one expert). State what the run's router does on its data."""
    moe_min_load: Optional[float] = None
    """Stated least load: the least-loaded expert's routed tokens from one rank over the mean (an expert
    parallelism chunk, one source rank's rows for one expert, over tokens x top-k / experts), in [0, 1];
    what bounds the rows expert parallelism's backward has run before its busiest chunk; None: 0 (an
    expert may receive nothing)."""
    ep_rank_imbalance: Optional[float] = None
    """Stated imbalance of expert parallelism's ranks: the busiest EP rank's received rows over the mean
    (tokens x top-k), at most moe_load_imbalance (a rank's experts average the busiest one out);
    None: a collapsed router's (``memory.expert_parallel.collapsed_rank_imbalance``: every token of a block
    picks the same experts), at most moe_load_imbalance."""
    ep_step_imbalance: Optional[float] = None
    """Stated imbalance of expert parallelism's ranks over a micro-step: the busiest EP rank's received rows
    summed over the step's MoE blocks, over the mean (MoE blocks x tokens x top-k), at most
    ep_rank_imbalance (a rank's mean over the blocks is at most its busiest block's); what the blocks' saved
    tensors are sized with, the block being run at ep_rank_imbalance; None: ep_rank_imbalance where that is
    stated, else a collapsed router's (``memory.expert_parallel.collapsed_step_imbalance``)."""
    router_bias: bool = False
    """The router ``Linear(d, num_experts)`` has a bias (gpt-oss)."""
    expert_bias: bool = False
    """Each routed expert's projections have biases (gpt-oss ``gate_up_proj_bias``, ``down_proj_bias``)."""
    router_fp32: bool = False
    """The router's linear runs in fp32 on fp32 copies of its input and weight and its top-k weights are
    not renormalised (DeepSeek-V2 ``DeepseekV2TopkRouter``: ``F.linear(hidden_states.type(torch.float32),
    self.weight.type(torch.float32))``, the top-k scaled by ``routed_scaling_factor``)."""
    router_norm_topk: bool = True
    """The router renormalises its top-k weights to sum to 1 (``router_top_value /= router_top_value.sum()``;
    Qwen2-MoE's and OLMoE's ``norm_topk_prob: false`` skips it; read for qwen2_moe and olmoe)."""
    router_weights_cast: bool = False
    """The router's top-k weights are in the model dtype: cast back (Qwen2/3-MoE and OLMoE
    ``router_top_value.to(router_logits.dtype)``) or computed in it (phimoe's sparsemixer); False: they stay
    fp32 (Mixtral, DeepSeek)."""
    router_after_experts: bool = False
    """The MoE block registers its router after its experts, so ``parameters()`` lists it after them
    (Qwen3-MoE, DeepSeek-V2/V3: ``self.experts`` then ``self.gate``); False: router first (Mixtral,
    Qwen2-MoE, OLMoE)."""
    experts_transposed: bool = False
    """The experts' 3-D weights are stored input-major (gpt-oss ``GptOssExperts``: gate_up_proj E x h x 2f,
    ``use_experts_implementation(is_transposed=True)``), so grouped_mm reads them as they are; otherwise it reads a
    transposed view (transformers integrations/moe.py ``_grouped_linear``), which its backward keeps."""
    zero3_leaf_block: bool = False
    """The MoE block's class is one of DeepSpeed's default ZeRO-3 leaf modules (runtime/zero/leaf_module_config.py
    ``DEFAULT_LEAF_MODULE_CLASSES``: Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse blocks, DeepSpeed 0.19): under
    ZeRO-3 its parameters' gradients wait for its backward hook and are reduced there one after another
    (stage3.py ``reduce_leaf_module_grads``)."""
    router_topk_softmax: bool = False
    """The router takes the top-k of its logits and a softmax over those k alone as the routing weights (gpt-oss
    ``GptOssTopKRouter``, in the model dtype; Granite-MoE ``GraniteMoeTopKRouter``, on the fp32 logits, the weights
    cast back: ``router_logits_fp32``): no softmax over every expert is kept."""
    router_sparsemixer: bool = False
    """The router is phimoe's sparsemixer in training (modeling_phimoe.py ``sparsemixer``): two rounds, the top-1
    then the top-2 on the logits with the first pick masked (``torch.scatter``), each a ``masked_fill`` of the
    logits far below the round's best (its bool mask, E), a Gumbel-sampled expert, the softmax of the masked
    logits (E) and its gather at the sample, kept with the sample by ``PhimoeMultiplier``; the weights in the
    model dtype; always two experts."""
    input_jitter_draws: int = 0
    """How many uniform draws of the block input's shape the MoE block multiplies its input by in training, in
    place, each kept for backward by its multiply (phimoe's ``input_jitter_noise > 0``: 2, one in
    ``PhimoeSparseMoeBlock.forward``, one in ``PhimoeTopKRouter.forward`` on the same tensor); 0: none."""
    router_logits_fp32: bool = False
    """The router's logits are cast to fp32 before the top-k (Granite-MoE ``F.linear(...).float()``): its softmax
    and the logits the layer holds are fp32."""
    expert_clamped_swiglu: bool = False
    """Each expert gates with gpt-oss's clamped SwiGLU (``GptOssExperts._apply_gate``: the interleaved gate and
    up halves clamped, ``gate * sigmoid(alpha * gate)``, ``(up + 1) * glu``) instead of ``act(gate) * up``."""
    rotary_half_table: bool = False
    """The rotary cos / sin tables are head_dim / 2 wide, multiplied into the two halves of q and k (gpt-oss
    ``_apply_rotary_emb``), not the full head_dim (Llama's ``rotate_half``)."""
    router_group_limited: bool = False
    """The top-k is limited to the best expert groups (DeepSeek-V2 ``topk_method: group_limited_greedy``:
    the scores outside the ``topk_group`` best of ``n_group`` groups masked to 0 before the top-k)."""
    router_sigmoid: bool = False
    """DeepSeek-V3's router (``DeepseekV3TopkRouter``): sigmoid scores plus the fp32
    ``e_score_correction_bias`` buffer, the ``noaux_tc`` top-k over the ``topk_group`` best of ``n_group``
    groups (always), the top-k weights gathered from the scores and renormalised when router_norm_topk."""
    mla_rotary: Literal["complex", "half", "interleave"] = "complex"
    """MLA's rotary product: DeepSeek-V2's complex ``freqs_cis`` product (``complex``), DeepSeek-V3's cos/sin
    product with ``rotate_half`` (``half``, ``rope_interleave: false``) or on the even/odd slices
    (``interleave``, its default); read for MLA models only."""
    q_lora_rank: Optional[int] = None
    """Multi-head latent attention (DeepSeek-V2/V3): rank of the query down-projection (with an
    RMSNorm of that width); None with kv_lora_rank set: a plain q_proj."""
    kv_lora_rank: Optional[int] = None
    """MLA's compressed key/value width (``kv_a_proj_with_mqa`` -> RMSNorm -> ``kv_b_proj``); None: not MLA."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width that carries the rotary embedding (the key's is shared by all heads)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without the rotary embedding."""
    v_head_dim: Optional[int] = None
    """MLA: per-head value width (None: head_size)."""
    attention_sinks: bool = False
    """A learned per-head sink logit in every attention softmax (gpt-oss ``self_attn.sinks``)."""
    lm_head_bias: bool = False
    """The LM head has a bias of vocab_size (phimoe ``lm_head_bias``)."""
    source: str = ""
    """Where the numbers come from (config URL or file)."""

    def __post_init__(self) -> None:
        # Invariants; user-facing validation with key paths happens in config.py.
        assert self.num_hidden_layers > 0 and self.hidden_size > 0
        assert self.num_attention_heads > 0 and self.num_key_value_heads > 0

    @property
    def gated_mlp(self) -> bool:
        if self.mlp_gated is not None:
            return self.mlp_gated
        return self.hidden_act.lower() in GATED_ACTS

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    # ---- parameter counts (exact, matching the HF implementations) ----
    def norm_params(self) -> int:
        """Parameters of one norm layer (weight, plus bias for a biased LayerNorm)."""
        return self.hidden_size * (2 if (self.norm == "layernorm" and self.bias) else 1)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def _mla_params(self) -> int:
        """DeepSeek-V2/V3 attention (transformers models/deepseek_v2/modeling_deepseek_v2.py
        DeepseekV2Attention, no biases): q_proj or q_a_proj + q_a_layernorm + q_b_proj,
        kv_a_proj_with_mqa + kv_a_layernorm + kv_b_proj, o_proj."""
        d, a, r = self.hidden_size, self.num_attention_heads, self.qk_rope_head_dim
        qk, v, kv = self.qk_nope_head_dim + r, (self.v_head_dim or self.head_size), int(self.kv_lora_rank or 0)
        q = d * a * qk if self.q_lora_rank is None else self.q_lora_rank * (d + 1 + a * qk)
        return q + d * (kv + r) + kv + kv * a * (self.qk_nope_head_dim + v) + a * v * d

    def attention_params(self) -> int:
        d = self.hidden_size
        if self.is_mla:
            return self._mla_params()
        n = d * self.q_size + 2 * d * self.kv_size + self.q_size * d
        if self.bias or self.qkv_bias:
            n += self.q_size + 2 * self.kv_size
        if self.bias:
            n += d
        if self.qk_norm == "head":
            n += 2 * self.head_size
        elif self.qk_norm == "full":
            n += self.q_size + self.kv_size
        if self.attention_sinks:
            n += self.num_attention_heads
        return n

    def mlp_params(self) -> int:
        d, f = self.hidden_size, self.intermediate_size
        num_in = 2 if self.gated_mlp else 1
        n = (num_in + 1) * d * f
        if self.bias:
            n += num_in * f + d
        return n

    def moe_params(self) -> int:
        """One MoE block's feed-forward: router, routed experts (gated, no bias unless
        expert_bias), shared expert and its gate (transformers models/mixtral, qwen2_moe,
        deepseek_v3, gpt_oss modeling files: the router, ``experts.gate_up_proj`` / ``down_proj``)."""
        d, e = self.hidden_size, self.num_experts
        f = self.moe_intermediate_size or self.intermediate_size
        n = e * d + (e if self.router_bias else 0)
        n += e * (3 * d * f + ((2 * f + d) if self.expert_bias else 0))
        n += 3 * d * self.shared_expert_intermediate_size + (d if self.shared_expert_gate else 0)
        return n

    def block_params(self, moe: Optional[bool] = None) -> int:
        """Parameters of one transformer block (attention, MLP or MoE feed-forward, its norms);
        ``moe`` (default: whether the model is a MoE) picks the feed-forward of a MoE model's block."""
        ffn = self.moe_params() if (self.is_moe if moe is None else moe) else self.mlp_params()
        return self.attention_params() + ffn + self.norms_per_block * self.norm_params()

    def params_after_attention_core(self, moe: Optional[bool] = None) -> int:
        """Parameters of one block whose weight gradients its backward makes before its attention core's:
        the feed-forward (``moe`` as in block_params), o_proj and every norm but the input one."""
        width = self.num_attention_heads * (self.v_head_dim or self.head_size) if self.is_mla else self.q_size
        o_proj = width * self.hidden_size + (self.hidden_size if self.bias else 0)
        return self.block_params(moe) - self.attention_params() + o_proj - self.norm_params()

    @property
    def num_dense_layers(self) -> int:
        """Blocks with the dense MLP: all of a dense model, the dense_layers of a MoE one."""
        L = self.num_hidden_layers
        return sum(1 for i in set(self.dense_layers) if 0 <= i < L) if self.is_moe else L

    @property
    def num_moe_layers(self) -> int:
        """Blocks with routed experts (0 for a dense model)."""
        return self.num_hidden_layers - self.num_dense_layers

    def embedding_params(self) -> int:
        n = self.vocab_size * self.hidden_size
        if self.position_embedding == "learned":
            n += self.max_position_embeddings * self.hidden_size
        return n

    def lm_head_params(self) -> int:
        bias = self.vocab_size if self.lm_head_bias else 0
        return bias + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def num_parameters(self) -> int:
        """Exact trainable parameter count (tied embeddings counted once)."""
        blocks = self.num_dense_layers * self.block_params(False)
        if self.num_moe_layers:
            blocks += self.num_moe_layers * self.block_params(True)
        return self.embedding_params() + blocks + self.norm_params() + self.lm_head_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token, llm-foundry's definition: 6N + 12*L*d*S.

        Source: mosaicml/llm-foundry scripts/train/benchmarking/collect_results.py (and
        Korthikanti et al. 2022 eq. 7 without the logit term, which 6N already covers).
        """
        return 6.0 * self.num_parameters + 12.0 * self.num_hidden_layers * self.hidden_size * seq_len

    def replace(self, **changes: object) -> "ModelSpec":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model: memory, peaks and bandwidths (datasheet numbers)."""

    name: str
    """Preset name, e.g. ``a100-80gb``."""
    memory_bytes: int
    """Usable device memory as torch reports total_memory."""
    peak_tflops_bf16: float
    """Dense bf16 tensor-core peak (0 when the GPU has no bf16)."""
    peak_tflops_fp16: float
    """Dense fp16 tensor-core peak with fp32 accumulate."""
    peak_tflops_fp32: float
    """Dense fp32 (non-tensor-core) peak."""
    hbm_bandwidth_gbps: float
    """Device memory bandwidth in GB/s."""
    intra_node_bandwidth_gbps: float
    """Per-GPU unidirectional bandwidth to peers in the node (NVLink or PCIe), GB/s."""
    inter_node_bandwidth_gbps: float
    """Per-GPU unidirectional network bandwidth between nodes, GB/s."""
    pcie_bandwidth_gbps: float
    """Effective host<->device bandwidth, GB/s (offload traffic)."""
    efficiency: Optional[dict] = None
    """Simulator efficiency parameters fitted on measured runs (None: uncalibrated defaults)."""
    source: str = ""
    """Datasheet the numbers come from."""

    def peak_flops(self, precision: Precision) -> float:
        tf = {"bf16": self.peak_tflops_bf16, "fp16": self.peak_tflops_fp16, "fp32": self.peak_tflops_fp32}[precision]
        return tf * 1e12

    @property
    def calibrated(self) -> bool:
        return bool(self.efficiency)


@dataclass(frozen=True)
class NVMeSpec:
    """Local NVMe used by ZeRO-Infinity offload."""

    capacity_gib: float
    """Free capacity per node, GiB."""
    bandwidth_gbps: float = 3.0
    """Sustained read/write bandwidth per node, GB/s."""
    path: str = "/local_nvme"
    """Mount point written into the DeepSpeed config."""


@dataclass(frozen=True)
class HardwareSpec:
    """The cluster the job runs on."""

    gpu: GPUSpec
    """The accelerator model."""
    gpus_per_node: int = 8
    """GPUs (processes) per node."""
    num_nodes: int = 1
    """Number of nodes."""
    cpu_memory_gib: float = 1024.0
    """Host RAM per node available to the job, GiB."""
    nvme: Optional[NVMeSpec] = None
    """Local NVMe for offload, if any."""
    cpu_adam_gparams_per_s: float = 1.0
    """DeepSpeedCPUAdam throughput per node, billions of parameters updated per second."""
    cuda_context_gib: float = 0.75
    """Per-GPU memory outside the caching allocator (CUDA context, cuBLAS/NCCL workspaces), GiB."""
    allocator_slack: float = 0.05
    """Fraction of the allocated peak lost to caching-allocator fragmentation (reserved - allocated)."""

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes


OptimizerType = Literal["adamw", "adam", "sgd"]
OPTIMIZER_TYPES: tuple[OptimizerType, ...] = get_args(OptimizerType)
_TORCH_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
"""OptimizerSpec.type -> its torch.optim class (DeepSpeed's config ``type`` names the same classes)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer and its hyper-parameters (job file ``training.optimizer``), the one object the
    memory model (its state), every DeepSpeed config, every FSDP2 layout and snippet, the profiling
    worker and the tracer read, so what is sized is what is configured and measured. The defaults
    are what autotune configured before they could be set."""

    type: OptimizerType = "adamw"
    """adamw (decoupled weight decay, Loshchilov & Hutter 2019), adam (weight decay as an L2 term
    of the gradient) or sgd (torch.optim.SGD)."""
    lr: float = 1e-4
    """Learning rate (constant: autotune measures steps, it schedules nothing)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """adam/adamw: decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """adam/adamw: term added to the denominator."""
    weight_decay: float = 0.1
    """Weight decay (adamw: decoupled; adam and sgd: added to the gradient, as torch.optim does)."""
    momentum: float = 0.0
    """sgd: momentum factor; 0 is plain SGD (no state), above 0 one momentum buffer per parameter."""
    gradient_clipping: float = 1.0
    """Largest global gradient norm (torch.nn.utils.clip_grad_norm_, DeepSpeed ``gradient_clipping``);
    0: no clipping."""

    def __post_init__(self) -> None:
        # JSON (the worker's job, front.json) gives betas as a list
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        assert self.type in OPTIMIZER_TYPES and len(self.betas) == 2

    @property
    def state_bytes_per_parameter(self) -> int:
        """Optimizer-state bytes per trained parameter, fp32 master weights excluded: adam/adamw keep
        exp_avg and exp_avg_sq (torch/optim/adamw.py ``_init_group``; DeepSpeed's FusedAdam and
        DeepSpeedCPUAdam the same), sgd with momentum its ``momentum_buffer``, plain sgd nothing
        (torch/optim/sgd.py ``_init_group``), all in the fp32 of the master weights."""
        if self.type in ("adam", "adamw"):
            return 8
        return 4 if self.momentum > 0 else 0

    @property
    def torch_class(self) -> str:
        """The torch.optim class name (AdamW, Adam, SGD)."""
        return _TORCH_OPTIMIZER[self.type]

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``torch.optim.<torch_class>`` (JSON-ready: betas as a list)."""
        if self.type == "sgd":
            return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    def deepspeed_section(self) -> dict[str, Any]:
        """The DeepSpeed config's ``optimizer`` section. DeepSpeed builds FusedAdam / DeepSpeedCPUAdam
        for AdamW and Adam, whose ``adam_w_mode`` defaults to true even for Adam (runtime/engine.py
        ``_configure_basic_optimizer``), so Adam says false; SGD is torch.optim.SGD (the same file:
        any torch.optim name)."""
        params = self.torch_kwargs()
        if self.type == "adam":
            params["adam_w_mode"] = False
        return {"type": self.torch_class, "params": params}


@dataclass(frozen=True)
class TrainingSpec:
    """What one optimizer step looks like."""

    seq_len: int
    """Tokens per sequence."""
    global_batch_size: int
    """Sequences per optimizer step, across all data-parallel ranks."""
    precision: Precision = "bf16"
    """bf16 (no loss scaling), fp16 (dynamic loss scaling) or fp32."""
    optimizer: OptimizerSpec = OptimizerSpec()
    """The optimizer and its hyper-parameters (an OptimizerSpec; an optimizer type or a mapping of
    OptimizerSpec fields, as JSON gives them, is converted)."""
    data_loader_fork: DataLoaderFork = "none"
    """When the training loop's data loader forks its worker processes (torch's DataLoader with
    num_workers > 0 and the fork start method, Linux's default), which matters under CPU offload: a
    forked worker keeps the pages of the host partitions as they were at the fork, and every page the
    trainer writes after it is copied (copy-on-write), so the host holds a second copy of each
    partition that existed then. ``none``: no forked worker (num_workers 0, HF Trainer's default);
    ``after_init``: forked once, after the engine is built and before the first optimizer step
    (persistent workers; ArcticTraining: ``UlyssesSPDataLoaderAdapter`` iterates its loader in
    ``__init__``), so the master weights and gradient partitions are copied, the lazily created
    optimizer moments not; ``each_epoch``: forked again at every epoch (torch's default
    persistent_workers False), from the second epoch with the moments copied too. Measured:
    benchmarks/host_rss_offload.py --dl-workers 1."""

    def __post_init__(self) -> None:
        opt: Any = self.optimizer
        if isinstance(opt, str):
            object.__setattr__(self, "optimizer", OptimizerSpec(type=opt))  # type: ignore[arg-type]
        elif isinstance(opt, dict):
            object.__setattr__(self, "optimizer", OptimizerSpec(**opt))
