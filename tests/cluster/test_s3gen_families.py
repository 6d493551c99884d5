"""The cosyvoice2 and chatterbox families end to end in-process: their LMs (CosyVoice 2's Qwen2 LM,
Chatterbox's T3 with CFG) feed the S3Gen flow-matching detokenizer through the LLM side's chunker
and the detok engine; streamed audio equals offline decoding of the same tokens. Also their
registration: served names, checkpoint detection without a config.json, and chunk schedules the
detokenizer cannot stream refused naming the field."""

from __future__ import annotations

import functools
import wave

import pytest
import torch

from cluster.cli import main
from cluster.pipeline import InProcessPipeline
from core.config import CacheConfig, DetokConfig, EngineConfig, ModelConfig, SchedulerConfig
from core.errors import InvalidArgumentError
from core.messages import AudioChunk, TokenChunk
from detok_stage.codecs.s3gen_codec import S3GenCodec
from detok_stage.engine import pcm16_to_float
from llm_stage.chunking import WHOLE_STREAM_FRAMES
from llm_stage.models.chatterbox import DEFAULT_VOICE, ChatterboxAdapter
from llm_stage.registry import check_engine_config, check_model_config, get_entry, model_config_for, model_names
from tests.published_layouts import cosyvoice2_lm, write_chatterbox_lm, write_cosyvoice2_lm

FAMILIES = ("cosyvoice2-tiny", "chatterbox-tiny")
# S3Gen streamed vs offline: ~6e-5 float noise through the NSF phase (detok tests), plus PCM16 rounding
PCM_TOLERANCE = 2e-4


def engine_config(name: str, detok: DetokConfig | None = None, max_seq_len: int = 1024) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(name=name, seed=3),
        cache=CacheConfig(num_slots=8, max_seq_len=max_seq_len),
        scheduler=SchedulerConfig(max_batch_size=8),
        detok=detok or DetokConfig(),
    )


@functools.cache
def pipeline(name: str) -> InProcessPipeline:
    return InProcessPipeline(engine_config(name))


def run_recording_chunks(
    pipe: InProcessPipeline, requests: dict[str, tuple[str, int]]
) -> tuple[dict[str, list[TokenChunk]], dict[str, list[AudioChunk]]]:
    """Submit `requests` (req_id -> (text, max_tokens)) at once; every TokenChunk the LLM side cut and
    every AudioChunk the detok engine returned, per request."""
    token_chunks: dict[str, list[TokenChunk]] = {rid: [] for rid in requests}
    submit = pipe.worker.submit

    def record(chunk: TokenChunk) -> None:
        token_chunks[chunk.req_id].append(chunk)
        submit(chunk)

    pipe.worker.submit = record  # type: ignore[method-assign]
    try:
        for index, (rid, (text, max_tokens)) in enumerate(requests.items()):
            pipe.submit(rid, text, None, {"max_tokens": max_tokens, "seed": index, "temperature": 1.0})
        audio: dict[str, list[AudioChunk]] = {rid: [] for rid in requests}
        for chunk in pipe.stream():
            audio[chunk.req_id].append(chunk)
    finally:
        del pipe.worker.submit
    return token_chunks, audio


