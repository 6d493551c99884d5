"""`voices.default_clip`: the voice a request naming none speaks in, for the families whose detokenizer
alone takes a voice (cosyvoice2, step-audio2). Encoded as a registration is (the same encoders, the same
clip checks), it becomes the codec's default: a stream with no voice decodes as one carrying the clip's
voice inline, and no longer as the model's own default. Refused, naming the field, where no served model
can speak in it, where its detokenizer is shared with one that cannot, and for a clip that is no usable
WAV. CPU only, no Ray cluster."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from core.config import ServeConfig
from core.errors import InvalidArgumentError
from deployments.voices import DEFAULT_CLIP_VOICE_ID, check_default_clip, default_clip_voice
from detok_stage.voice.encoder import VoiceEncoder
from llm_stage.wiring import build_detok_engine
from tests.detok_stage.test_voice_clip import wav_bytes


@pytest.fixture
def clip_file(tmp_path):
    path = tmp_path / "default.wav"
    path.write_bytes(wav_bytes(seconds=2.0, rate=16_000, amplitude=0.5))
    return path


def one_model(name: str, clip) -> ServeConfig:
    return ServeConfig.model_validate({"engine": {"model": {"name": name}}, "voices": {"default_clip": str(clip)}})


def several(names: tuple[str, ...], clip) -> ServeConfig:
    models = [{"engine": {"model": {"name": name}}} for name in names]
    return ServeConfig.model_validate({"models": models, "voices": {"default_clip": str(clip)}})


@pytest.mark.parametrize("model", ["step-audio2-tiny", "cosyvoice2-tiny"])
def test_the_clip_becomes_the_voice_of_a_stream_naming_none(model, clip_file):
    config = one_model(model, clip_file)
    check_default_clip(config)
    voice = default_clip_voice(config)
    assert voice is not None and voice.voice_id == DEFAULT_CLIP_VOICE_ID
    registered = VoiceEncoder.seeded(config.engine.model.seed).encode(*_clip(clip_file))  # as the VoiceBank encodes
    assert torch.equal(voice.prompt_tokens, registered.prompt_tokens) and voice.prompt_tokens.numel() == 50
    assert torch.equal(voice.xvector, registered.xvector)

    codec = build_detok_engine(config.engine).codec
    frames = torch.randint(0, 300, (1, 40, 1), generator=torch.Generator().manual_seed(3))
    own_default = codec.decode(frames)
    inline = codec.decode(frames, voice)
    codec.set_default_voice(voice)
    in_clip_voice = codec.decode(frames)
    assert torch.equal(in_clip_voice, inline)
    assert (in_clip_voice - own_default).abs().max() > 1e-3


def _clip(path):
    from detok_stage.voice.clip import decode_clip

    clip = decode_clip(path.read_bytes(), "audio", 1.0, 20.0)
    return clip.wave, clip.sample_rate_hz


@pytest.mark.parametrize("model", ["orpheus-tiny", "chatterbox-tiny"])
def test_a_model_that_cannot_speak_in_it_is_refused_naming_the_field(model, clip_file):
    config = one_model(model, clip_file)
    with pytest.raises(InvalidArgumentError) as err:
        check_default_clip(config)
    assert err.value.field == "voices.default_clip" and "cosyvoice2" in str(err.value) and model in str(err.value)
    assert default_clip_voice(config) is None  # (a detok replica of such a model leaves its default alone)


def test_several_models_take_it_where_they_can_but_not_on_a_detokenizer_shared_with_one_that_cannot(clip_file):
    check_default_clip(several(("orpheus-tiny", "step-audio2-tiny"), clip_file))  # orpheus keeps its own voices
    with pytest.raises(InvalidArgumentError) as err:
        check_default_clip(several(("cosyvoice2-tiny", "chatterbox-tiny"), clip_file))  # one S3Gen deployment
    assert err.value.field == "voices.default_clip" and "shares its detokenizer with chatterbox-tiny" in str(err.value)


def test_voxray_serve_reads_the_clip_before_ray_starts(tmp_path, clip_file):
    """`voxray serve --config` refuses an unusable clip at once (the app builder, which may run where the clip
    is not, checks only which models can speak in it)."""
    from cluster.cli import build_parser, serve_config

    def config_file(clip) -> str:
        path = tmp_path / "serve.yaml"
        path.write_text(f"engine:\n  model:\n    name: step-audio2-tiny\nvoices:\n  default_clip: {clip}\n")
        return str(path)

    assert serve_config(build_parser().parse_args(["serve", "--config", config_file(clip_file)])).voices.default_clip
    noise = tmp_path / "noise.wav"
    noise.write_bytes(b"RIFF but not a wave file")
    check_default_clip(one_model("step-audio2-tiny", noise))  # (the app builder's check reads no file)
    with pytest.raises(InvalidArgumentError) as err:
        serve_config(build_parser().parse_args(["serve", "--config", config_file(noise)]))
    assert err.value.field == "voices.default_clip" and "is not a PCM WAV" in str(err.value)


def test_a_missing_or_unusable_clip_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValidationError, match="voices.default_clip: no such file"):
        one_model("step-audio2-tiny", tmp_path / "absent.wav")
    text = tmp_path / "notes.wav"
    text.write_bytes(b"not audio")
    with pytest.raises(InvalidArgumentError) as err:
        default_clip_voice(one_model("step-audio2-tiny", text))
    assert err.value.field == "voices.default_clip" and "is not a PCM WAV" in str(err.value)
    short = tmp_path / "short.wav"
    short.write_bytes(wav_bytes(seconds=0.3))
    with pytest.raises(InvalidArgumentError) as err:
        default_clip_voice(one_model("cosyvoice2-tiny", short))
    assert err.value.field == "voices.default_clip"
