"""`kv_layout`: the KV cache layout of every LLMEngine a test builds (the families' greedy parity
tests run in `tests.factories.STEP_MODES`)."""

from __future__ import annotations

import pytest

from llm_stage.engine import LLMEngine
from tests.factories import PAGED_TEST_CACHE


@pytest.fixture
def kv_layout(request, monkeypatch) -> str:
    """Indirect parameter ("slot" or "paged"): with "paged", LLMEngine's cache config is switched."""
    layout = getattr(request, "param", "slot")
    if layout == "paged":
        original = LLMEngine.__init__

        def paged_init(self, adapter, cache, *args, **kwargs):
            paged = cache.model_validate({**cache.model_dump(), **PAGED_TEST_CACHE})
            original(self, adapter, paged, *args, **kwargs)

        monkeypatch.setattr(LLMEngine, "__init__", paged_init)
    return layout
