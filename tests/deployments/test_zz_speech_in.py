"""Speech in through the Serve cluster: a gRPC Synthesize carrying a clip (`input_audio`) on
step-audio2-tiny answers with the answer's text as text-only chunks ahead of its audio, and text and
audio equal the in-process pipeline's for the same seeded request; the same clip streamed as
microphone audio over gRPC `Converse` and the WebSocket `/v1/audio/converse` answers the same; a clip
the ingress refuses names its field. The same app transcribes (`POST /v1/audio/transcriptions` with the
`openai` SDK, and gRPC `Transcribe`): a text-only stream whose text equals the in-process one; a gRPC
Synthesize with `text_only` answers with the in-process text-only answer in text chunks alone. (The
in-process checks: tests/cluster/test_speech_in_pipeline.py.) GLM-4-Voice, the family reading audio as
speech tokens, answers a clip over gRPC with the in-process answer's text, and the same clip streamed
over Converse and the WebSocket (tokenized on an LLM replica as it came) the same."""

from __future__ import annotations

import base64
import dataclasses
import wave

import grpc
import numpy as np
import pytest
from ray import serve

from cluster.pipeline import InProcessPipeline
from core.config import AdmissionConfig, StageDeploymentConfig
from core.messages import AudioClip, ChatTurn
from protos import voxray_pb2
from tests.deployments.conftest import small_config
from tests.deployments.grpc_helpers import run_stream

pytestmark = pytest.mark.slow
SPEECH_IN = small_config(
    app_name="voxray-speech-in", route_prefix="/speech-in", llm=StageDeploymentConfig(num_cpus=0.25),
    detok=StageDeploymentConfig(num_cpus=0.25), router=StageDeploymentConfig(num_cpus=0.25),
    admission=AdmissionConfig(max_streams_per_replica=2, default_ttfa_deadline_s=120.0),
)  # fmt: skip
SPEECH_IN = SPEECH_IN.model_copy(update={"engine": SPEECH_IN.engine.model_copy(
    update={"model": SPEECH_IN.engine.model.model_copy(update={"name": "step-audio2-tiny"})})})  # fmt: skip
MAX_PCM_STEPS = 8  # S3Gen in another batch composition: float noise through the NSF phase, PCM16 rounding
SAMPLING = {"temperature": 0.0, "max_tokens": 60}


def tone_pcm16(seconds: float, rate: int) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


def test_a_clip_in_answers_text_then_audio_as_in_process(cluster, tmp_path, capsys) -> None:
    from cluster.server import deploy_app

    endpoint = deploy_app(SPEECH_IN)
    try:
        pcm = tone_pcm16(1.5, 24_000)
        audio = voxray_pb2.InputAudio(data=pcm, format=voxray_pb2.INPUT_AUDIO_PCM16, sample_rate_hz=24_000)
        outcome = run_stream(endpoint.grpc_target, endpoint.app_name, "Answer.", input_audio=audio,
                             request_id="s2s-1", sampling=SAMPLING)  # fmt: skip
        assert outcome.code == grpc.StatusCode.OK, outcome.details
        text_chunks = [c for c in outcome.chunks if c.text]
        assert text_chunks and all(not c.audio for c in text_chunks)
        first_audio = next(i for i, c in enumerate(outcome.chunks) if c.audio)
        assert outcome.chunks.index(text_chunks[0]) < first_audio  # text leads the audio

        pipeline = InProcessPipeline(SPEECH_IN.engine)
        try:
            engine = pipeline.llm.engine
            job = dataclasses.replace(engine.job("s2s-1", "Answer.", sampling=SAMPLING), audio=AudioClip(pcm, 24_000))
            expected = pipeline.answer(job)
            transcript = pipeline.answer(transcription_job(engine.adapter, pcm)).text
            text_only = pipeline.answer(dataclasses.replace(job, req_id="chat-text", text_only=True))
            conversation = pipeline.answer(conversation_job(engine.adapter, pcm))
        finally:
            pipeline.close()
        assert "".join(c.text for c in text_chunks) == expected.text
        got = np.frombuffer(outcome.pcm16, dtype="<i2").astype(np.int32)
        want = np.frombuffer(expected.pcm16, dtype="<i2").astype(np.int32)
        assert got.shape == want.shape and got.size > 0
        assert np.abs(got - want).max() <= MAX_PCM_STEPS

        _the_openai_sdk_gets_the_same_answer(endpoint, pcm, expected)
        _the_openai_sdk_transcribes(endpoint, pcm, transcript)
        _grpc_transcribes(endpoint, pcm, transcript)
        assert text_only.text and not text_only.pcm16
        _the_openai_sdk_gets_a_text_only_answer(endpoint, pcm, text_only.text)
        _grpc_answers_in_text_alone(endpoint, audio, text_only.text)
        _the_openai_sdk_holds_a_conversation(endpoint, pcm, conversation.text)
        _a_streamed_turn_answers_as_the_clip_sent_whole(endpoint, pcm, expected)
        _a_registered_voice_speaks_the_answer(endpoint, audio, pcm, expected)
        _voxray_say_answers_and_transcribes_a_wav(endpoint, pcm, (expected, text_only.text, transcript), tmp_path,
                                                  capsys)  # fmt: skip
        odd = voxray_pb2.InputAudio(data=pcm[:-1], format=voxray_pb2.INPUT_AUDIO_PCM16, sample_rate_hz=24_000)
        refused = run_stream(endpoint.grpc_target, endpoint.app_name, "", input_audio=odd)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "input_audio.data" in refused.details
    finally:
        serve.delete(SPEECH_IN.app_name)


