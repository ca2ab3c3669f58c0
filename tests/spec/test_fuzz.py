"""Fuzzing the loaders and the CLI with malformed and adversarial job files and search spaces.

Every input must end in exit status 0 (it happened to be valid) or 2 with exactly one stderr line
``autotune: error: FILE: KEY.PATH: message`` — never a traceback, never a hang (hypothesis
deadlines; the subprocess cases have a timeout). ``FUZZ_COUNTS`` records how many inputs were
thrown and rejected; benchmarks/reliability.py prints the same figures.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.cli import main
from autotune.config import key_name, load_config
from autotune.errors import ConfigError
from autotune.space import load_space

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VALID = {
    "model": {"preset": "llama2-7b"},
    "training": {"seq_len": 4096, "global_batch_size": 64, "precision": "bf16", "optimizer": "adamw"},
    "hardware": {"gpu": "a100-80gb", "gpus_per_node": 8, "num_nodes": 1, "cpu_memory_gib": 1024,
                 "nvme": {"capacity_gib": 1000, "bandwidth_gbps": 3}},
    "strategy": {"zero_stage": 3, "micro_batch_size": 1, "checkpointing": "full", "offload_optimizer": "cpu",
                 "offload_params": "cpu", "precision": "bf16", "reduce_bucket_size": 500000000},
    "search": {"space": "default", "trials": 10, "sampler": "nsga2", "headroom": 0.05, "seed": 0},
    "profile": {"backend": "simulate", "warmup_steps": 1, "measure_steps": 2, "timeout_s": 60,
                "launcher": "torchrun"},
}
EXPLICIT_MODEL = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                  "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
                  "hidden_act": "silu", "norm": "rmsnorm", "max_position_embeddings": 4096,
                  "attention_dropout": 0.0, "head_dim": 128}
VALID_SPACE = {"zero_stage": [0, 1, 2, 3], "offload_optimizer": ["none", "cpu"], "offload_params": ["none"],
               "micro_batch_size": {"low": 1, "high": 8, "powers_of_two": True},
               "checkpointing": ["none", "full"], "checkpoint_layers": {"fractions": [0.5, 1.0]},
               "precision": ["bf16"], "reduce_bucket_size": ["auto", 200000000]}

YAML_BREAKS = set("\x85\u2028\u2029")
"""PyYAML's emitter writes these unescaped and its reader folds them: not a round-trip of the key."""

FUZZ_COUNTS = {"configs": 0, "spaces": 0, "rejected": 0}

ADVERSARIAL = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**63, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324]),
    st.text(max_size=30),
    st.sampled_from(["", " ", "\u202e\u0000x", "💥" * 50, "a" * 5000, "auto", "all", "none", "../../etc/passwd"]),
    st.lists(st.integers(), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def leaf_paths(tree: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for k, v in tree.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out.extend(leaf_paths(v, prefix + (k,)))
    return out


def set_path(tree: dict, path: tuple, value) -> dict:
    tree = copy.deepcopy(tree)
    node = tree
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return tree


def del_path(tree: dict, path: tuple) -> dict:
    tree = copy.deepcopy(tree)
    node = tree
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    return tree


def dump(data) -> str:
    """YAML text for arbitrary data (NaN/inf included; JSON cannot say them, YAML can)."""
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err


def check_outcome(code: int, err: str, file: str, key_path: str | None = None) -> None:
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err, err
    if code == 2:
        FUZZ_COUNTS["rejected"] += 1
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("autotune: error: "), err
        assert file in lines[0], err
        assert len(lines[0]) < 1200, len(lines[0])
        if key_path is not None:
            assert key_path in lines[0], (key_path, err)


def _cfg_text(tmp_path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return str(path)


FUZZ = settings(max_examples=int(os.environ.get("AUTOTUNE_FUZZ_EXAMPLES", "120")), deadline=3000,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], database=None)


# ---------------------------------------------------------------- structured mutations of a valid job


@FUZZ
@given(data=st.data())
def test_fuzz_config_values(tmp_path, capsys, data):
    """One key of a valid job gets an adversarial value; the error names that key."""
    base = copy.deepcopy(VALID)
    if data.draw(st.booleans()):
        base["model"] = dict(EXPLICIT_MODEL)
    path = data.draw(st.sampled_from(leaf_paths(base)))
    value = data.draw(ADVERSARIAL)
    file = _cfg_text(tmp_path, dump(set_path(base, path, value)))
    FUZZ_COUNTS["configs"] += 1
    code, err = run_cli(["estimate", file], capsys)
    # A cross-field rule (e.g. heads vs hidden size, ZeRO vs offload) may name a sibling key.
    check_outcome(code, err, file, key_path=None)
    if code == 2 and len(path) > 1 and not any(w in err for w in ("must", "needs", "requires", "only")):
        assert ".".join(map(str, path[:2])) in err or str(path[0]) in err, (path, err)


@FUZZ
@given(data=st.data())
def test_fuzz_config_structure(tmp_path, capsys, data):
    """Unknown keys, deleted keys, sections of the wrong kind, non-mapping roots."""
    base = copy.deepcopy(VALID)
    kind = data.draw(st.sampled_from(["unknown", "delete", "section", "root", "key_type"]))
    expect = None
    if kind == "unknown":
        where = data.draw(st.sampled_from([(), ("model",), ("training",), ("hardware",), ("hardware", "nvme"),
                                           ("strategy",), ("search",), ("profile",)]))
        key = data.draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in ("<<",) and not YAML_BREAKS & set(k)))
        node = base
        for k in where:
            node = node[k]
        if key in node:
            return
        node[key] = data.draw(ADVERSARIAL)
        expect = ".".join([*where, key_name(key)])
        text = dump(base)
    elif kind == "delete":
        path = data.draw(st.sampled_from(leaf_paths(base)))
        text = dump(del_path(base, path))
    elif kind == "section":
        section = data.draw(st.sampled_from(list(base)))
        base[section] = data.draw(st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=10),
                                            st.integers(), st.floats()))
        expect = section
        text = dump(base)
    elif kind == "root":
        text = dump(data.draw(st.one_of(st.lists(st.integers()), st.text(), st.integers(), st.floats(),
                                        st.booleans())))
    else:
        base["training"][data.draw(st.one_of(st.integers(), st.booleans(), st.none()))] = 1
        expect = "training"
        text = dump(base)
    file = _cfg_text(tmp_path, text)
    FUZZ_COUNTS["configs"] += 1
    code, err = run_cli(["estimate", file], capsys)
    check_outcome(code, err, file, key_path=expect if kind != "section" or expect != "strategy" else None)
    if kind in ("unknown", "root", "key_type"):
        assert code == 2