def assert_streamed_equals_offline(pipe: InProcessPipeline, chunks: list[TokenChunk], audio: list[AudioChunk]) -> int:
    """The chunks carry the stream from token 0; the last one holds every token. Returns the token count."""
    assert [c.seq for c in chunks] == list(range(len(chunks))) == [a.seq for a in audio]
    assert chunks[-1].is_final and audio[-1].is_final and chunks[-1].window_start == 0
    tokens = chunks[-1].frames
    assert all(0 <= code < 6561 for frame in tokens for code in frame)
    streamed = torch.from_numpy(pcm16_to_float(b"".join(a.pcm16 for a in audio)))
    offline = pipe.detok.codec.decode(torch.tensor(tokens)[None])[0]
    assert tuple(streamed.shape) == tuple(offline.shape) == (len(tokens) * 960,)
    assert offline.abs().max() > 1e-3  # audio, not silence
    diff = (streamed - offline.clamp(-1, 1)).abs().max().item()
    print(f"{pipe.llm.engine.adapter.family}: {len(tokens)} tokens in {len(chunks)} chunks, max |diff| {diff:.2e}")
    assert diff < PCM_TOLERANCE
    return len(tokens)


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_audio_equals_offline_decoding_of_the_same_tokens(name):
    pipe = pipeline(name)
    requests = {"a": ("Hello there.", 61), "b": ("A second, longer request.", 110), "c": ("Hi.", 30)}
    token_chunks, audio = run_recording_chunks(pipe, requests)
    for rid in requests:
        assert_streamed_equals_offline(pipe, token_chunks[rid], audio[rid])
    assert max(len(chunks) for chunks in token_chunks.values()) >= 3  # first chunk + whole 25-token chunks
    for rid, chunks in token_chunks.items():
        # the family's schedule: 50 then 25 tokens kept, 3 look-ahead tokens, the stream from token 0
        assert all(c.window_start == 0 for c in chunks)
        assert [c.keep_end - c.keep_start for c in chunks[:-1]] == [50, 25, 25, 25][: len(chunks) - 1]
        assert all(c.window_start + c.num_frames == c.keep_end + 3 for c in chunks[:-1])
        # two attention chunks' mel (100 frames) less the 28 HiFT holds back until the next chunk
        if len(chunks) > 1:
            assert audio[rid][0].num_samples == (100 - 28) * 480
        # the frames each chunk's audio plays (the LLM side's frame duration), not the frames it kept
        for piece in audio[rid]:
            assert piece.num_frames * 960 == piece.num_samples or (piece.num_frames == 0 and piece.num_samples % 960)
    assert pipe.llm.engine.timer.frame_s == pytest.approx(0.04)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_valid_wide_schedule_with_other_chunk_sizes_streams_the_same_audio(name):
    detok = DetokConfig(
        schedule="wide", first_chunk_frames=3, chunk_frames=11, adaptive=True,
        left_context_frames=WHOLE_STREAM_FRAMES, right_context_frames=4,
    )  # fmt: skip
    pipe = InProcessPipeline(engine_config(name, detok))
    try:
        token_chunks, audio = run_recording_chunks(pipe, {"w": ("Odd chunk sizes.", 57)})
        assert len(token_chunks["w"]) > 3
        assert_streamed_equals_offline(pipe, token_chunks["w"], audio["w"])
    finally:
        pipe.close()


@pytest.mark.parametrize("name", FAMILIES)
def test_synthesize_cli_writes_24khz_audio(tmp_path, name):
    out = tmp_path / "out.wav"
    assert main(["synthesize", "--model", name, "--text", "Hello.", "--max-tokens", "40", "-o", str(out)]) == 0
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert 0 < wav.getnframes() <= 40 * 960 and wav.getnframes() % 960 == 0


@pytest.mark.parametrize(
    ("detok", "field"),
    [
        (DetokConfig(schedule="reference"), "detok.schedule"),
        (DetokConfig(schedule="wide"), "detok.left_context_frames"),  # 3 frames of history: no cold rebuild
        (DetokConfig(schedule="wide", left_context_frames=1024, right_context_frames=2), "detok.right_context_frames"),
        (DetokConfig(schedule="wide", left_context_frames=1023), "detok.left_context_frames"),
        (DetokConfig(flow_sink_frames=16), "detok.flow_sink_frames"),  # a sink without a window
    ],
)
@pytest.mark.parametrize("name", FAMILIES)
def test_schedules_the_detokenizer_cannot_stream_are_refused_naming_the_field(name, detok, field):
    config = engine_config(name, detok, max_seq_len=1024)
    with pytest.raises(InvalidArgumentError) as err:
        check_engine_config(config)
    assert err.value.field == field
    with pytest.raises(InvalidArgumentError) as err:
        InProcessPipeline(config)
    assert err.value.field == field


