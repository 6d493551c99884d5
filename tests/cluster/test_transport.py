"""A tensor crosses from the LLM-stage endpoint actor to the detok-stage endpoint actor over gloo
(Ray Direct Transport), and through the object store as the fallback."""

from __future__ import annotations

import pytest
import ray
import torch

from cluster.config import TransportConfig
from cluster.transport import TensorChannel, TensorEndpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    yield
    if started:
        ray.shutdown()


@pytest.mark.parametrize("kind", ["gloo", "object_store"])
def test_tensor_crosses_between_stage_actors(local_ray, kind):
    llm_endpoint, detok_endpoint = TensorEndpoint.remote(), TensorEndpoint.remote()
    conditioning = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)  # 256 KiB
    ray.get(llm_endpoint.put.remote("voice-tara", conditioning))
    receipt = TensorChannel(llm_endpoint, detok_endpoint, TransportConfig(tensor_transport=kind)).move("voice-tara")
    assert receipt == {"key": "voice-tara", "shape": [64, 1024], "device": "cpu", "sum": float(conditioning.sum())}
    assert ray.get(llm_endpoint.keys.remote()) == []
    assert ray.get(detok_endpoint.keys.remote()) == ["voice-tara"]
    assert torch.equal(ray.get(detok_endpoint.take.remote("voice-tara")), conditioning)
