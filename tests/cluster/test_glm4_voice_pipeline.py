"""GLM-4-Voice speech in through the in-process pipeline: a clip in, tokenized by the WhisperVQ speech
tokenizer into the published prompt; the answer's text streamed as decoded, its 12.5 Hz speech tokens
decoded by the flow + HiFT decoder at 22.05 kHz; a text-only answer sends the detokenizer nothing."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.pipeline import InProcessPipeline
from core.config import EngineConfig, ModelConfig
from core.messages import AudioClip
from llm_stage.jobs import build_job
from llm_stage.models.clip_audio import clip_wave_16k
from llm_stage.models.glm4_voice_tokenizer import SpeechTokenizer

SEED = 1
GREEDY = {"temperature": 0.0, "max_tokens": 80}


def clip(seconds: float, pitch_hz: float = 200.0, rate_hz: int = 24_000) -> AudioClip:
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return AudioClip((0.3 * np.sin(2 * np.pi * pitch_hz * t) * 32767).astype("<i2").tobytes(), rate_hz)


@pytest.fixture(scope="module")
def pipeline():
    pipeline = InProcessPipeline(EngineConfig(model=ModelConfig(name="glm4-voice-tiny", seed=SEED)))
    yield pipeline
    pipeline.close()


def recorded_tokens(engine) -> list[int]:
    """The ids the engine draws from now on (appended as it steps)."""
    tokens: list[int] = []
    original_step = engine.step

    def recording_step():
        outs = original_step()
        tokens.extend(t for o in outs for t in o.new_token_ids)
        return outs

    engine.step = recording_step
    return tokens


def test_a_clip_in_answers_text_as_decoded_and_audio(pipeline) -> None:
    engine, adapter = pipeline.llm.engine, pipeline.llm.engine.adapter
    heard = clip(1.5)
    job = build_job(adapter, text="", req_id="s2s", sampling=GREEDY, audio=heard)
    speech_in = SpeechTokenizer.preset(SEED).tokens([clip_wave_16k(heard)])[0].tolist()
    prompt = adapter.job_prompt(job)
    start = prompt.index(adapter.ids.begin_of_audio)
    assert len(speech_in) == 19 and prompt[start + 1 : start + 1 + len(speech_in)] == [
        adapter.ids.first_audio + code for code in speech_in
    ]  # the clip's tokens (1.5 s at 12.5 Hz, rounded up) between the audio markers
    tokens = recorded_tokens(engine)
    answer = pipeline.answer(job)
    speech = [t for t in tokens if adapter.ids.audio_code(t) is not None]
    assert speech and adapter.text_ids(tokens)
    assert answer.text == adapter.decode_text(adapter.text_ids(tokens))
    assert answer.first_text_s is not None and answer.first_audio_s is not None
    assert answer.pcm16 and pipeline.detok.num_decoded_frames == len(speech)  # every speech token decoded


def test_a_text_only_answer_draws_text_and_sends_no_chunk(pipeline) -> None:
    engine, adapter = pipeline.llm.engine, pipeline.llm.engine.adapter
    decoded_before = pipeline.detok.num_decoded_frames
    job = build_job(adapter, text="", req_id="text", sampling=GREEDY, audio=clip(1.0), text_only=True)
    tokens = recorded_tokens(engine)
    answer = pipeline.answer(job)
    assert tokens and all(adapter.ids.is_text(t) or t in adapter.ids.stops for t in tokens)
    assert answer.pcm16 == b"" and pipeline.detok.num_decoded_frames == decoded_before
    assert answer.text == adapter.decode_text(adapter.text_ids(tokens))
