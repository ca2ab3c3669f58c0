"""One knob list: every list of knobs, columns and flags is read off Strategy's fields."""

import dataclasses
import itertools

from autotune.cli import build_parser
from autotune.commands.estimate import FLAG_HELP
from autotune.config import STRATEGY_SCHEMA
from autotune.presets import gpu_from_name, model_from_name
from autotune.runfiles import CSV_COLUMNS, STRATEGY_COLUMNS
from autotune.space import SearchSpace
from autotune.spec import HardwareSpec, TrainingSpec
from autotune.strategy import (CHECKPOINTINGS, FLAG_KNOBS, KNOBS, OFFLOADS, Strategy, ZERO_STAGES, knob_applies,
                               to_deepspeed_config)

FIELDS = [f.name for f in dataclasses.fields(Strategy)]


def test_every_list_is_the_strategy_fields():
    assert set(KNOBS) <= set(FIELDS) and set(FLAG_KNOBS) <= set(KNOBS)
    assert STRATEGY_COLUMNS == list(KNOBS) and CSV_COLUMNS[2:2 + len(KNOBS)] == list(KNOBS)
    assert set(STRATEGY_SCHEMA) == set(FIELDS)
    assert set(FLAG_HELP) == set(FLAG_KNOBS)
    space_fields = [f.name for f in dataclasses.fields(SearchSpace)]
    assert set(KNOBS) <= set(space_fields)


def test_estimate_flags_are_the_flag_knobs_with_their_literal_choices():
    estimate = build_parser()._subparsers._group_actions[0].choices["estimate"]
    flags = {a.dest: a for a in estimate._actions if a.dest in FIELDS}
    assert list(flags) == list(FLAG_KNOBS)
    assert tuple(flags["zero_stage"].choices) == ZERO_STAGES
    assert tuple(flags["checkpointing"].choices) == CHECKPOINTINGS
    assert tuple(flags["offload_params"].choices) == OFFLOADS
    assert flags["micro_batch_size"].type is int and flags["micro_batch_size"].choices is None


def test_a_knob_applies_exactly_where_the_deepspeed_config_carries_it():
    model = model_from_name("llama2-7b")
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    hardware = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=8)
    ds_key = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
              "prefetch_bucket_size": "stage3_prefetch_bucket_size",
              "param_persistence_threshold": "stage3_param_persistence_threshold"}
    for zero, ckpt in itertools.product(ZERO_STAGES, CHECKPOINTINGS):
        s = Strategy(zero_stage=zero, checkpointing=ckpt)
        ds = to_deepspeed_config(s, model, training, hardware)
        for knob, key in ds_key.items():
            assert knob_applies(knob, s) == (key in ds["zero_optimization"]), (zero, knob)
        assert knob_applies("checkpoint_layers", s) == ("activation_checkpointing" in ds)
        assert knob_applies("checkpoint_layers", {"zero_stage": zero, "checkpointing": ckpt}) == (ckpt != "none")
