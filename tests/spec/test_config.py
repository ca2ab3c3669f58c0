"""Bad input gives one line naming the file and key path, and exit status 2."""

import json
import subprocess
import sys

import pytest

from autotune.cli import main
from autotune.config import load_config
from autotune.errors import ConfigError
from conftest import BASE

BAD = [
    # (yaml text, expected key path in the message)
    (BASE + "extra: 1\n", "extra"),
    (BASE.replace("seq_len: 4096", "seq_len: -3"), "training.seq_len"),
    (BASE.replace("seq_len: 4096", "seq_len: 'long'"), "training.seq_len"),
    (BASE.replace("seq_len: 4096", "seq_len: .nan"), "training.seq_len"),
    (BASE.replace("seq_len: 4096", "seq_len: true"), "training.seq_len"),
    (BASE.replace("preset: llama2-7b", "preset: llama9"), "model.preset"),
    (BASE.replace("preset: llama2-7b", "preset: llama2-7b, hidden_size: 0"), "model.hidden_size"),
    (BASE.replace("preset: llama2-7b", "preset: llama2-7b, colour: red"), "model.colour"),
    (BASE.replace("gpu: a100-80gb", "gpu: a100-90gb"), "hardware.gpu"),
    (BASE.replace("gpu: a100-80gb", "gpu: {memory_gib: 80}"), "hardware.gpu.peak_tflops_fp16"),
    (BASE.replace("gpus_per_node: 8", "gpus_per_node: 0"), "hardware.gpus_per_node"),
    (BASE + "strategy: {zero_stage: 2, offload_params: cpu}\n", "strategy.offload_params"),
    (BASE + "strategy: {micro_batch_size: 3}\n", "strategy.micro_batch_size"),
    (BASE + "strategy: {zero_stage: 4}\n", "strategy.zero_stage"),
    (BASE + "strategy: {zero_stage: 3, offload_optimizer: nvme}\n", "strategy.offload_optimizer"),
    (BASE + "search: {headroom: 2}\n", "search.headroom"),
    (BASE + "profile: {backend: magic}\n", "profile.backend"),
    ("model: {hidden_size: 64}\ntraining: {seq_len: 8, global_batch_size: 1}\nhardware: {gpu: a100-80gb}\n",
     "model.num_hidden_layers"),
    ("model: [1, 2]\ntraining: {}\nhardware: {}\n", "model"),
    ("- 1\n- 2\n", "expected a mapping"),
    (BASE.replace("training: {seq_len: 4096, global_batch_size: 64}\n", ""), "training"),
    ("model: {preset: llama2-7b\n", "malformed YAML"),
    # a section pasted below its first copy (YAML's loaders keep the last silently, the first's keys lost)
    (BASE + "model:\n  moe_load_imbalance: 1.5\n", "line 5, column 1: key 'model' given twice (first at line 2)"),
    (BASE.replace("preset: llama2-7b", "preset: llama2-7b, preset: gpt2"), "key 'preset' given twice"),
    (BASE.replace("preset: llama2-7b", "hf_config: missing.json"), "model.hf_config"),
    (BASE.replace("preset: llama2-7b", "preset: llama2-7b, rms_norm_kernel: triton"), "model.rms_norm_kernel"),
    (BASE.replace("preset: llama2-7b", "preset: gpt2, rms_norm_kernel: liger"), "model.rms_norm_kernel"),
]


@pytest.mark.parametrize("text,where", BAD)
def test_bad_config_one_line_with_path(write, text, where, capsys):
    path = write(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(path + ": ") and where in message and "\n" not in message
    assert main(["estimate", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and path in err and "Traceback" not in err


def test_missing_file_and_directory(tmp_path):
    for target in (str(tmp_path / "nope.yaml"), str(tmp_path)):
        with pytest.raises(ConfigError, match="not found|directory"):
            load_config(target)


def test_binary_junk(write, tmp_path):
    path = tmp_path / "junk.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="junk.yaml: not"):
        load_config(str(path))


def test_cli_flag_error_names_flag(write, capsys):
    path = write(BASE)
    assert main(["estimate", path, "--offload-params", "cpu", "--zero-stage", "2"]) == 2
    assert "--offload-params" in capsys.readouterr().err


def test_hf_config_llama_and_gpt2(write, tmp_path):
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000, "hidden_act": "silu",
             "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_bias": False}
    (tmp_path / "llama.json").write_text(json.dumps(llama))
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
            "vocab_size": 50257, "activation_function": "gelu_new", "attn_pdrop": 0.1, "resid_pdrop": 0.1,
            "embd_pdrop": 0.1}
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    for name, count in (("llama.json", 6_738_415_616), ("gpt2.json", 124_439_808)):
        cfg = load_config(write(BASE.replace("preset: llama2-7b", f"hf_config: {name}")))
        assert cfg.model.num_parameters == count
        assert cfg.model.implementation == "hf"  # predicted as the transformers class
    # explicit fields override the HF file
    cfg = load_config(write(BASE.replace("preset: llama2-7b", "hf_config: llama.json, num_hidden_layers: 2")))
    assert cfg.model.num_hidden_layers == 2


def test_python_m_and_console_script_agree(write):
    path = write(BASE.replace("gpu: a100-80gb", "gpu: a100-90gb"))
    outs = [subprocess.run(cmd + ["estimate", path], capture_output=True, text=True, timeout=120)
            for cmd in ([sys.executable, "-m", "autotune"], [sys.executable, "-c",
                        "import sys; from autotune.cli import main; sys.exit(main())"])]
    assert {o.returncode for o in outs} == {2}
    assert outs[0].stderr == outs[1].stderr and "hardware.gpu" in outs[0].stderr
