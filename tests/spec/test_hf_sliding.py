"""Qwen2/Qwen3 with use_sliding_window: true slide the layers from max_window_layers on; their masks are
not modelled, so such a config is refused in one line (never sized as if every layer were full)."""

import json
import os

import pytest

from conftest import ROOT
from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.hf_config import map_hf_config


def _job(tmp_path, **changes):
    cfg = json.load(open(os.path.join(ROOT, "tests", "data", "hf", "qwen2-0.5b.json")))
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    job = tmp_path / "job.yaml"
    job.write_text("model: {hf_config: config.json}\ntraining: {seq_len: 1024, global_batch_size: 8}\n"
                   "hardware: {gpu: a100-80gb, gpus_per_node: 8}\n")
    return str(job)


def test_sliding_layers_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"slides 4 of 24 layers .* use_sliding_window: false") as err:
        load_config(_job(tmp_path, use_sliding_window=True, max_window_layers=20))
    assert err.value.path == "model.hf_config" and "\n" not in str(err.value)  # the CLI prints it as one line
    with pytest.raises(ConfigError, match="slides 2 of 24"):
        load_config(_job(tmp_path, use_sliding_window=True,
                         layer_types=["full_attention"] * 22 + ["sliding_attention"] * 2))


def test_configs_whose_layers_all_attend_fully_are_described():
    # the published config (use_sliding_window false), a window from past the last layer, no window at all
    cfg = json.load(open(os.path.join(ROOT, "tests", "data", "hf", "qwen2-0.5b.json")))
    for changes in ({}, {"use_sliding_window": True, "max_window_layers": 24},
                    {"use_sliding_window": True, "sliding_window": None}):
        assert map_hf_config({**cfg, **changes}, "config.json")["num_hidden_layers"] == 24
    with pytest.raises(ConfigError, match="slides 1 of 24"):
        map_hf_config({**cfg, "use_sliding_window": True, "max_window_layers": 23}, "config.json")
