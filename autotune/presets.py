"""Model and GPU presets, as plain dicts, each citing its source.

``model_from_name(name, **overrides)`` and ``gpu_from_name(name, **overrides)`` build the typed
specs. Parameter counts of every model preset are tested exactly in tests/spec/test_presets.py.
"""

from __future__ import annotations

from typing import Any

from autotune.spec import GPUSpec, ModelSpec

_HF = "https://huggingface.co/{}/blob/main/config.json"

MODEL_PRESETS: list[dict[str, Any]] = [
    # GPT-2 family: LayerNorm with bias, GELU MLP, learned positions, tied head, dropout 0.1.
    dict(name="gpt2", num_hidden_layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=12,
         intermediate_size=3072, vocab_size=50257, hidden_act="gelu_new", tie_word_embeddings=True,
         norm="layernorm", bias=True, position_embedding="learned", max_position_embeddings=1024,
         attention_dropout=0.1, hidden_dropout=0.1, source=_HF.format("openai-community/gpt2")),
    dict(name="gpt2-xl", num_hidden_layers=48, hidden_size=1600, num_attention_heads=25, num_key_value_heads=25,
         intermediate_size=6400, vocab_size=50257, hidden_act="gelu_new", tie_word_embeddings=True,
         norm="layernorm", bias=True, position_embedding="learned", max_position_embeddings=1024,
         attention_dropout=0.1, hidden_dropout=0.1, source=_HF.format("openai-community/gpt2-xl")),
    # Llama family: RMSNorm, SwiGLU, RoPE, no bias, untied head.
    dict(name="llama2-7b", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
         intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
         source=_HF.format("meta-llama/Llama-2-7b-hf")),
    dict(name="llama2-13b", num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=40,
         intermediate_size=13824, vocab_size=32000, max_position_embeddings=4096,
         source=_HF.format("meta-llama/Llama-2-13b-hf")),
    dict(name="llama2-70b", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
         intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096,
         source=_HF.format("meta-llama/Llama-2-70b-hf")),
    dict(name="llama3-8b", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
         intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
         source=_HF.format("meta-llama/Meta-Llama-3-8B")),
    dict(name="llama3-70b", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
         intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192,
         source=_HF.format("meta-llama/Meta-Llama-3-70B")),
    dict(name="mistral-7b", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
         intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
         source=_HF.format("mistralai/Mistral-7B-v0.1")),
    # Qwen3 (dense): Llama's blocks with an RMSNorm of head_dim on each query and key head (q_norm / k_norm).
    dict(name="qwen3-32b", num_hidden_layers=64, hidden_size=5120, num_attention_heads=64, num_key_value_heads=8,
         head_dim=128, intermediate_size=25600, vocab_size=151936, max_position_embeddings=40960, qk_norm="head",
         source=_HF.format("Qwen/Qwen3-32B")),
    # MPT: LayerNorm without bias, GELU MLP (expansion 4), ALiBi (no position parameters), tied head.
    dict(name="mpt-7b", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
         intermediate_size=16384, vocab_size=50432, hidden_act="gelu", tie_word_embeddings=True,
         norm="layernorm", bias=False, position_embedding="alibi", max_position_embeddings=2048,
         source=_HF.format("mosaicml/mpt-7b")),
    # A tiny Llama-style model that profiles in seconds on a CPU (tests, examples/tiny-cpu.yaml).
    dict(name="tiny-llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
         intermediate_size=176, vocab_size=512, max_position_embeddings=256, source="autotune (test model)"),
]

