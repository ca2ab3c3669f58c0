"""The search's residual-model features are read off the knobs' ``feature`` metadata: a knob added to
a copy of Strategy gets features without another edit, and each kind encodes as documented."""

import dataclasses
import math
from typing import Literal

from autotune import knobs
from autotune.knobs import ONE_HOT, knob
from autotune.samplers.front import features
from autotune.strategy import KNOBS, Strategy


SPANS = {**knobs.feature_spans(Strategy, [Strategy()]), "micro_batch_size": (1, 8)}


def _dist(a, b):
    return math.dist(features(a, 32, SPANS), features(b, 32, SPANS))


def test_every_searched_knob_but_the_block_counts_has_a_feature():
    # checkpoint_every / checkpoint_layers are seen through checkpointing's block fraction
    fields = {f.name: f for f in knobs.knob_fields(Strategy)}
    without = {k for k in KNOBS if fields[k].metadata["feature"] is None}
    assert without == {"checkpoint_every", "checkpoint_layers"}


def test_each_kind_moves_the_features_as_documented():
    base = Strategy(zero_stage=1, micro_batch_size=1)
    assert math.isclose(_dist(base, dataclasses.replace(base, zero_stage=3)), 1.0)  # levels: unit distance
    assert math.isclose(_dist(base, dataclasses.replace(base, micro_batch_size=8)), 1.0)  # log2 over the span
    assert math.isclose(_dist(base, dataclasses.replace(base, micro_batch_size=2)), 1 / 3)
    assert math.isclose(_dist(base, dataclasses.replace(base, reduce_bucket_size=10**6)), 0.5)  # set
    assert math.isclose(_dist(base, dataclasses.replace(base, checkpointing="full")), 1.0)  # blocks: all
    assert math.isclose(_dist(base, dataclasses.replace(base, checkpointing="full", checkpoint_layers=8)), 0.25)
    fsdp = Strategy(engine="fsdp2")
    assert _dist(fsdp, dataclasses.replace(fsdp, sharding="hybrid")) == 0.5  # switch
    assert _dist(fsdp, dataclasses.replace(fsdp, sharding="full")) == 0.0


def test_a_knob_added_to_a_copy_of_strategy_gets_its_features():
    extended = dataclasses.make_dataclass("Extended", [
        ("tensor_parallel", Literal[1, 2, 4], knob(1, search_order=15, flag=True, feature=("levels", ONE_HOT),
                                                   help="Tensor-parallel degree.")),
        ("chunks", int, knob(1, search_order=16, flag=True, int_range=(1, 64), feature=("log2", 1.0),
                             help="Loss chunks.")),
    ], bases=(Strategy,), frozen=True)
    s = extended(tensor_parallel=2, chunks=4)
    spans = knobs.feature_spans(extended, [s, extended(chunks=16)])
    assert spans["chunks"] == (4, 16)
    base = knobs.features(Strategy, Strategy(), 32, {**SPANS, "micro_batch_size": (1, 1)})
    got = knobs.features(extended, s, 32, {**SPANS, **spans, "micro_batch_size": (1, 1)})
    assert len(got) == len(base) + 3 + 1
    assert got[-4:] == [0.0, ONE_HOT, 0.0, 0.0]