GLM4_VOICE = small_config(
    app_name="voxray-glm", route_prefix="/glm", llm=StageDeploymentConfig(num_cpus=0.25),
    detok=StageDeploymentConfig(num_cpus=0.25), router=StageDeploymentConfig(num_cpus=0.25),
    admission=AdmissionConfig(max_streams_per_replica=2, default_ttfa_deadline_s=120.0),
)  # fmt: skip
GLM4_VOICE = GLM4_VOICE.model_copy(update={"engine": GLM4_VOICE.engine.model_copy(
    update={"model": GLM4_VOICE.engine.model.model_copy(update={"name": "glm4-voice-tiny"})})})  # fmt: skip


def test_glm4_voice_takes_a_clip_and_answers_text_and_audio_as_in_process(cluster) -> None:
    """GLM-4-Voice: the clip tokenized by its speech tokenizer in the LLM replica, the answer's text equal
    to the in-process pipeline's, its speech decoded at 22.05 kHz (the flow decoder's audio depends on
    where the chunks cut, which adapts to each client's buffer: the audio is checked for its rate and
    presence, not its samples)."""
    from cluster.server import deploy_app

    endpoint = deploy_app(GLM4_VOICE)
    try:
        pcm = tone_pcm16(1.5, 16_000)
        audio = voxray_pb2.InputAudio(data=pcm, format=voxray_pb2.INPUT_AUDIO_PCM16, sample_rate_hz=16_000)
        outcome = run_stream(endpoint.grpc_target, endpoint.app_name, "", input_audio=audio, request_id="glm-1",
                             sampling=SAMPLING)  # fmt: skip
        assert outcome.code == grpc.StatusCode.OK, outcome.details
        pipeline = InProcessPipeline(GLM4_VOICE.engine)
        try:
            from llm_stage.jobs import build_job

            adapter = pipeline.llm.engine.adapter
            job = build_job(adapter, text="", req_id="glm-1", sampling=SAMPLING, audio=AudioClip(pcm, 16_000))
            expected = pipeline.answer(job)
            first = build_job(adapter, text="", req_id="glm-c1", sampling=SAMPLING, audio=AudioClip(pcm, 16_000),
                              text_only=True)  # fmt: skip
            first_answer = pipeline.answer(first).text
            # (the answer handed back is the client's text: the tiny model's random one holds control characters)
            history = (ChatTurn("user", "", AudioClip(pcm, 16_000)), ChatTurn("assistant", "Sure."))
            second = build_job(adapter, text="And then?", req_id="glm-c2", sampling=SAMPLING, history=history,
                               text_only=True)  # fmt: skip
            pipeline.llm.engine.scheduler.give_back_kept()  # (nothing kept: the second turn prefilled whole)
            second_answer = pipeline.answer(second).text
        finally:
            pipeline.close()
        assert expected.text and "".join(c.text for c in outcome.chunks) == expected.text
        assert outcome.pcm16 and expected.pcm16
        assert {c.sample_rate_hz for c in outcome.chunks if c.audio} == {22_050}
        # streamed in pieces, tokenized on an LLM replica as they came: the same answer
        streamed = _converse(endpoint, pcm, 16_000, "glm-mic", text="", text_only=True)  # (no decoding: quicker)
        assert "".join(c.text for c in streamed) == first_answer and streamed[-1].final
        texts, _, code = _converse_websocket(endpoint, pcm, 16_000, "glm-mic-ws", "", (GLM4_VOICE, 22_050))
        assert code == 1000 and "".join(texts) == expected.text
        stats = serve.get_deployment_handle("LLMStage", GLM4_VOICE.app_name).stats.remote().result()
        assert stats["mic_turns_tokenized"] == 2 and stats["mic_turns_open"] == 0  # (one LLM replica)
        _glm_holds_a_conversation_on_the_kept_prompt(endpoint, pcm, first_answer, second_answer)
    finally:
        serve.delete(GLM4_VOICE.app_name)


