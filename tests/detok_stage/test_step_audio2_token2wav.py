"""Step-Audio 2 mini's token2wav (V2 encoder + DiT flow, SineGen2 HiFT) as a stateful codec: parity with
the reference (`tests/data/step_audio2_token2wav_golden.npz`, made by
`tests/data/make_step_audio2_token2wav_golden.py` from VoxServe's port on the same seeded tiny weights)
decoded whole and streamed at two chunk cuts, past the 128-position cache cut; the published layout
round trip; batched rounds equal per-request ones; a cache miss rebuilt from the history; bad ids refused."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import TokenChunk, VoiceConditioning
from detok_stage.codecs.step_audio2_codec import CacheMissError, StepAudio2Codec, load_published
from detok_stage.flow.flow import Conditioning
from detok_stage.flow.step_audio2_config import config_from_state, full_token2wav_config, tiny_token2wav_config
from detok_stage.flow.step_audio2_model import StepAudio2Token2Wav
from tests.step_audio2_layout import token2wav_model, write_token2wav

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "step_audio2_token2wav_golden.npz"
SEED = 3  # as in make_step_audio2_token2wav_golden.py
# audio vs the reference's golden (float32, CPU; the reference's iSTFT is its own fold; mels bit-equal): measured
# <= 6.5e-5 on the box the golden was made on, <= 1.6e-4 on an AMD EPYC box (2026-12-08: its float kernels sum in
# another order, which the random tiny HiFT amplifies); the audio itself has a std > 0.05
ATOL = 2.5e-4
MEL_ATOL = 1e-5
# batched vs alone: the matmuls sum in another order (mels ~3e-6 apart), which the random tiny HiFT
# amplifies to ~1e-4 on audio
BATCH_ATOL = 3e-4
STREAMS = [("short", "whole"), ("short", "cut25"), ("short", "cutb"), ("long", "cut25"), ("long", "cutb")]


@functools.cache
def golden() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN))


@functools.cache
def codec() -> StepAudio2Codec:
    return StepAudio2Codec.build(ModelConfig(name="step-audio2-tiny", seed=SEED))


def voice(case: str) -> VoiceConditioning | None:
    """The short case speaks in the preset's default voice; the long one in a 20-token prompt's."""
    if case == "short":
        return None
    g = golden()
    return VoiceConditioning("prompt20", torch.from_numpy(g["prompt20_tokens"]), torch.from_numpy(g["prompt20_mel"]),
                             torch.from_numpy(g["prompt20_xvector"]))  # fmt: skip


def chunks_of(rid: str, case: str, cut: str, tokens: list[int] | None = None) -> list[TokenChunk]:
    """The golden's cut as the chunker sends it: the stream from token 0, kept tokens, 3 look-ahead."""
    tokens = golden()[f"{case}_tokens"].tolist() if tokens is None else tokens
    cuts = golden()[f"{case}_{cut}_cuts"].tolist()
    return [
        TokenChunk(rid, i, [[t] for t in tokens[: end + 3]], 0, start, end, i == len(cuts) - 1, voice=voice(case))
        for i, (start, end) in enumerate(cuts)
    ]


def split_golden(case: str, cut: str) -> list[torch.Tensor]:
    audio = torch.from_numpy(golden()[f"{case}_{cut}_audio"])
    return list(audio.split(golden()[f"{case}_{cut}_samples"].tolist()))


def test_golden_names_its_reference():
    assert str(golden()["reference"]).startswith("vox-serve/vox-serve@")


