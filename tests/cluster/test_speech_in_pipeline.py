"""Speech in through the in-process pipeline: a clip in, the answer's text streamed as it is decoded and
its speech tokens decoded to audio by the S3Gen detokenizer; the text deltas hold back a character cut
mid UTF-8 sequence."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cluster.pipeline import InProcessPipeline
from core.config import EngineConfig, ModelConfig
from core.messages import AudioClip, ChatTurn
from llm_stage.jobs import build_job
from llm_stage.models.step_audio2_encoder import encode_pieces
from llm_stage.models.step_audio2_frontend import front_end_name
from llm_stage.models.step_audio2_lm import PRESET_TEXT_IDS
from llm_stage.models.tokenizers import ByteTokenizer
from llm_stage.text_out import TextStream

TEXT_IDS = PRESET_TEXT_IDS


def clip(seconds: float, pitch_hz: float = 200.0, rate_hz: int = 16_000) -> AudioClip:
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return AudioClip((0.3 * np.sin(2 * np.pi * pitch_hz * t) * 32767).astype("<i2").tobytes(), rate_hz)


@pytest.fixture
def pipeline():
    pipeline = InProcessPipeline(EngineConfig(model=ModelConfig(name="step-audio2-tiny", seed=1)))
    yield pipeline
    pipeline.close()


def test_a_clip_in_gives_text_as_decoded_and_audio(pipeline) -> None:
    engine, adapter = pipeline.llm.engine, pipeline.llm.engine.adapter
    job = dataclasses.replace(engine.job("s2s", "Answer.", sampling={"temperature": 0.0, "max_tokens": 80}),
                              audio=clip(1.2))  # fmt: skip
    tokens: list[int] = []
    original_step = engine.step

    def recording_step():
        outs = original_step()
        tokens.extend(t for o in outs if o.req_id == "s2s" for t in o.new_token_ids)
        return outs

    engine.step = recording_step  # record the ids the engine drew, to check the answer against
    answer = pipeline.answer(job)
    text_ids = [t for t in tokens if t in TEXT_IDS]
    speech = [t for t in tokens if adapter.ids.speech_code(t) is not None]
    assert len(tokens) == 80 and text_ids and len(speech) > 50
    assert answer.text == ByteTokenizer(offset=1000, bos_id=None).decode(text_ids)
    assert answer.first_text_s is not None and answer.first_audio_s is not None
    assert answer.first_text_s < answer.first_audio_s  # text leaves as decoded; audio waits for a chunk
    samples_per_token = 24_000 // 25
    assert len(answer.pcm16) // 2 == len(speech) * samples_per_token


def test_text_held_back_mid_character() -> None:
    tokenizer = ByteTokenizer(offset=1000, bos_id=None)
    stream = TextStream(tokenizer.decode)
    ids = tokenizer.encode("né😀!")
    deltas = [stream.push([i], is_final=False) for i in ids]
    assert "".join(deltas) == "né😀!" and all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # the second byte of é completes it


def test_a_text_only_answer_never_speaks_and_sends_no_chunk(pipeline) -> None:
    """`Job.text_only`: the prompt opens the assistant's turn without `<tts_start>`, every id drawn is
    text or `<|EOT|>`, the stream ends with its text, and the detokenizer gets no chunk (not even an
    empty final one); the same seeded request answering in speech does draw speech ids."""
    engine, adapter = pipeline.llm.engine, pipeline.llm.engine.adapter
    sampling = {"temperature": 0.0, "max_tokens": 80}
    job = build_job(adapter, text="", req_id="asr", sampling=sampling, audio=clip(1.2), text_only=True,
                    system=adapter.transcription_system("en"))  # fmt: skip
    tokens: list[int] = []
    original_step = engine.step

    def recording_step():
        outs = original_step()
        tokens.extend(t for o in outs for t in o.new_token_ids)
        return outs

    engine.step = recording_step
    pipeline.llm.add(job)
    prompt_ids = [t[0] for t in engine.requests["asr"].prompt_ids]
    audio = []
    while pipeline.has_work:
        audio += pipeline.step()
    assert adapter.ids.tts_start not in prompt_ids
    assert audio == [] and pipeline.detok.num_decoded_frames == 0
    assert tokens and all(adapter.ids.is_text(t) or t == adapter.ids.eot for t in tokens)
    deltas = [d for d in pipeline.text if d.req_id == "asr"]
    assert deltas[-1].is_final and "".join(d.text for d in deltas)
    assert "".join(d.text for d in deltas) == adapter.decode_text(adapter.text_ids(tokens))

    tokens.clear()
    spoken = dataclasses.replace(job, req_id="s2s-same", text_only=False)
    answer = pipeline.answer(spoken)
    assert any(adapter.ids.speech_code(t) is not None for t in tokens) and answer.pcm16


def test_a_turn_streamed_in_pieces_answers_as_the_clip_sent_whole(pipeline) -> None:
    """Microphone input: the family's front end run on 20 ms pieces as they come (`audio_front_end`), the
    Job carrying its features, gives the same greedy text and audio as the clip whose features the LLM
    replica computes itself (the features are bit-equal, so the encoder reads the same input)."""
    engine = pipeline.llm.engine
    t = np.arange(int(1.1 * 24_000)) / 24_000
    pcm = (0.3 * np.sin(2 * np.pi * 170 * t) * 32767).astype("<i2").tobytes()
    front_end = type(engine.adapter).audio_front_end(24_000)
    for start in range(0, len(pcm), 960):  # 20 ms of 24 kHz PCM16 a piece
        front_end.push_pcm16(pcm[start : start + 960])
    streamed_features = front_end.finish()
    assert streamed_features.front_end == front_end_name(engine.adapter.model.encoder_shape.n_mels)  # it is used
    answers = []
    for req_id, features in (("whole", None), ("streamed", streamed_features)):
        job = engine.job(req_id, "Answer.", sampling={"temperature": 0.0, "max_tokens": 60})
        answers.append(pipeline.answer(dataclasses.replace(job, audio=AudioClip(pcm, 24_000), audio_features=features)))
    whole, streamed = answers
    assert whole.text and whole.pcm16
    assert streamed.text == whole.text and streamed.pcm16 == whole.pcm16


def conversation_job(adapter, req_id: str, with_history: bool):
    """The last user turn (a question and a 24 kHz clip), after an earlier turn with its own clip and the
    assistant's answer as text when `with_history`; greedy."""
    earlier = (ChatTurn("user", "What is this?", clip(1.2)), ChatTurn("assistant", "A low tone."))
    history = earlier if with_history else ()
    return build_job(adapter, text="And this one?", req_id=req_id, audio=clip(0.8, 330.0, 24_000), history=history,
                     sampling={"temperature": 0.0, "max_tokens": 80})  # fmt: skip


