"""The engine's incremental penalty histories equal the adapter's own, step after step (the default history,
and the per-token speech-id maps of CosyVoice 2 and Chatterbox)."""

from __future__ import annotations

import pytest

from core.config import ModelConfig
from core.messages import SamplingParams
from core.voices import VoicePrompt
from llm_stage.histories import PenaltyHistories, incremental_histories, uses_default_history, uses_incremental_history
from llm_stage.models.chatterbox import ChatterboxAdapter
from llm_stage.request import Request
from tests.factories import adapter_engine, cosyvoice2_adapter, orpheus_adapter


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


@pytest.mark.parametrize("family", ["cosyvoice2", "chatterbox"])
def test_a_per_token_history_map_is_kept_incrementally_as_the_adapter_builds_it(family):
    """CosyVoice 2 and Chatterbox keep only the speech ids (a voice's prompt speech and the output): the
    engine's incremental histories equal the adapter's own `penalty_history` at every step and window."""
    if family == "cosyvoice2":
        adapter = cosyvoice2_adapter(0)
        voice = "v_" + "ab" * 12
        adapter.add_voice_prompt(VoicePrompt(voice, "a transcript", tuple(range(40, 77))))
    else:
        adapter, voice = ChatterboxAdapter.build(ModelConfig(name="chatterbox-tiny")), None
    assert not uses_default_history(adapter) and uses_incremental_history(adapter)
    histories = incremental_histories(adapter)
    req = Request("r", adapter.format_prompt("some text", voice), SamplingParams(repetition_penalty=1.1))
    for step in range(200):  # past the first buffers' sizes: they grow
        for window in (0, 1, 7, 64):
            req.sampling = SamplingParams(repetition_penalty=1.1, repetition_window=window)
            assert histories.window(req, window).tolist() == adapter.penalty_history(req, 0), (step, window)
        req.output_ids.append(6000 + step % 37)
    req.output_ids = [5, 6, 7]  # replaced: rebuilt
    assert histories.window(req, 2).tolist() == [6, 7]
    histories.forget("r")
    engine = adapter_engine(adapter)
    try:
        assert engine._histories is not None  # the engine keeps these histories incrementally
    finally:
        engine.close()