def test_a_bounded_flow_history_streams_what_offline_decoding_gives_and_is_refused_without_a_flow():
    """detok.flow_window_frames reaches the replica's codec: the streamed audio equals offline decoding
    under the same bounded history and differs from the exact decoding of the same tokens."""
    pipe = InProcessPipeline(engine_config("cosyvoice2-tiny", DetokConfig(flow_sink_frames=8, flow_window_frames=16)))
    try:
        token_chunks, audio = run_recording_chunks(pipe, {"b": ("A long enough stream.", 120)})
        assert pipe.detok.codec.model.flow.history.bounded
        assert assert_streamed_equals_offline(pipe, token_chunks["b"], audio["b"]) > 50  # past one chunk + window
        tokens = torch.tensor(token_chunks["b"][-1].frames)[None]
        exact = pipeline("cosyvoice2-tiny").detok.codec.decode(tokens)[0]  # the same seeded weights
        assert (pipe.detok.codec.decode(tokens)[0] - exact).abs().max() > 1e-3
    finally:
        pipe.close()
    for field in ("flow_window_frames", "flow_sink_frames"):
        with pytest.raises(InvalidArgumentError) as err:
            check_engine_config(engine_config("orpheus-tiny", DetokConfig(**{field: 16})))
        assert err.value.field == f"detok.{field}"


def test_the_cli_refuses_a_bad_schedule_before_building_anything(capsys):
    assert main(["synthesize", "--model", "cosyvoice2-tiny", "--schedule", "reference", "--text", "x"]) == 2
    assert "detok.schedule" in capsys.readouterr().err


def test_throughput_policy_keeps_the_family_schedule_and_other_families_keep_theirs():
    throughput = engine_config("cosyvoice2-tiny").model_copy(update={"scheduler": SchedulerConfig(policy="throughput")})
    schedule = get_entry("cosyvoice2-tiny").chunk_schedule(throughput)
    assert (schedule.first_chunk_frames, schedule.chunk_frames, schedule.right_context_frames) == (50, 25, 3)
    assert schedule.left_context_frames == WHOLE_STREAM_FRAMES
    orpheus = get_entry("orpheus-tiny").chunk_schedule(EngineConfig())  # auto = wide for a family without one
    assert (orpheus.first_chunk_frames, orpheus.chunk_frames, orpheus.left_context_frames) == (2, 8, 3)