_MIB = 1 << 20
_NV = "NVIDIA datasheet: "
GPU_PRESETS: list[dict[str, Any]] = [
    # memory: nvidia-smi total; peaks: dense (no sparsity); bandwidths per GPU, unidirectional.
    dict(name="v100-32gb", memory_bytes=32510 * _MIB, peak_tflops_bf16=0.0, peak_tflops_fp16=125.0,
         peak_tflops_fp32=15.7, hbm_bandwidth_gbps=900.0, intra_node_bandwidth_gbps=150.0,
         inter_node_bandwidth_gbps=12.5, pcie_bandwidth_gbps=12.0, source=_NV + "Tesla V100 SXM2"),
    dict(name="a100-40gb", memory_bytes=40960 * _MIB, peak_tflops_bf16=312.0, peak_tflops_fp16=312.0,
         peak_tflops_fp32=19.5, hbm_bandwidth_gbps=1555.0, intra_node_bandwidth_gbps=300.0,
         # fitted on data/reference/llmfoundry-calibration.csv (38 rows): python benchmarks/simulator_cv.py
         efficiency=dict(gemm_eff=0.7867, gemm_m_half=143.9, gemm_k_half=187.4, attn_eff=0.3117, attn_s_half=122.5, hbm_eff=0.6917, comm_eff=0.402, overlap=0.5715, coll_latency_s=3.201e-06, step_overhead_s=0.03549, layer_overhead_s=0.0006461),
         inter_node_bandwidth_gbps=25.0, pcie_bandwidth_gbps=24.0, source=_NV + "A100 SXM4 40GB"),
    dict(name="a100-80gb", memory_bytes=81920 * _MIB, peak_tflops_bf16=312.0, peak_tflops_fp16=312.0,
         peak_tflops_fp32=19.5, hbm_bandwidth_gbps=2039.0, intra_node_bandwidth_gbps=300.0,
         # fitted on data/reference/llmfoundry-calibration.csv (30 rows): python benchmarks/simulator_cv.py
         efficiency=dict(gemm_eff=0.867, gemm_m_half=123.5, gemm_k_half=251.3, attn_eff=0.3176, attn_s_half=192.3, hbm_eff=0.4947, comm_eff=0.5722, overlap=0.6587, coll_latency_s=5.74e-06, step_overhead_s=0.02255, layer_overhead_s=0.000939),
         inter_node_bandwidth_gbps=25.0, pcie_bandwidth_gbps=24.0, source=_NV + "A100 SXM4 80GB"),
    dict(name="h100-80gb", memory_bytes=81559 * _MIB, peak_tflops_bf16=989.0, peak_tflops_fp16=989.0,
         peak_tflops_fp32=67.0, hbm_bandwidth_gbps=3350.0, intra_node_bandwidth_gbps=450.0,
         # fitted on data/reference/llmfoundry-calibration.csv (34 rows): python benchmarks/simulator_cv.py
         efficiency=dict(gemm_eff=0.7152, gemm_m_half=137.9, gemm_k_half=205.0, attn_eff=0.1779, attn_s_half=134.1, hbm_eff=0.454, comm_eff=0.4719, overlap=0.4546, coll_latency_s=2.635e-06, step_overhead_s=0.0189, layer_overhead_s=0.000532),
         inter_node_bandwidth_gbps=50.0, pcie_bandwidth_gbps=50.0, source=_NV + "H100 SXM5"),
    dict(name="h200-141gb", memory_bytes=143771 * _MIB, peak_tflops_bf16=989.0, peak_tflops_fp16=989.0,
         peak_tflops_fp32=67.0, hbm_bandwidth_gbps=4800.0, intra_node_bandwidth_gbps=450.0,
         inter_node_bandwidth_gbps=50.0, pcie_bandwidth_gbps=50.0, source=_NV + "H200 SXM"),
    dict(name="l40s", memory_bytes=46068 * _MIB, peak_tflops_bf16=362.0, peak_tflops_fp16=362.0,
         peak_tflops_fp32=91.6, hbm_bandwidth_gbps=864.0, intra_node_bandwidth_gbps=24.0,
         inter_node_bandwidth_gbps=25.0, pcie_bandwidth_gbps=24.0, source=_NV + "L40S (PCIe Gen4, no NVLink)"),
    dict(name="rtx4090", memory_bytes=24564 * _MIB, peak_tflops_bf16=165.2, peak_tflops_fp16=165.2,
         peak_tflops_fp32=82.6, hbm_bandwidth_gbps=1008.0, intra_node_bandwidth_gbps=24.0,
         inter_node_bandwidth_gbps=12.5, pcie_bandwidth_gbps=24.0,
         source=_NV + "Ada GeForce RTX 4090 whitepaper (fp32-accumulate tensor peak)"),
]

_MODELS = {p["name"]: p for p in MODEL_PRESETS}
_GPUS = {p["name"]: p for p in GPU_PRESETS}


def model_names() -> list[str]:
    return list(_MODELS)


def gpu_names() -> list[str]:
    return list(_GPUS)


def model_from_name(name: str, **overrides: Any) -> ModelSpec:
    """Build a ModelSpec from a preset, with explicit fields overriding it."""
    if name not in _MODELS:
        raise ValueError(f"unknown model preset {name!r}; expected one of: {', '.join(_MODELS)}")
    return ModelSpec(**{**_MODELS[name], **overrides})


def gpu_from_name(name: str, **overrides: Any) -> GPUSpec:
    """Build a GPUSpec from a preset (with its fitted efficiency, if any), fields overridable."""
    if name not in _GPUS:
        raise ValueError(f"unknown gpu preset {name!r}; expected one of: {', '.join(_GPUS)}")
    return GPUSpec(**{**_GPUS[name], **overrides})
