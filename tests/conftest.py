"""Test-wide settings: one torch thread (tiny ops; CI shares 2 cores with Ray workers), and the
`cluster` marker on every test that serves a cluster: those on the session cluster (the fixture
`cluster` of `tests/deployments`, one Ray for the session, its modules in file order) and every test
marked `slow` (the served benches, exposure, drain), but those marked `own_server` too. `make test`
(`tests/split_run.py`) runs the `cluster` tests in one pytest process, one after another as a plain
`pytest` would, beside the unit tests (the deployment shells' own tests among them: no Ray) in another.
An `own_server` test (the soak, the smoke sweep) starts `voxray serve` with its own Ray in a
subprocess, late in the unit run's file order: beside the session cluster, not at its start (two Rays
starting at once race for the dashboard agent's port), so it runs with the unit tests."""

import pytest
import torch

torch.set_num_threads(1)

SESSION_CLUSTER = "cluster"  # the session-scoped fixture of tests/deployments/conftest.py: one Ray, two apps


def runs_a_cluster(item: pytest.Item) -> bool:
    """Whether `item` runs with the session cluster's tests: it uses the session cluster, or is marked slow
    and does not serve its own (`own_server`)."""
    if SESSION_CLUSTER in getattr(item, "fixturenames", ()):
        return True
    return item.get_closest_marker("slow") is not None and item.get_closest_marker("own_server") is None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marked as it is collected, so `-m cluster` / `-m "not cluster"` select by it."""
    if runs_a_cluster(item):
        item.add_marker(pytest.mark.cluster)
