"""Search-space files: the shipped ones load; bad ones name file and key path."""

import glob
import os

import pytest

from autotune import model_from_name
from autotune.errors import ConfigError
from autotune.space import SPACES_DIR, load_space

LLAMA = model_from_name("llama2-7b")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(SPACES_DIR, "*.yaml"))))
def test_shipped_spaces_load(path):
    space = load_space(path)
    cands = list(space.candidates(LLAMA))
    assert len(cands) == len({c.key() for c in cands}) > 0


def test_required_spaces_exist_and_default_is_large():
    for name in ("default", "no-offload", "single-gpu"):
        load_space(name)
    assert sum(1 for _ in load_space("default").candidates(LLAMA)) >= 1000


def test_ranges_and_fractions(write):
    path = write("micro_batch_size: {low: 2, high: 20, powers_of_two: true}\n"
                 "checkpointing: [none, full]\ncheckpoint_layers: {fractions: [0.5, 1.0]}\n"
                 "reduce_bucket_size: [auto, 1000]\nzero_stage: [0, 2]\n", "space.yaml")
    space = load_space(path)
    assert space.values["micro_batch_size"] == (2, 4, 8, 16)
    assert space.choices("checkpoint_layers", LLAMA) == [16, 32]
    cands = list(space.candidates(LLAMA))
    # stage 0 ignores buckets: 4 mbs x (1 + 2 ckpt) ; stage 2: x 2 buckets
    assert len(cands) == 4 * 3 + 4 * 3 * 2


@pytest.mark.parametrize("text,where", [
    ("micro_batch_size: [1, 2]\ncolour: [red]\n", "colour"),
    ("micro_batch_size: {low: 8, high: 1}\n", "low <= high"),
    ("micro_batch_size: [1, 1]\n", "unique"),
    ("zero_stage: [5]\n", "zero_stage[0]"),
    ("checkpoint_layers: {fractions: [1.5]}\n", "checkpoint_layers.fractions[0]"),
    ("offload_optimizer: cpu\n", "offload_optimizer"),
    ("- 1\n", "expected a mapping"),
])
def test_bad_space(write, text, where):
    path = write(text, "bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_space(path)
    assert str(info.value).startswith(path) and where in str(info.value)


def test_unknown_space_name():
    with pytest.raises(ConfigError, match="search.space.*default"):
        load_space("does-not-exist")