def _glm_holds_a_conversation_on_the_kept_prompt(endpoint, pcm: bytes, first: str, second: str) -> None:
    """Two chat turns over HTTP: the second's history is the first turn and an answer, so the LLM replica
    prefills only what follows the first turn's prompt, kept in its slot; both answers are the in-process
    ones (the second's from an engine that kept nothing)."""
    from openai import OpenAI

    from router.audio_format import wav_bytes

    client = OpenAI(base_url=f"{endpoint.http_url}{GLM4_VOICE.route_prefix}/v1", api_key="unused", max_retries=0)
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(pcm, 16_000)).decode(),
                                                   "format": "wav"}}  # fmt: skip
    settings = {"model": "glm4-voice-tiny", "max_tokens": SAMPLING["max_tokens"], "temperature": 0.0}
    turn = [{"role": "user", "content": [clip]}]
    before = serve.get_deployment_handle("LLMStage", GLM4_VOICE.app_name).stats.remote().result()
    assert client.chat.completions.create(messages=turn, **settings).choices[0].message.content == first
    turn += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And then?"}]
    assert client.chat.completions.create(messages=turn, **settings).choices[0].message.content == second
    after = serve.get_deployment_handle("LLMStage", GLM4_VOICE.app_name).stats.remote().result()
    # the first turn's prompt is the Converse turns' above (the same clip): it starts on theirs, the second on it
    assert after["prompt_reuses"] == before["prompt_reuses"] + 2
    assert after["prompt_positions_reused"] - before["prompt_positions_reused"] > 2 * 50


def transcription_job(adapter, pcm: bytes):
    """What the transcriptions route makes of the clip sent as a WAV with `language: zh`, greedy."""
    from llm_stage.jobs import build_job
    from router.transcriptions import with_text_bound

    job = build_job(adapter, text="", req_id="asr-1", sampling={"temperature": 0.0}, audio=AudioClip(pcm, 24_000),
                    text_only=True, system=adapter.transcription_system("zh"))  # fmt: skip
    return with_text_bound(job)