def run_to_end(pipeline, req_id: str) -> tuple[bytes, str]:
    audio = []
    while pipeline.has_work:
        audio += [c.pcm16 for c in pipeline.step() if c.req_id == req_id]
    text = "".join(d.text for d in pipeline.text if d.req_id == req_id)
    pipeline.text = [d for d in pipeline.text if d.req_id != req_id]
    return b"".join(audio), text


def test_a_two_turn_conversation_with_two_clips_answers(pipeline) -> None:
    """Multi-turn (`Job.history`): the earlier turn's clip and the last turn's are both encoded in the
    step that prefills the request, each equal to its clip encoded alone, and their embeddings sit at
    their own placeholders of the prompt; the greedy answer has text and audio, the same again."""
    engine, adapter = pipeline.llm.engine, pipeline.llm.engine.adapter
    job = conversation_job(adapter, "two", with_history=True)
    pipeline.llm.add(job)
    prompt = engine.requests["two"].prompt_ids
    handles = adapter.clips.handles_of("two")
    pipeline.step()  # the step's preprocess encodes both clips, then it prefills
    ids = torch.tensor([prompt])  # [1, T, 3]
    with torch.no_grad():
        embedded = adapter.embed(ids)[0]  # [T, H]
        for handle, audio in zip(handles, (job.history[0].audio, job.audio), strict=True):
            alone = encode_pieces(adapter.model.encoder, adapter.model.adapter, adapter.whole_clip_mels(audio))[0]
            torch.testing.assert_close(adapter.clips.rows[handle], alone, atol=2e-5, rtol=1e-4)
            where = ids[0, :, 1] == handle
            assert int(where.sum()) == alone.shape[0]
            torch.testing.assert_close(embedded[where], alone.to(embedded.dtype), atol=2e-5, rtol=1e-4)
    assert len(handles) == 2
    audio, text = run_to_end(pipeline, "two")
    assert audio and text
    pipeline.llm.add(dataclasses.replace(job, req_id="two-again"))
    assert run_to_end(pipeline, "two-again") == (audio, text)


def test_the_same_last_turn_with_and_without_history_gets_another_prompt(pipeline) -> None:
    """The history's tokens come between the system turn and the last turn; without it the prompt is
    the single-turn one."""
    engine, adapter = pipeline.llm.engine, pipeline.llm.engine.adapter
    prompts = {}
    for req_id, with_history in (("with", True), ("without", False)):
        pipeline.llm.add(conversation_job(adapter, req_id, with_history))
        prompts[req_id] = [t[0] for t in engine.requests[req_id].prompt_ids]
        pipeline.cancel(req_id)
    with_history, without = prompts["with"], prompts["without"]
    earlier = with_history[: len(with_history) - len(without)]
    assert with_history != without and len(with_history) > len(without)
    system_end = without.index(adapter.ids.eot) + 1
    assert with_history[:system_end] == without[:system_end]  # the same system turn, then the earlier turns
    assert with_history[system_end + len(earlier) :] == without[system_end:]  # the same last turn
    assert earlier.count(adapter.ids.bot) == 2  # an earlier user turn and the assistant's
