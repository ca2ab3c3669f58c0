"""One knob list: every list of knobs, checker, column, flag and docs row is read off Strategy's fields."""

import argparse
import ast
import dataclasses
import itertools
import os
import pathlib
from typing import Literal

import pytest

from autotune.cli import build_parser
from autotune.commands.estimate import add_strategy_flags
from autotune.config import STRATEGY_SCHEMA, load_config, strategy_schema
from autotune.errors import ConfigError
from autotune.knob_docs import BEGIN, END
from autotune.knobs import MEMORY_TERMS, knob, knob_fields, knob_table, long_context_fields, memory_key, nesting, searched
from autotune.presets import gpu_from_name, model_from_name
from autotune.runfiles import CSV_COLUMNS, csv_columns, strategy_from_record
from autotune.space import load_space, space_schema
from autotune.spec import HardwareSpec, TrainingSpec
from autotune.strategy import CHECKPOINTINGS, FLAG_KNOBS, KNOBS, Strategy, ZERO_STAGES, knob_applies, knob_choices
from autotune.engine_configs import long_context_knobs, to_deepspeed_config
from conftest import BASE, ROOT

FIELDS = [f.name for f in dataclasses.fields(Strategy)]
NEEDS_MOE = ("expert_parallel_size",)
"""Knobs whose other value only a mixture-of-experts model takes (autotune.config refuses MoE job files
until their memory model lands, so the job-file test sees the rule's refusal)."""
LLAMA = model_from_name("llama2-7b")


def _other_value(name):
    """A value of the knob other than its default that a 64-sequence, 8-GPU llama2-7b job accepts."""
    choices = knob_choices(name)
    if choices is not None:
        return next(c for c in choices if c != Strategy.__dataclass_fields__[name].default)
    return {"micro_batch_size": 2, "checkpoint_every": 4, "checkpoint_layers": 8, "sequence_parallel_size": 2,
            "context_parallel_size": 2, "expert_parallel_size": 2}.get(name, 12345)


def _context(name):
    """Other knobs that make ``name``'s other value valid and applicable: fsdp2 for its knobs,
    ZeRO-3 for the offloads and buffers, checkpointing on for the checkpointing knobs."""
    if knob_applies(name, {"engine": "fsdp2"}) and not knob_applies(name, {}):
        return {"engine": "fsdp2"}
    context = {} if name in ("engine", "zero_stage") else {"zero_stage": 2 if name == "allgather_bucket_size" else 3}
    ckpt = name.startswith("checkpoint_") or name == "activation_offload"
    return {**context, **({"checkpointing": "full"} if ckpt else {})}


def test_every_knob_round_trips_through_a_trials_csv_cell():
    """Each column a trials.csv row writes (str() of the value, as csv does) reads back as the knob
    (strategy_from_record types it from the field: a wrong typing rule fails here)."""
    for name in KNOBS:
        s = Strategy(**_context(name), **{name: _other_value(name)})
        row = {k: "" if getattr(s, k) is None else str(getattr(s, k)) for k in KNOBS}
        assert strategy_from_record(row) == s, name
    assert CSV_COLUMNS.index("number") < CSV_COLUMNS.index(KNOBS[0]) < CSV_COLUMNS.index("pred_peak_gib")


def _yaml(values):
    return "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in values.items()) + "}"


def test_the_job_file_checks_every_knob(write):
    """Each knob of a job's strategy section takes its other value and refuses a wrong one, naming
    strategy.<knob> (a field missing from STRATEGY_SCHEMA would be 'unknown key')."""
    two_nodes = BASE.replace("gpus_per_node: 8", "gpus_per_node: 4, num_nodes: 2")
    for name in FIELDS:
        value = _other_value(name)
        text = two_nodes + f"strategy: {_yaml({**_context(name), name: value})}\n"
        if name in NEEDS_MOE:  # llama2-7b is dense: the value is read, then refused by its rule
            with pytest.raises(ConfigError, match="mixture-of-experts") as err:
                load_config(write(text))
            assert err.value.path == f"strategy.{name}", name
        else:
            assert getattr(load_config(write(text)).strategy, name) == value, name
        with pytest.raises(ConfigError) as err:
            load_config(write(BASE + f"strategy: {{{name}: [1]}}\n"))
        assert err.value.path == f"strategy.{name}", name


def test_a_space_file_takes_every_searched_knob(write):
    """Each searched knob listed in a space file with its other value is what every candidate
    that the knob applies to carries."""
    for name in KNOBS:
        lines = [f"{k}: [{str(v).lower()}]" for k, v in {**_context(name), name: _other_value(name)}.items()]
        space = load_space(write("\n".join(lines) + "\n", "space.yaml"))
        cands = [s for s in space.candidates(LLAMA) if knob_applies(name, s)]
        assert cands and all(getattr(s, name) == _other_value(name) for s in cands), name
    # a field that is not searched is not a space file's key: refused, naming it
    with pytest.raises(ConfigError) as err:
        load_space(write("param_persistence_threshold: [100]\n", "space.yaml"))
    assert err.value.path == "param_persistence_threshold" and "unknown key" in str(err.value)