def _the_openai_sdk_transcribes(endpoint, pcm: bytes, transcript: str) -> None:
    """`openai`'s audio.transcriptions.create uploads the clip as a WAV: json, text and verbose_json
    give the in-process text-only answer; a file that is not audio answers 400 naming `file`, an
    unknown model 400 naming `model`."""
    from openai import BadRequestError, OpenAI

    from router.audio_format import wav_bytes

    client = OpenAI(base_url=f"{endpoint.http_url}{SPEECH_IN.route_prefix}/v1", api_key="unused", max_retries=0)
    upload = {"model": "step-audio2-tiny", "file": ("clip.wav", wav_bytes(pcm, 24_000), "audio/wav"), "language": "zh"}
    assert transcript and client.audio.transcriptions.create(**upload).text == transcript
    assert client.audio.transcriptions.create(**upload, response_format="text") == transcript
    verbose = client.audio.transcriptions.create(**upload, response_format="verbose_json")
    assert verbose.text == transcript and verbose.duration == 1.5 and verbose.language == "chinese"
    assert verbose.segments[0].end == 1.5
    not_audio = ("clip.wav", b"not audio at all", "audio/wav")
    for bad, param in [({"file": not_audio}, "file"), ({"model": "nope"}, "model")]:
        with pytest.raises(BadRequestError) as err:
            client.audio.transcriptions.create(**{**upload, **bad})
        assert err.value.status_code == 400 and err.value.body["param"] == param


