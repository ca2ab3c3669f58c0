"""Trial and study attributes go through one codec (autotune.trial_attrs): each key is a field, written
with ``put`` and read back typed; nothing else in the package names a key."""

import dataclasses
import pathlib
import re

import optuna
import pytest

from conftest import ROOT
from autotune.trial_attrs import OUTCOME_KEYS, StudyAttrs, TrialAttrs, encode, put


def test_put_and_of_round_trip_on_a_real_study():
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), directions=["minimize"])
    put(study, space="default", headroom=0.05)
    trial = study.ask()
    put(trial, duplicate_of=3, fail_reason="out of memory")
    study.tell(trial, 1.0)
    got = TrialAttrs.of(study.trials[0])
    assert (got.duplicate_of, got.fail_reason, got.measurement) == (3, "out of memory", None)
    assert StudyAttrs.of(study) == StudyAttrs(space="default", headroom=0.05)


def test_a_name_that_is_not_a_field_is_refused():
    study = optuna.create_study()
    with pytest.raises(KeyError, match="duplicateof"):
        put(study.ask(), duplicateof=1)
    with pytest.raises(KeyError, match="not StudyAttrs fields: measurement"):
        encode(StudyAttrs, measurement={})
    assert set(OUTCOME_KEYS) <= {f.name for f in dataclasses.fields(TrialAttrs)}


def test_no_module_but_the_codec_spells_an_attribute_key():
    keys = {f.name for cls in (TrialAttrs, StudyAttrs) for f in dataclasses.fields(cls)}
    offenders = []
    for path in pathlib.Path(ROOT, "autotune").rglob("*.py"):
        if path.name == "trial_attrs.py":
            continue
        text = path.read_text()
        for m in re.finditer(r"(set_user_attr\(|user_attrs(\.get\(|\[))\s*[\"']([a-z_]+)[\"']", text):
            offenders.append(f"{path.name}: {m.group(3)}")
        for m in re.finditer(r"[\"']([a-z_]+)[\"']\s+(not )?in\s+\w+\.user_attrs", text):
            offenders.append(f"{path.name}: {m.group(1)}")
    assert not offenders and keys
