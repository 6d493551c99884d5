"""Test-wide settings: one torch thread (tiny ops; CI shares 2 cores with Ray workers), and the
`cluster` marker on every test that serves a cluster: those on the session cluster (the fixture
`cluster` of `tests/deployments`, one Ray for the session, its modules in file order) and every test
marked `slow` (the served benches, exposure, chaos, soak, drain). `make test` (`tests/split_run.py`)
runs those in one pytest process, one after another as a plain `pytest` would, beside the unit tests
(the deployment shells' own tests among them: no Ray) in another."""

import pytest
import torch

torch.set_num_threads(1)

SESSION_CLUSTER = "cluster"  # the session-scoped fixture of tests/deployments/conftest.py: one Ray, two apps


def runs_a_cluster(item: pytest.Item) -> bool:
    """Whether `item` serves a cluster: it uses the session cluster or is marked slow."""
    return SESSION_CLUSTER in getattr(item, "fixturenames", ()) or item.get_closest_marker("slow") is not None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marked as it is collected, so `-m cluster` / `-m "not cluster"` select by it."""
    if runs_a_cluster(item):
        item.add_marker(pytest.mark.cluster)