@pytest.mark.parametrize(("case", "cut"), STREAMS)
def test_streamed_audio_matches_the_reference(case, cut):
    out = codec().decode_stream(chunks_of(f"{case}-{cut}", case, cut))
    for got, want in zip(out, split_golden(case, cut), strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert golden()[f"{case}_{cut}_audio"].std() > 0.05  # not a silent golden
    assert codec().cache_bytes(f"{case}-{cut}") == 0  # the final chunk released the stream


def test_mels_match_past_the_128_position_cut():
    """The long stream (20-token prompt, 25-token chunks): the encoder's 50 Hz cache passes 128 positions
    at the third chunk, so the last two run from cut caches (the 25 Hz stage's read as published)."""
    g, model = golden(), codec().model
    v = voice("long")
    stream = model.new_stream(Conditioning(v.prompt_tokens, v.prompt_mel, v.xvector))
    tokens, cuts = g["long_tokens"].tolist(), g["long_cut25_cuts"].tolist()
    mels, lengths = [], []
    for i, (start, end) in enumerate(cuts):
        last = i == len(cuts) - 1
        mel, _ = model.advance([stream], [tokens[start:end] + ([] if last else tokens[end : end + 3])], last)
        mels.append(mel[0])
        lengths.append(stream.flow.shape_key)
    assert lengths == [(90, 90), (128, 128), (128, 128), (128, 128)]  # 40 prompt frames + 50 per chunk, cut
    assert stream.flow.encoder.att1.shape[3] == 64  # the 25 Hz stage reads half the cut tiling
    want = torch.from_numpy(g["long_cut25_mel"])
    torch.testing.assert_close(torch.cat(mels, dim=1), want, atol=MEL_ATOL, rtol=0)


def test_one_offline_decode_is_the_published_chunking():
    """`decode` streams each row in 25 + 3 chunks: the short case's 40 tokens are the golden's cut25."""
    tokens = golden()["short_tokens"]
    wave = codec().decode(torch.from_numpy(tokens).view(1, -1, 1))
    torch.testing.assert_close(wave[0], torch.cat(split_golden("short", "cut25")), atol=ATOL, rtol=0)


def test_batched_rounds_equal_per_request_rounds(monkeypatch):
    """Three streams of the long voice, two cut alike: each round, the two share one forward."""
    other = (golden()["long_tokens"] * 7 % 6561).tolist()
    alone = [StepAudio2Codec(codec().model).decode_stream(chunks_of("alone", "long", "cut25", t))
             for t in (None, other)]  # fmt: skip
    batch_sizes = []
    advance = codec().model.advance

    def recording(streams, tokens, last_chunk):
        batch_sizes.append(len(streams))
        return advance(streams, tokens, last_chunk)

    monkeypatch.setattr(codec().model, "advance", recording)
    a, b = chunks_of("a", "long", "cut25"), chunks_of("b", "long", "cut25", other)
    out = codec().decode_stream(a + b + chunks_of("c", "long", "cutb"))
    assert batch_sizes == [2, 1, 2, 1, 2, 1, 2]  # (a, b) together each round; c's chunks are longer
    for got, want in zip(out[:4] + out[4:8], alone[0] + alone[1], strict=True):
        torch.testing.assert_close(got, want, atol=BATCH_ATOL, rtol=0)
    for got, want in zip(out[8:], split_golden("long", "cutb"), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_layout_round_trip(tmp_path):
    model = token2wav_model(SEED)
    loaded = load_published(write_token2wav(tmp_path / "token2wav", model), "model.codec_dir")
    assert loaded.config == tiny_token2wav_config(default_prompt_tokens=0)  # shapes read back from the weights
    for ours, theirs in ((model.flow, loaded.flow), (model.hift, loaded.hift)):
        for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    assert "weight_g" in "".join(torch.load(tmp_path / "token2wav" / "hift.pt", weights_only=True))
    built = StepAudio2Codec.build(ModelConfig(name="step-audio2-tiny", codec_dir=str(tmp_path)))
    assert (built.sample_rate_hz, built.samples_per_frame, built.codebook_size) == (24000, 960, 6561)
    with pytest.raises(InvalidArgumentError) as err:
        load_published(tmp_path / "elsewhere", "model.codec_dir")
    assert err.value.field == "model.codec_dir" and "flow.pt" in err.value.message


def test_full_config_reads_back_from_the_published_shapes():
    with torch.device("meta"):
        model = StepAudio2Token2Wav(full_token2wav_config())
    flow, hift = model.published_state()
    assert config_from_state(flow, hift) == full_token2wav_config()
    assert sum(p.numel() for p in model.flow.parameters()) > 100_000_000


def test_cache_miss_rebuilds_from_the_history():
    """A replica that never saw the stream rebuilds it in the published 25-token chunks: with the stream
    cut that way, its next chunk is the uninterrupted stream's."""
    fresh = StepAudio2Codec(codec().model)
    chunks = chunks_of("cold", "long", "cut25")
    out = fresh.decode_stream(chunks[2:])
    assert fresh.num_rebuilds == 1
    for got, want in zip(out, split_golden("long", "cut25")[2:], strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    late = chunks[1]
    with pytest.raises(CacheMissError):
        StepAudio2Codec(codec().model).decode_stream(
            [TokenChunk("late", 1, late.frames[5:], 5, late.keep_start, late.keep_end, False)]
        )


def test_a_chunk_without_its_look_ahead_is_held_for_the_next():
    tokens = golden()["short_tokens"].tolist()
    held = TokenChunk("held", 0, [[t] for t in tokens[:26]], 0, 0, 25, False)  # one look-ahead token of 3
    rest = TokenChunk("held", 1, [[t] for t in tokens[:40]], 0, 25, 40, True)
    first, second = codec().decode_stream([held, rest])
    assert first.numel() == 0
    torch.testing.assert_close(second, torch.from_numpy(golden()["short_whole_audio"]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("bad", [6561, -1])
def test_out_of_range_tokens_name_the_field(bad):
    with pytest.raises(InvalidArgumentError) as err:
        codec().decode(torch.tensor([[[5], [bad]]]))
    assert err.value.field == "frames" and str(bad) in err.value.message
    with pytest.raises(InvalidArgumentError):
        codec().decode_stream([TokenChunk("bad", 0, [[1], [2], [bad], [4]], 0, 0, 1, False)])
    assert codec().cache_bytes("bad") == 0


def test_the_family_serves_a_checkpoint_with_its_token2wav(tmp_path):
    """A Step-Audio-2-mini directory (LM + token2wav/) needs no codec named; the family cuts 25 + 3 chunks."""
    from core.config import EngineConfig
    from llm_stage.chunking import WHOLE_STREAM_FRAMES
    from llm_stage.registry import check_model_config, get_entry
    from tests.step_audio2_layout import step_audio2_model, write_step_audio2

    directory = write_step_audio2(tmp_path / "Step-Audio-2-mini", step_audio2_model(), token2wav_model(SEED))
    config = ModelConfig(name="step-audio2", checkpoint_dir=str(directory))
    entry = check_model_config(config)
    assert entry.family.repo_id == "stepfun-ai/Step-Audio-2-mini" and entry.family.codec is StepAudio2Codec
    built = entry.build_codec(config, "cpu")
    for (name, a), (_, b) in zip(built.model.flow.state_dict().items(), codec().model.flow.state_dict().items(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    schedule = get_entry("step-audio2-tiny").chunk_schedule(EngineConfig(model=ModelConfig(name="step-audio2-tiny")))
    assert (schedule.first_chunk_frames, schedule.chunk_frames, schedule.right_context_frames) == (25, 25, 3)
    assert schedule.left_context_frames == WHOLE_STREAM_FRAMES


def test_a_registered_voice_conditions_token2wav_by_handle():
    """A voice as the VoiceBank computes it (our seeded encoders on a clip: the published 6,561 speech ids,
    80-bin 24 kHz mel, 192-d x-vector) decodes the same by handle as inline, other than in the default
    voice; a handle the replica lacks is a cache miss (the detok replica fetches it from the bank)."""
    import dataclasses

    from core.voices import voice_id_for
    from detok_stage.voice.encoder import VoiceEncoder

    clip = 0.1 * torch.randn(24_000 * 2, generator=torch.Generator().manual_seed(5))
    voice_id = voice_id_for("step-audio2-tiny", b"clip", 24_000, "")
    registered = VoiceEncoder.seeded(5).encode(clip, 24_000).with_id(voice_id)
    fresh = StepAudio2Codec(codec().model)

    def streamed(rid: str, **fields) -> torch.Tensor:
        chunks = [dataclasses.replace(c, **{"voice": None, **fields}) for c in chunks_of(rid, "long", "cut25")]
        return torch.cat(fresh.decode_stream(chunks))

    with pytest.raises(CacheMissError, match="not on this replica"):
        streamed("miss", voice_handle=voice_id)
    fresh.add_voice(registered)
    by_handle, inline, default = streamed("a", voice_handle=voice_id), streamed("b", voice=registered), streamed("c")
    assert fresh.has_voice(voice_id) and torch.equal(by_handle, inline)
    assert float((by_handle - default).abs().max()) > 1e-2


def test_the_family_takes_registered_voices_for_its_spoken_answers():
    """Speech in, speech out in a registered voice: the job keeps the voice id, the LM's prompt is the same
    as in the default voice (the LM is not conditioned on a speaker), and every chunk carries the handle."""
    import dataclasses

    from core.messages import SamplingParams
    from core.voices import VoicePrompt, voice_id_for
    from llm_stage.jobs import build_job
    from llm_stage.registry import get_entry
    from llm_stage.side import LLMSide
    from tests.factories import adapter_engine

    family = get_entry("step-audio2-tiny").family
    adapter = family.lm.build(ModelConfig(name="step-audio2-tiny"))
    voice_id = voice_id_for("step-audio2-tiny", b"clip", 24_000, "")
    assert adapter.takes_registered_voices and "zero-shot" in adapter.no_voices_note
    adapter.add_voice_prompt(VoicePrompt(voice_id, "", (5, 6)))
    assert adapter.format_prompt("hi", voice_id) == adapter.format_prompt("hi", None)
    with pytest.raises(InvalidArgumentError) as err:
        build_job(adapter, text="hi", voice="tara")  # no built-in voices: names the field
    assert err.value.field == "voice"
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    side = LLMSide(adapter_engine(adapter), family.chunk_schedule)
    job = build_job(adapter, text="Say something.", voice=voice_id, sampling=greedy)
    assert job.voice == voice_id
    side.add(dataclasses.replace(job, req_id="v"))
    chunks = []
    while side.engine.has_work:
        chunks += side.step()
    assert chunks and all(c.voice_handle == voice_id for c in chunks)
