"""autotune.worker.routing: the recorder an expert-parallel job's worker installs on its experts."""

from __future__ import annotations

import pytest

from autotune.worker.routing import RoutingRecorder


def test_recorder_keeps_the_measured_micro_steps_dispatches():
    """Installed on the modules expert_parallel laid out (an ``ep_group``) only; dispatches before the first
    measured forward (the warm-up) are not kept; each measured forward opens a micro-step that keeps its
    dispatches and its recomputations'; without any dispatch no result."""
    torch = pytest.importorskip("torch")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].ep_group = model[2].ep_group = object()
    model[0].on_dispatch = model[2].on_dispatch = None
    rec = RoutingRecorder.install(model)
    assert model[0].on_dispatch == rec.dispatch and model[2].on_dispatch == rec.dispatch
    assert not hasattr(model[1], "on_dispatch") and rec.result() is None
    model[0].on_dispatch(8, [1, 3, 2, 2])  # warm-up
    rec.open_micro_step()
    model[0].on_dispatch(8, [2, 2, 3, 1])
    model[2].on_dispatch(8, [4, 0, 2, 2])
    rec.open_micro_step()
    model[0].on_dispatch(8, [1, 1, 3, 3])
    assert rec.result() == {"sent": 8, "steps": [[[2, 2, 3, 1], [4, 0, 2, 2]], [[1, 1, 3, 3]]]}
    assert RoutingRecorder.install(torch.nn.Linear(2, 2)) is None
