"""Test-wide settings: one torch thread (tiny ops; CI shares 2 cores with Ray workers), and the
`cluster` marker on every test that serves a cluster: the package `tests/deployments` (its modules
share one session Ray and run in file order) and every test marked `slow` (the served benches,
exposure, chaos, soak). `make test` (`tests/split_run.py`) runs those in one pytest process, one
after another as a plain `pytest` would, beside the unit tests in another."""

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

CLUSTER_PACKAGE = Path(__file__).parent / "deployments"


def runs_a_cluster(item: pytest.Item) -> bool:
    """Whether `item` serves a cluster: a test of `tests/deployments` or one marked slow."""
    return CLUSTER_PACKAGE in Path(item.path).parents or item.get_closest_marker("slow") is not None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marked as it is collected, so `-m cluster` / `-m "not cluster"` select by it."""
    if runs_a_cluster(item):
        item.add_marker(pytest.mark.cluster)