@FUZZ
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300)))
def test_fuzz_raw_bytes(tmp_path, capsys, raw):
    """Binary junk and random text."""
    path = tmp_path / "junk.yaml"
    path.write_bytes(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass"))
    FUZZ_COUNTS["configs"] += 1
    code, err = run_cli(["estimate", str(path)], capsys)
    check_outcome(code, err, str(path))
    assert code == 2  # no random input is a whole job file


def bomb(depth: int = 12, width: int = 9, kind: str = "list") -> str:
    """Billion laughs: ``width ** depth`` leaves through aliases (a DAG, tiny on disk)."""
    lines = ["a0: &a0 [lol]"]
    for i in range(1, depth):
        refs = ", ".join([f"*a{i - 1}"] * width)
        lines.append(f"a{i}: &a{i} [{refs}]" if kind == "list" else
                     f"a{i}: &a{i} {{{', '.join(f'k{j}: *a{i - 1}' for j in range(width))}}}")
    return "\n".join(lines)


ADVERSARIAL_TEXTS = {
    "empty": "",
    "whitespace": "   \n\n",
    "comment only": "# nothing\n",
    "null": "null\n",
    "deep list": "[" * 5000 + "]" * 5000,
    "deep map": "a: " + "{a: " * 3000 + "1" + "}" * 3000,
    "recursive alias": "model: &m {x: *m}\ntraining: {}\nhardware: {}\n",
    "recursive list": "model: &m [*m]\ntraining: {}\nhardware: {}\n",
    "bomb as root": bomb(),
    "bomb as model": bomb() + "\nmodel: *a11\ntraining: *a11\nhardware: *a11\n",
    "map bomb": bomb(kind="map") + "\nmodel: *a11\n",
    "bomb in value": dump(VALID).replace("seq_len: 4096", "seq_len: *a11").replace("model:", bomb() + "\nmodel:", 1),
    "bomb in name": dump(VALID).replace("preset: llama2-7b", "name: *a11").replace("model:", bomb() + "\nmodel:", 1),
    "bomb in strategy": dump(VALID).replace("zero_stage: 3", "zero_stage: *a11").replace("model:", bomb() + "\nmodel:", 1),
    "python tag": "!!python/object/apply:os.system ['echo pwned']\n",
    "python name": "model: !!python/name:os.system\n",
    "unhashable key": "? [a, b]\n: 1\n",
    "merge key": "base: &b {seq_len: 1}\ntraining: {<<: *b, global_batch_size: 1}\n",
    "timestamp": dump(VALID).replace("seq_len: 4096", "seq_len: 2001-12-14"),
    "binary tag": dump(VALID).replace("seq_len: 4096", "seq_len: !!binary aGVsbG8="),
    "set": dump(VALID).replace("seq_len: 4096", "seq_len: !!set {a, b}"),
    "huge int": dump(VALID).replace("seq_len: 4096", "seq_len: " + "9" * 5000),
    "huge float": dump(VALID).replace("seq_len: 4096", "seq_len: 1e99999"),
    "nan": dump(VALID).replace("headroom: 0.05", "headroom: .nan"),
    "inf": dump(VALID).replace("memory_gib", "x").replace("cpu_memory_gib: 1024", "cpu_memory_gib: .inf"),
    "bom": "\ufeff" + dump(VALID).replace("seq_len: 4096", "seq_len: x"),
    "tabs": "model:\n\tpreset: llama2-7b\n",
    "duplicate anchors": "a: &x 1\nb: &x 2\nmodel: *y\n",
    "long line": "model: " + "x" * 2_000_000 + "\n",
    "many keys": "\n".join(f"k{i}: {i}" for i in range(20000)),
    "nul": "model: {preset: llama2-7b}\x00\n",
    "lone surrogate escaped": 'model: {preset: "\\ud800"}\ntraining: {}\nhardware: {}\n',
    "control chars": "model: {preset: \x07\x1b[31m}\n",
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_TEXTS))
def test_adversarial_texts(tmp_path, capsys, name):
    file = _cfg_text(tmp_path, ADVERSARIAL_TEXTS[name])
    FUZZ_COUNTS["configs"] += 1
    code, err = run_cli(["estimate", file], capsys)
    check_outcome(code, err, file)
    assert code == 2
    assert "pwned" not in err