def test_estimate_flags_are_the_flag_knobs_with_their_literal_choices():
    """``autotune estimate`` parses each flag knob's other value from its text to the knob's typed
    value, refuses a value outside its type or Literal, and prints the field's help under --help."""
    estimate = build_parser()._subparsers._group_actions[0].choices["estimate"]
    for name in FLAG_KNOBS:
        value, choices = _other_value(name), knob_choices(name)
        flag = "--" + name.replace("_", "-")
        args = estimate.parse_args(["job.yaml", flag, str(value).lower()])
        assert getattr(args, name) == value and type(getattr(args, name)) is type(value), name
        bad = "maybe" if isinstance(value, bool) else "5" if choices and isinstance(choices[0], int) else "two"
        with pytest.raises(SystemExit):
            estimate.parse_args(["job.yaml", flag, bad])
    shown = " ".join(estimate.format_help().split())
    assert all(" ".join(Strategy.__dataclass_fields__[k].metadata["help"].split()) in shown for k in FLAG_KNOBS)


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
        for knob_name, key in ds_key.items():
            assert knob_applies(knob_name, s) == (key in ds["zero_optimization"]), (zero, knob_name)
        assert "activation_checkpointing" not in ds  # applied in the model, never by the DeepSpeed config
        assert knob_applies("checkpoint_layers", {"zero_stage": zero, "checkpointing": ckpt}) == (ckpt != "none")


def test_a_field_added_to_a_copy_of_strategy_reaches_every_artefact(write):
    """Adding a knob is one field: a copy of Strategy with two more (a Literal one and an integer
    one) gets them in the job-file checkers, the space schema, the CLI flags, the trials.csv
    columns, the candidates' nesting and the docs table."""
    extended = dataclasses.make_dataclass("Extended", [
        ("tensor_parallel", Literal[1, 2, 4], knob(1, search_order=25, flag=True, help="Tensor-parallel degree.")),
        ("chunks", int, knob(1, search_order=26, flag=True, int_range=(1, 64), engine="fsdp2",
                             help="Loss chunks.")),
    ], bases=(Strategy,), frozen=True)
    new = ("tensor_parallel", "chunks")
    assert searched(extended)[-2:] == new and nesting(extended)[-2:] == new
    assert [f.name for f in knob_fields(extended)][-2:] == list(new)
    schema = strategy_schema(extended)
    assert set(schema) - set(STRATEGY_SCHEMA) == set(new)
    assert schema["tensor_parallel"](4, "strategy.tensor_parallel") == 4
    with pytest.raises(ConfigError, match="strategy.tensor_parallel"):
        schema["tensor_parallel"](3, "strategy.tensor_parallel")
    with pytest.raises(ConfigError):
        schema["chunks"](65, "strategy.chunks")
    space = space_schema(extended)
    assert space["tensor_parallel"]([1, 2], "tensor_parallel") == (1, 2)
    assert space["chunks"]({"low": 1, "high": 8, "powers_of_two": True}, "chunks") == (1, 2, 4, 8)
    parser = argparse.ArgumentParser()
    add_strategy_flags(parser, extended)
    args = parser.parse_args(["--tensor-parallel", "2", "--chunks", "8"])
    assert (args.tensor_parallel, args.chunks) == (2, 8)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tensor-parallel", "3"])
    columns = csv_columns(extended)
    assert columns[2:2 + len(KNOBS) + 2] == [*KNOBS, *new]
    # a knob that names no memory terms is in every cache key of the screen (none can go stale)
    assert all(memory_key(extended, term)[-2:] == new for term in MEMORY_TERMS)
    assert memory_key(extended, "units") == memory_key(Strategy, "units") + new
    assert [f.name for f in long_context_fields(extended)] == [f.name for f in long_context_fields(Strategy)]
    table = knob_table(extended)
    assert "| `tensor_parallel` (`--tensor-parallel`) | 1, 2, 4 | 1 | 1 | always | Tensor-parallel degree. |" in table
    assert "| `chunks` (`--chunks`) | integer 1..64 | 1 | 1 | engine fsdp2 | Loss chunks. |" in table
    assert table.count("\n") == knob_table(Strategy).count("\n") + 2


def test_no_module_but_strategy_lists_knob_names():
    """A tuple, list, set or call that names two or more knobs in string literals is a knob list;
    only strategy.py writes those (the rest read them off the fields: memory_key, long_context_fields,
    searched, ...). Config files' keys (dict keys) are not lists of knobs."""
    names = set(FIELDS)
    offenders = []
    for path in sorted(pathlib.Path(ROOT, "autotune").rglob("*.py")):
        if path.name == "strategy.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            elts = (node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                    else node.args if isinstance(node, ast.Call) else [])
            named = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
            if len(named) >= 2:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(named)}")
    assert not offenders


def test_long_context_knobs_are_the_marked_fields_off_their_defaults():
    assert long_context_knobs(Strategy()) == {}
    s = Strategy(sequence_parallel_size=4, tiled_loss=True, checkpointing="full", activation_offload="cpu")
    assert long_context_knobs(s) == {"sequence_parallel_size": 4, "tiled_loss": True, "activation_offload": "cpu"}
    assert long_context_knobs(Strategy(engine="fsdp2", context_parallel_size=2)) == {"context_parallel_size": 2}


def test_docs_config_holds_the_generated_knob_table():
    """docs/config.md carries, between its markers, exactly what ``python -m autotune.knob_docs`` writes."""
    with open(os.path.join(ROOT, "docs", "config.md")) as fh:
        text = fh.read()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    inside = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert inside == "\n" + knob_table(Strategy), "regenerate: python -m autotune.knob_docs docs/config.md"
    assert all(f"`{name}`" in inside for name in FIELDS)


def test_knob_docs_rewrites_only_between_the_markers(tmp_path, capsys):
    from autotune.knob_docs import main

    page = tmp_path / "config.md"
    page.write_text(f"# Title\n\nbefore\n{BEGIN}\nstale table\n{END}\nafter\n")
    assert main([str(page)]) == 0
    assert page.read_text() == f"# Title\n\nbefore\n{BEGIN}\n{knob_table(Strategy)}{END}\nafter\n"
    page.write_text("# no markers\n")
    assert main([str(page)]) == 2 and page.read_text() == "# no markers\n"
    assert "knobs:begin" in capsys.readouterr().err
