"""The engine's incremental penalty histories equal the adapter's own, step after step."""

from __future__ import annotations

from core.messages import SamplingParams
from llm_stage.histories import PenaltyHistories, uses_default_history
from llm_stage.request import Request
from tests.factories import orpheus_adapter


def test_windows_follow_the_requests_tokens_through_growth_and_a_reset():
    adapter = orpheus_adapter(0)
    assert uses_default_history(adapter)
    histories = PenaltyHistories()
    req = Request("r", list(range(100, 140)), SamplingParams(repetition_penalty=1.3))
    for step in range(300):  # past the first buffer's size: it grows
        for window in (0, 7, 64):
            want = adapter.history_ids(req.history(window), 0)
            assert histories.window(req, window).tolist() == want, (step, window)
        req.output_ids.append(128266 + step)
    req.output_ids = [5, 6, 7]  # replaced (as a resume restores another stream's tokens): rebuilt
    assert histories.window(req, 0).tolist() == req.prompt_ids + [5, 6, 7]
    histories.forget("r")
    assert histories.window(req, 2).tolist() == [6, 7]