def test_directory_missing_and_unreadable_paths(tmp_path, capsys):
    for path in (str(tmp_path), str(tmp_path / "missing.yaml"), "/dev/null", "/proc/self/mem"):
        FUZZ_COUNTS["configs"] += 1
        code, err = run_cli(["estimate", path], capsys)
        check_outcome(code, err, path)
        assert code == 2


# ---------------------------------------------------------------- HF config.json through model.hf_config

HF_KEYS = ["model_type", "n_embd", "n_layer", "n_head", "n_inner", "vocab_size", "activation_function",
           "d_model", "n_layers", "n_heads", "expansion_ratio", "attn_config", "attn_pdrop", "resid_pdrop",
           "num_attention_heads", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
           "tie_word_embeddings", "attention_dropout", "max_position_embeddings", "num_key_value_heads"]
HF_BASE = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100}


@pytest.fixture(scope="module")
def hf_warm():
    """model.hf_config counts parameters with transformers on the meta device (autotune.hf_count) and
    measures a shrunk block (autotune.hf_blocks): with torch and transformers imported in this process
    both run here, not in a child process per fuzzed file (seconds each, past hypothesis's per-example
    deadline); imported and warmed once, outside it."""
    import importlib.util

    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        import torch  # noqa: F401
        import transformers  # noqa: F401
    from autotune.hf_count import hf_parameter_count

    hf_parameter_count(dict(HF_BASE), 1)


@FUZZ
@given(data=st.data())
def test_fuzz_hf_config(tmp_path, capsys, data, hf_warm):
    hf = dict(HF_BASE)
    hf["model_type"] = data.draw(st.sampled_from(["llama", "gpt2", "mpt", "qwen2", "mistral"]))
    for _ in range(data.draw(st.integers(1, 3))):
        hf[data.draw(st.sampled_from(HF_KEYS))] = data.draw(ADVERSARIAL.filter(
            lambda v: not (isinstance(v, float) and not math.isfinite(v))))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    file = _cfg_text(tmp_path, dump({**VALID, "model": {"hf_config": "config.json"}}))
    FUZZ_COUNTS["configs"] += 1
    code, err = run_cli(["estimate", file], capsys)
    check_outcome(code, err, file)


def test_hf_config_not_an_object_or_junk(tmp_path, capsys):
    for text in ("[1, 2]", "\x00\x01", "{", '"x"', "NaN"):
        (tmp_path / "config.json").write_text(text)
        file = _cfg_text(tmp_path, dump({**VALID, "model": {"hf_config": "config.json"}}))
        FUZZ_COUNTS["configs"] += 1
        code, err = run_cli(["estimate", file], capsys)
        check_outcome(code, err, file, "model.hf_config")
        assert code == 2


# ---------------------------------------------------------------- search spaces


