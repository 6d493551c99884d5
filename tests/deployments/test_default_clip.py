"""`voices.default_clip`: the voice a request naming none speaks in, for the families whose detokenizer
alone takes a voice (cosyvoice2, step-audio2). Encoded as a registration is (the same encoders, the same
clip checks), it becomes the codec's default: a stream with no voice decodes as one carrying the clip's
voice inline, and no longer as the model's own default. Refused, naming the field, where no served model
can speak in it, where its detokenizer is shared with one that cannot, and for a clip that is no usable
WAV. CPU only, no Ray cluster."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import ValidationError

from core.config import ServeConfig
from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from deployments.voices import DEFAULT_CLIP_VOICE_ID, check_default_clip, default_clip_voice
from detok_stage.voice.encoder import VoiceEncoder
from llm_stage.jobs import build_job
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


def test_its_transcript_prompts_cosyvoice2s_lm_as_the_clip_registered_with_it(clip_file):
    """With `voices.default_clip_text`, an LLM replica of cosyvoice2 prompts a request naming no voice with the
    transcript and the clip's speech tokens, as the VoiceBank registers the clip with that prompt_text: the same
    prompt ids, and the same greedy speech tokens, as the registered voice; not those of the unprompted LM."""
    from core.voices import VoicePrompt, voice_id_for
    from deployments.voices import default_clip_prompt, prompt_default_voice
    from llm_stage.wiring import build_llm_side
    from router.voices import check_prompt_text

    config = ServeConfig.model_validate({"engine": {"model": {"name": "cosyvoice2-tiny"}},
                                         "voices": {"default_clip": str(clip_file),
                                                    "default_clip_text": "  Hello   there.\n"}})  # fmt: skip
    check_default_clip(config)
    prompt = default_clip_prompt(config)
    registered = VoiceEncoder.seeded(config.engine.model.seed).encode(*_clip(clip_file))
    text = check_prompt_text("  Hello   there.\n", config.voices)  # as a registration folds it
    assert prompt.prompt_text == text == "Hello there."
    assert prompt.prompt_tokens == tuple(registered.prompt_tokens.tolist())
    voice_id = voice_id_for("cosyvoice2-tiny", b"the clip", 16_000, text)

    def greedy_tokens(voice: str | None, with_default: bool) -> tuple[list, list[int]]:
        side = build_llm_side(config.engine)
        adapter = side.engine.adapter
        adapter.add_voice_prompt(VoicePrompt(voice_id, text, prompt.prompt_tokens))
        assert prompt_default_voice(config, adapter) if with_default else True
        greedy = SamplingParams(temperature=0.0, max_tokens=24)
        job = build_job(adapter, text="Good morning.", voice=voice, sampling=greedy)
        side.add(dataclasses.replace(job, req_id="r"))
        chunks = []
        while side.engine.has_work:
            chunks += side.step()
        return adapter.format_prompt("Good morning.", voice), [f[0] for c in chunks for f in c.kept_frames]

    default_ids, default_speech = greedy_tokens(None, with_default=True)
    registered_ids, registered_speech = greedy_tokens(voice_id, with_default=False)
    plain_ids, plain_speech = greedy_tokens(None, with_default=False)
    assert default_ids == registered_ids and default_speech == registered_speech and len(default_speech) > 0
    assert plain_ids != default_ids and plain_speech != default_speech


def test_a_transcript_no_served_lm_reads_or_without_its_clip_is_refused_naming_the_field(tmp_path, clip_file):
    from deployments.voices import default_clip_prompt

    def config(name: str, **voices) -> ServeConfig:
        return ServeConfig.model_validate({"engine": {"model": {"name": name}}, "voices": voices})

    step_audio2 = config("step-audio2-tiny", default_clip=str(clip_file), default_clip_text="Hello.")
    with pytest.raises(InvalidArgumentError) as err:
        check_default_clip(step_audio2)  # its LM takes no voice: the transcript would be unused
    assert err.value.field == "voices.default_clip_text" and "cosyvoice2" in str(err.value)
    assert default_clip_prompt(step_audio2) is None
    assert default_clip_prompt(config("cosyvoice2-tiny", default_clip=str(clip_file))) is None  # no transcript
    with pytest.raises(ValidationError, match="voices.default_clip_text: is the transcript of voices.default_clip"):
        config("cosyvoice2-tiny", default_clip_text="Hello.")
    with pytest.raises(ValidationError, match="voices.default_clip_text: is 12 characters; at most"):
        config("cosyvoice2-tiny", default_clip=str(clip_file), default_clip_text="Hello there.",
               max_prompt_text_chars=5)  # fmt: skip
    with pytest.raises(ValidationError, match="voices.default_clip_text: holds control characters"):
        config("cosyvoice2-tiny", default_clip=str(clip_file), default_clip_text="Hello\x00.")