def test_models_lists_both_families(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "\ncosyvoice2  (and cosyvoice2-tiny" in out and "\nchatterbox  (and chatterbox-tiny" in out
    assert "voices: none built in; zero-shot voices from a reference clip" in out and "voices: default" in out
    assert out.count("24000 Hz; 25.00 codec frames/s") == 3  # and step-audio2's


def test_served_names_and_family_declarations():
    names = model_names()
    for family in ("cosyvoice2", "chatterbox"):
        assert family in names and family + "-tiny" in names
        entry = get_entry(family + "-tiny")
        assert entry.family.codec is S3GenCodec
        assert (entry.sample_rate_hz, entry.family.frame_rate_hz, entry.family.tokens_per_s) == (24000, 25.0, 25.0)
    assert get_entry("cosyvoice2").voices == () and get_entry("cosyvoice2").default_voice is None
    assert get_entry("chatterbox").voices == (DEFAULT_VOICE,) and get_entry("chatterbox").rows_per_stream == 2
    assert get_entry("cosyvoice2").rows_per_stream == 1
    assert get_entry("cosyvoice2").default_sampling.ras_window == 10
    assert get_entry("chatterbox").default_sampling.exaggeration == 0.5


def test_published_directories_without_config_json_are_detected(tmp_path):
    cosy = write_cosyvoice2_lm(tmp_path / "CosyVoice2-0.5B", cosyvoice2_lm(seed=1))
    adapter = ChatterboxAdapter.build(ModelConfig(name="chatterbox-tiny", seed=1))
    chatter = write_chatterbox_lm(tmp_path / "chatterbox", adapter.model, adapter.voice_specs[DEFAULT_VOICE])
    assert not (cosy / "config.json").exists() and not (chatter / "config.json").exists()
    assert model_config_for(cosy).name == "cosyvoice2"
    assert model_config_for(chatter).name == "chatterbox"
    with pytest.raises(InvalidArgumentError) as err:
        check_model_config(ModelConfig(name="chatterbox", checkpoint_dir=cosy))
    assert err.value.field == "model.checkpoint_dir" and "cosyvoice2" in str(err.value)
    with pytest.raises(InvalidArgumentError) as err:
        model_config_for(tmp_path)
    assert err.value.field == "model"


def test_voice_encoders_a_server_lacks_are_named_at_start(tmp_path):
    """CosyVoice 2's published directory has no encoders we load (its front end is ONNX): it serves
    without zero-shot voices, saying why and which setting adds them; a `voices.encoder_dir` that
    holds none is refused at start, naming that field."""
    from core.config import ServeConfig
    from deployments.voices import check_voice_encoders
    from detok_stage.voice.encoder import VoiceEncoder

    cosy = write_cosyvoice2_lm(tmp_path / "CosyVoice2-0.5B", cosyvoice2_lm(seed=1))

    def config(**voices) -> ServeConfig:
        model = ModelConfig(name="cosyvoice2", checkpoint_dir=cosy)
        return ServeConfig.model_validate({"engine": {"model": model.model_dump()}, "voices": voices})

    why = check_voice_encoders(config())
    assert "no voice_encoders.pt" in why and "set voices.encoder_dir" in why
    for encoder_dir, says in ((tmp_path / "nowhere", "not a directory"), (tmp_path, "no voice_encoders.pt")):
        with pytest.raises(InvalidArgumentError) as err:
            check_voice_encoders(config(encoder_dir=str(encoder_dir)))
        assert err.value.field == "voices.encoder_dir" and says in str(err.value), err.value
    encoders = tmp_path / "encoders"
    encoders.mkdir()
    seeded = VoiceEncoder.seeded(0)
    state = {f"tokenizer.{k}": v for k, v in seeded.tokenizer.state_dict().items()}
    state |= {f"speaker_encoder.{k}": v for k, v in seeded.speaker.state_dict().items()}
    torch.save(state, encoders / "s3gen.pt")
    assert check_voice_encoders(config(encoder_dir=str(encoders))) is None  # found
    assert check_voice_encoders(ServeConfig()) is None  # a family without registered voices


def test_chatterbox_directory_voice_conditions_the_detokenizer(tmp_path):
    """conds.pt's `gen` part (the voice T3 serves as `default`) becomes S3Gen's default conditioning."""
    from core.messages import VoiceConditioning
    from detok_stage.flow.config import tiny_s3gen_config

    reference = S3GenCodec.build(ModelConfig(name="s3gen-tiny", seed=5), preset=tiny_s3gen_config())
    torch.save(reference.model.state_dict(), tmp_path / "s3gen.pt")
    gen = torch.Generator().manual_seed(2)
    voice = {"prompt_token": torch.randint(0, 64, (1, 7), generator=gen), "prompt_token_len": torch.tensor([7]),
             "prompt_feat": torch.randn(1, 14, 80, generator=gen), "prompt_feat_len": None,
             "embedding": torch.randn(1, 192, generator=gen)}  # fmt: skip
    torch.save({"t3": {"speaker_emb": torch.zeros(1, 256)}, "gen": voice}, tmp_path / "conds.pt")
    loaded = S3GenCodec.build(ModelConfig(name="chatterbox", checkpoint_dir=tmp_path), preset=tiny_s3gen_config())
    frames = torch.randint(0, 64, (1, 9, 1), generator=gen)
    same = VoiceConditioning("default", voice["prompt_token"][0], voice["prompt_feat"][0], voice["embedding"][0])
    torch.testing.assert_close(loaded.decode(frames), reference.decode(frames, voice=same))
    assert not torch.allclose(loaded.decode(frames), reference.decode(frames), atol=1e-3)
    torch.save({"t3": {}}, tmp_path / "conds.pt")
    with pytest.raises(InvalidArgumentError) as err:
        S3GenCodec.build(ModelConfig(name="chatterbox", checkpoint_dir=tmp_path), preset=tiny_s3gen_config())
    assert err.value.field == "model.checkpoint_dir"