@FUZZ
@given(data=st.data())
def test_fuzz_space_loader(tmp_path, data):
    space = copy.deepcopy(VALID_SPACE)
    kind = data.draw(st.sampled_from(["value", "element", "unknown", "root", "range"]))
    expect = None
    if kind == "value":
        knob = data.draw(st.sampled_from(list(space)))
        space[knob] = data.draw(ADVERSARIAL)
        expect = knob
    elif kind == "element":
        knob = data.draw(st.sampled_from([k for k, v in space.items() if isinstance(v, list)]))
        space[knob] = [*space[knob], data.draw(ADVERSARIAL)]
        expect = knob
    elif kind == "unknown":
        key = data.draw(st.text(min_size=1, max_size=10).filter(
            lambda k: k not in space and k != "<<" and not YAML_BREAKS & set(k)))
        space[key] = [1]
        expect = key_name(key)
    elif kind == "range":
        space["micro_batch_size"] = {k: data.draw(ADVERSARIAL) for k in
                                     data.draw(st.lists(st.sampled_from(["low", "high", "step", "powers_of_two",
                                                                         "x"]), max_size=4, unique=True))}
        expect = "micro_batch_size"
    else:
        space = data.draw(st.one_of(st.lists(st.integers()), st.text(), st.integers(), st.none()))
    path = tmp_path / "space.yaml"
    path.write_text(dump(space), encoding="utf-8", errors="surrogatepass")
    FUZZ_COUNTS["spaces"] += 1
    try:
        load_space(str(path))
    except ConfigError as err:
        FUZZ_COUNTS["rejected"] += 1
        line = str(err)
        assert "\n" not in line and str(path) in line, line
        if expect is not None:
            assert expect in line, (expect, line)
    else:
        assert kind in ("value", "element", "range")


@pytest.mark.parametrize("name", ["empty", "deep list", "bomb as root", "recursive list", "python tag", "nul",
                                  "huge int", "map bomb"])
def test_adversarial_space_texts(tmp_path, name):
    path = tmp_path / "space.yaml"
    text = ADVERSARIAL_TEXTS[name].replace("model:", "zero_stage:")
    if name == "huge int":
        text = "zero_stage: [" + "9" * 5000 + "]\n"
    path.write_text(text)
    FUZZ_COUNTS["spaces"] += 1
    with pytest.raises(ConfigError) as info:
        load_space(str(path))
    FUZZ_COUNTS["rejected"] += 1
    assert str(path) in str(info.value) and "\n" not in str(info.value)


SPACE_CLI_CASES = {
    "unknown knob": "zero_stage: [0]\ncolour: [red]\n",
    "bad stage": "zero_stage: [5]\n",
    "empty list": "zero_stage: []\n",
    "bomb": bomb() + "\n",
    "range bomb": "micro_batch_size: {low: 1, high: 100000000000}\n",
    "directory": None,
}


@pytest.mark.parametrize("name", sorted(SPACE_CLI_CASES))
def test_bad_space_through_run(tmp_path, capsys, name):
    if SPACE_CLI_CASES[name] is None:
        (tmp_path / "dir.yaml").mkdir()
        space = "dir.yaml"
    else:
        (tmp_path / "space.yaml").write_text(SPACE_CLI_CASES[name])
        space = "space.yaml"
    file = _cfg_text(tmp_path, dump({**VALID, "search": {"space": space, "trials": 2}}))
    FUZZ_COUNTS["spaces"] += 1
    code, err = run_cli(["run", file, "--out", str(tmp_path / "runs"), "--trials", "2"], capsys)
    assert code == 2, err
    FUZZ_COUNTS["rejected"] += 1
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "space" in err


# ---------------------------------------------------------------- through a real process


SUBPROCESS_CASES = ["bomb as model", "deep list", "python tag", "empty", "bomb in name", "huge int", "nul"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_subprocess_one_line_exit_2(tmp_path, name):
    file = _cfg_text(tmp_path, ADVERSARIAL_TEXTS[name])
    FUZZ_COUNTS["configs"] += 1
    for cmd in (["estimate", file], ["run", file, "--out", str(tmp_path / "runs")]):
        proc = subprocess.run([sys.executable, "-m", "autotune", *cmd], capture_output=True, text=True, timeout=60,
                              cwd=ROOT)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("autotune: error: ") and file in lines[0], proc.stderr[-2000:]
        FUZZ_COUNTS["rejected"] += 1


def test_subprocess_binary_junk_and_directory(tmp_path):
    junk = tmp_path / "junk.yaml"
    junk.write_bytes(bytes(range(256)) * 40)
    for path in (str(junk), str(tmp_path)):
        proc = subprocess.run([sys.executable, "-m", "autotune", "run", path, "--out", str(tmp_path / "r")],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        FUZZ_COUNTS["configs"] += 1
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        FUZZ_COUNTS["rejected"] += 1


def test_zzz_fuzz_volume():
    """Runs last in this module: at least 200 inputs were thrown (and most rejected)."""
    if FUZZ_COUNTS["configs"] + FUZZ_COUNTS["spaces"] < 50:
        pytest.skip("run with the whole module to count")
    assert FUZZ_COUNTS["configs"] + FUZZ_COUNTS["spaces"] >= 200, FUZZ_COUNTS
    assert FUZZ_COUNTS["rejected"] >= 200, FUZZ_COUNTS