def _grpc_transcribes(endpoint, pcm: bytes, transcript: str) -> None:
    """gRPC `Transcribe` of the WAV the SDK uploads above: the same text (the HTTP route's), the language
    asked and the clip's duration; a clip that is not audio names `audio.data`, an unknown model `model`."""
    from protos import voxray_pb2_grpc
    from router.audio_format import wav_bytes

    wav = voxray_pb2.InputAudio(data=wav_bytes(pcm, 24_000), format=voxray_pb2.INPUT_AUDIO_WAV)
    request = voxray_pb2.TranscribeRequest(audio=wav, model="step-audio2-tiny", language="zh", request_id="asr-grpc")
    metadata = (("application", endpoint.app_name),)
    with grpc.insecure_channel(endpoint.grpc_target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        response = stub.Transcribe(request, metadata=metadata, timeout=120)
        assert (response.text, response.language, response.duration_s) == (transcript, "chinese", 1.5)
        assert response.request_id == "asr-grpc"
        not_audio = voxray_pb2.InputAudio(data=b"not audio at all")
        for bad, field in [({"audio": not_audio}, "audio.data"), ({"model": "nope"}, "model")]:
            refused = voxray_pb2.TranscribeRequest(**{"audio": wav, "model": "step-audio2-tiny", **bad})
            with pytest.raises(grpc.RpcError) as err:
                stub.Transcribe(refused, metadata=metadata, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(f"{field}:")


def _voxray_say_answers_and_transcribes_a_wav(endpoint, pcm: bytes, answers: tuple, tmp_path, capsys) -> None:
    """`voxray say --audio clip.wav`: the answer's text printed and its audio written (the in-process
    answer's); `--text-only` prints the text-only answer and writes nothing; `--transcribe` the transcript."""
    from cluster.cli import main
    from router.audio_format import wav_bytes

    expected, text_only, transcript = answers
    clip, out = tmp_path / "clip.wav", tmp_path / "answer.wav"
    clip.write_bytes(wav_bytes(pcm, 24_000))
    common = ["--audio", str(clip), "--target", endpoint.grpc_target, "--app", endpoint.app_name]
    greedy = [*common, "--temperature", "0", "--max-tokens", str(SAMPLING["max_tokens"])]
    capsys.readouterr()
    assert main(["say", "Answer.", *greedy, "-o", str(out)]) == 0
    assert capsys.readouterr().out.rsplit("wrote ", 1)[0] == expected.text + "\n"
    with wave.open(str(out)) as wav:
        got = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.int32)
    want = np.frombuffer(expected.pcm16, dtype="<i2").astype(np.int32)
    assert got.shape == want.shape and np.abs(got - want).max() <= MAX_PCM_STEPS
    assert main(["say", "Answer.", *greedy, "--text-only", "-o", str(tmp_path / "none.wav")]) == 0
    assert capsys.readouterr().out == text_only + "\n" and not (tmp_path / "none.wav").exists()
    assert main(["say", *common, "--transcribe", "--model", "step-audio2-tiny", "--language", "zh"]) == 0
    assert capsys.readouterr().out == transcript + "\n"
    assert main(["say", *common, "--model", "nope"]) == 1
    assert "INVALID_ARGUMENT: model" in capsys.readouterr().err


def _grpc_answers_in_text_alone(endpoint, audio, text: str) -> None:
    """Synthesize with the clip and `text_only`: chunks carrying text alone, the in-process text-only
    answer, the last one final."""
    outcome = run_stream(endpoint.grpc_target, endpoint.app_name, "Answer.", input_audio=audio,
                         request_id="s2s-text", sampling=SAMPLING, text_only=True)  # fmt: skip
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert "".join(c.text for c in outcome.chunks) == text and not outcome.pcm16
    assert outcome.chunks[-1].final and not any(c.final for c in outcome.chunks[:-1])


def _the_openai_sdk_gets_a_text_only_answer(endpoint, pcm: bytes, text: str) -> None:
    """Chat completions without `modalities` (OpenAI's default, text): `message.content` whole and
    `delta.content` streamed, the in-process text-only answer, no audio."""
    from openai import OpenAI

    from router.audio_format import wav_bytes

    client = OpenAI(base_url=f"{endpoint.http_url}{SPEECH_IN.route_prefix}/v1", api_key="unused", max_retries=0)
    wav = base64.b64encode(wav_bytes(pcm, 24_000)).decode()
    request = {
        "model": "step-audio2-tiny", "max_tokens": SAMPLING["max_tokens"], "temperature": SAMPLING["temperature"],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Answer."}, {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        ]}],
    }  # fmt: skip
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content == text and message.audio is None
    streamed = client.chat.completions.create(**request, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


EARLIER_PCM = (0.3 * np.sin(2 * np.pi * 330 * np.arange(24_000) / 24_000) * 32767).astype("<i2").tobytes()


def conversation_job(adapter, pcm: bytes):
    """A 2-turn text-only conversation, greedy: an earlier user turn with its own clip, the assistant's
    answer as text, then the clip with "Answer."; what the chat route makes of the SDK's call below."""
    from llm_stage.jobs import build_job

    history = (ChatTurn("user", "What is this?", AudioClip(EARLIER_PCM, 24_000)), ChatTurn("assistant", "A tone."))
    return build_job(adapter, text="Answer.", req_id="chat-turns", sampling=SAMPLING, audio=AudioClip(pcm, 24_000),
                     text_only=True, history=history)  # fmt: skip


def conversation_messages(pcm: bytes) -> list[dict]:
    from router.audio_format import wav_bytes

    def user(text: str, clip: bytes) -> dict:
        audio = {"data": base64.b64encode(wav_bytes(clip, 24_000)).decode(), "format": "wav"}
        parts = [{"type": "text", "text": text}, {"type": "input_audio", "input_audio": audio}]
        return {"role": "user", "content": parts}

    return [user("What is this?", EARLIER_PCM), {"role": "assistant", "content": "A tone."}, user("Answer.", pcm)]


def _the_openai_sdk_holds_a_conversation(endpoint, pcm: bytes, text: str) -> None:
    """Chat completions with a 2-turn `messages` (two clips): the in-process answer to the same
    conversation; the assistant turn handed back as `audio: {id}` answers 400 naming the field."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{endpoint.http_url}{SPEECH_IN.route_prefix}/v1", api_key="unused", max_retries=0)
    request = {"model": "step-audio2-tiny", "max_tokens": SAMPLING["max_tokens"],
               "temperature": SAMPLING["temperature"], "messages": conversation_messages(pcm)}  # fmt: skip
    assert client.chat.completions.create(**request).choices[0].message.content == text
    by_id = [request["messages"][0], {"role": "assistant", "audio": {"id": "audio_1"}}, request["messages"][2]]
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(**{**request, "messages": by_id})
    assert err.value.status_code == 400 and err.value.body["param"] == "messages[1].audio.id"


def _the_openai_sdk_gets_the_same_answer(endpoint, pcm: bytes, expected) -> None:
    """`openai`'s chat.completions with an input_audio part and modalities text + audio, whole and
    streamed: the transcript and audio of the gRPC answer above (same seeded greedy request)."""
    from openai import OpenAI

    from router.audio_format import wav_bytes

    client = OpenAI(base_url=f"{endpoint.http_url}{SPEECH_IN.route_prefix}/v1", api_key="unused", max_retries=0)
    wav = base64.b64encode(wav_bytes(pcm, 24_000)).decode()
    request = {
        "model": "step-audio2-tiny", "modalities": ["text", "audio"], "audio": {"voice": "", "format": "pcm16"},
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Answer."}, {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        ]}],
        "max_tokens": SAMPLING["max_tokens"], "temperature": SAMPLING["temperature"],
    }  # fmt: skip
    whole = client.chat.completions.create(**request).choices[0].message.audio
    assert whole.transcript == expected.text and base64.b64decode(whole.data) == expected.pcm16
    transcript, audio = [], []
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta.audio if chunk.choices else None  # the SDK's ChoiceDeltaAudio
        if delta is not None:
            transcript.append(delta.transcript or "")
            audio.append(base64.b64decode(delta.data or ""))
    assert "".join(transcript) == expected.text and b"".join(audio) == expected.pcm16


def _a_registered_voice_speaks_the_answer(endpoint, audio, pcm: bytes, expected) -> None:
    """A voice registered over HTTP `/v1/voices` (the app's VoiceBank, seeded tokenizer and x-vector
    encoders) speaks the same greedy answer in another voice: the same text, other audio than the default
    voice's, the same audio over gRPC Synthesize and the `openai` SDK's chat completions; an unknown voice
    is refused naming the field."""
    from openai import OpenAI

    from router.audio_format import wav_bytes
    from tests.deployments.test_zz_voices import register_http
    from tests.detok_stage.test_voice_clip import wav_bytes as tone_wav

    url = endpoint.http_url + SPEECH_IN.route_prefix
    registered = register_http(url, tone_wav(seconds=2.0, rate=16_000, amplitude=0.5))
    assert registered.status_code == 200, registered.text
    voice = registered.json()["id"]
    assert registered.json()["prompt_tokens"] == 50  # 2 s at 25 Hz
    spoken = run_stream(endpoint.grpc_target, endpoint.app_name, "Answer.", input_audio=audio, voice=voice,
                        request_id="s2s-voice", sampling=SAMPLING)  # fmt: skip
    assert spoken.code == grpc.StatusCode.OK, spoken.details
    assert "".join(c.text for c in spoken.chunks) == expected.text  # the LM's prompt is the same in every voice
    in_voice = np.frombuffer(spoken.pcm16, dtype="<i2").astype(np.int32)
    default = np.frombuffer(expected.pcm16, dtype="<i2").astype(np.int32)
    assert in_voice.shape == default.shape and np.abs(in_voice - default).max() > 50 * MAX_PCM_STEPS

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    clip = {"data": base64.b64encode(wav_bytes(pcm, 24_000)).decode(), "format": "wav"}
    request = {
        "model": "step-audio2-tiny", "modalities": ["text", "audio"], "audio": {"voice": voice, "format": "pcm16"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Answer."},
                                                  {"type": "input_audio", "input_audio": clip}]}],
        "max_tokens": SAMPLING["max_tokens"], "temperature": SAMPLING["temperature"],
    }  # fmt: skip
    answer = client.chat.completions.create(**request).choices[0].message.audio
    chat_pcm = np.frombuffer(base64.b64decode(answer.data), dtype="<i2").astype(np.int32)
    assert answer.transcript == expected.text and chat_pcm.shape == in_voice.shape
    assert np.abs(chat_pcm - in_voice).max() <= MAX_PCM_STEPS
    unknown = run_stream(endpoint.grpc_target, endpoint.app_name, "Answer.", input_audio=audio, voice="v_" + "f" * 24)
    assert unknown.code == grpc.StatusCode.INVALID_ARGUMENT and "voice" in unknown.details


PIECE_BYTES = 960  # 20 ms of 24 kHz PCM16, a microphone client's usual piece


def _a_streamed_turn_answers_as_the_clip_sent_whole(endpoint, pcm: bytes, expected) -> None:
    """The clip as 20 ms pieces over gRPC Converse and over the WebSocket, greedy: the same text, and
    audio within the cluster's PCM tolerance of the in-process answer (the Router's front end gives the
    LLM replica features bit-equal to the ones it computes for the clip sent whole, so the LM's tokens
    are the same; only S3Gen's batch composition can move the PCM). A bad rate is refused by name."""
    chunks = _converse(endpoint, pcm, 24_000, "mic-grpc")
    assert "".join(c.text for c in chunks) == expected.text
    _assert_same_audio(b"".join(c.audio for c in chunks), expected.pcm16)
    assert chunks[-1].final and any(c.text for c in chunks[: next(i for i, c in enumerate(chunks) if c.audio)])

    texts, audio, code = _converse_websocket(endpoint, pcm, 24_000, "mic-ws")
    assert code == 1000 and "".join(texts) == expected.text
    _assert_same_audio(audio, expected.pcm16)

    with pytest.raises(grpc.RpcError) as refused:
        _converse(endpoint, pcm, 8_000, "mic-bad-rate")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.input_audio.sample_rate_hz" in refused.value.details()


def _assert_same_audio(got_pcm: bytes, want_pcm: bytes) -> None:
    got = np.frombuffer(got_pcm, dtype="<i2").astype(np.int32)
    want = np.frombuffer(want_pcm, dtype="<i2").astype(np.int32)
    assert got.shape == want.shape and got.size > 0
    assert np.abs(got - want).max() <= MAX_PCM_STEPS


def _converse(endpoint, pcm: bytes, rate: int, request_id: str, text: str = "Answer.", text_only: bool = False) -> list:
    """One turn over gRPC Converse: the config, the pieces, end_of_turn; every chunk of the answer."""
    from protos import voxray_pb2_grpc

    def requests():
        audio = voxray_pb2.InputAudio(format=voxray_pb2.INPUT_AUDIO_PCM16, sample_rate_hz=rate)
        yield voxray_pb2.ConverseRequest(config=voxray_pb2.SynthesizeRequest(
            text=text, request_id=request_id, sampling=voxray_pb2.SamplingOptions(**SAMPLING),
            input_audio=audio, text_only=text_only))  # fmt: skip
        for start in range(0, len(pcm), PIECE_BYTES):
            yield voxray_pb2.ConverseRequest(audio=pcm[start : start + PIECE_BYTES])
        yield voxray_pb2.ConverseRequest(end_of_turn=True)

    with grpc.insecure_channel(endpoint.grpc_target) as channel:
        stub = voxray_pb2_grpc.SpeechStub(channel)
        return list(stub.Converse(requests(), metadata=(("application", endpoint.app_name),), timeout=240))


def _converse_websocket(
    endpoint, pcm: bytes, rate: int, request_id: str, text: str = "Answer.", served: tuple = (SPEECH_IN, 24_000)
) -> tuple[list[str], bytes, int]:
    """One turn over the WebSocket (of `served`: the app's config and its audio rate): its text messages,
    its audio bytes and the close code."""
    import json

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    app, rate_out = served
    url = endpoint.http_url.replace("http://", "ws://", 1) + app.route_prefix + "/v1/audio/converse"
    texts, audio = [], bytearray()
    with connect(url, open_timeout=60) as ws:
        ws.send(json.dumps({"text": text, "sampling": SAMPLING, "request_id": request_id,
                            "input_audio": {"format": "pcm16", "sample_rate_hz": rate}}))  # fmt: skip
        ready = {"type": "ready", "request_id": request_id, "sample_rate_hz": rate_out}
        assert json.loads(ws.recv(timeout=60)) == ready
        for start in range(0, len(pcm), PIECE_BYTES):
            ws.send(pcm[start : start + PIECE_BYTES])
        ws.send(json.dumps({"end_of_turn": True}))
        try:
            while True:
                message = ws.recv(timeout=120)
                if isinstance(message, bytes):
                    audio += message
                    continue
                event = json.loads(message)
                assert event["type"] in ("text", "audio", "done"), event
                if event["type"] == "text":
                    texts.append(event["text"])
        except ConnectionClosed as closed:
            return texts, bytes(audio), closed.rcvd.code if closed.rcvd else -1
