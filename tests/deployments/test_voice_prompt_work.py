"""An LLM replica's admission charges a voice's own prompt: CosyVoice 2's zero-shot voice (a registered one, or
`voices.default_clip_text`'s) prefills its clip's speech tokens and transcript before the request's text, and
every Chatterbox prompt starts with its voice's conditioning rows. The Router's estimate cannot know them; the
replica, which has looked the voice up, adds them. In-process: the stage's helpers over a real engine, no Ray."""

from __future__ import annotations

import math

import pytest

from core.config import EngineConfig, ModelConfig, ServeConfig
from core.errors import InvalidArgumentError
from core.voices import SpeakerPrompt, VoicePrompt, voice_id_for
from deployments.llm_stage import LLMStage
from llm_stage.jobs import build_job
from llm_stage.prompt_work import prompt_work
from llm_stage.registry import get_entry
from llm_stage.wiring import build_llm_side
from router.admission import StartTimes, predict_ttfa_s
from router.streams import RouterCore

TEXT = "Good morning, and welcome aboard."
TRANSCRIPT = "Hello there, this is my voice."
CLIP_TOKENS = tuple(range(7, 257))  # a 10 s clip's speech tokens at 25 Hz


def stage_of(model: str) -> LLMStage:
    """An LLMStage's admission state over a `model` engine (no detok replicas, no Serve)."""
    stage = object.__new__(LLMStage)
    stage.config = ServeConfig(engine=EngineConfig(model=ModelConfig(name=model, torch_threads=1)))
    stage.side = build_llm_side(stage.config.engine)
    stage.schedule, stage.rows_per_stream, stage.detok_scope = stage.side.schedule, 1, "no-detok-here"
    stage.streams, stage.is_moving_out, stage.avg_stream_s, stage.start_times = {}, False, 0.0, StartTimes()
    return stage


def job_with(stage: LLMStage, voice: str | None):
    return build_job(stage.side.engine.adapter, text=TEXT, voice=voice, req_id="r")


def test_a_cosyvoice2_voice_with_its_transcript_is_charged_its_speech_tokens_and_transcript():
    stage = stage_of("cosyvoice2-tiny")
    adapter = stage.side.engine.adapter
    spoken = voice_id_for("cosyvoice2-tiny", b"clip a", 16_000, TRANSCRIPT)
    unspoken = voice_id_for("cosyvoice2-tiny", b"clip b", 16_000, "")
    adapter.add_voice_prompt(VoicePrompt(spoken, TRANSCRIPT, CLIP_TOKENS))
    adapter.add_voice_prompt(VoicePrompt(unspoken, "", CLIP_TOKENS))
    plain = stage._prompt_work(job_with(stage, None))
    assert plain == prompt_work(type(adapter), job_with(stage, None))  # no voice prompt: the Router's estimate
    voiced = stage._prompt_work(job_with(stage, spoken))
    transcript_positions = math.ceil(len(TRANSCRIPT) / adapter.prompt_chars_per_position)
    assert voiced.num_positions == plain.num_positions + len(CLIP_TOKENS) + transcript_positions
    # the speech tokens are exactly what the prompt adds beyond the transcript's tokens
    added = len(adapter.job_prompt(job_with(stage, spoken))) - len(adapter.job_prompt(job_with(stage, None)))
    assert added == len(CLIP_TOKENS) + len(adapter.tokenizer.encode(TRANSCRIPT))
    # without a transcript the LM gets neither (its cross-lingual mode): nothing more to prefill
    assert stage._prompt_work(job_with(stage, unspoken)) == plain
    load = stage.load()
    assert predict_ttfa_s(load, work=voiced) > predict_ttfa_s(load, work=plain)


def test_the_default_clips_transcript_is_charged_to_a_request_naming_no_voice():
    stage = stage_of("cosyvoice2-tiny")
    adapter = stage.side.engine.adapter
    before = stage._prompt_work(job_with(stage, None)).num_positions
    adapter.set_default_voice_prompt(VoicePrompt("default-clip", TRANSCRIPT, CLIP_TOKENS))
    after = stage._prompt_work(job_with(stage, None)).num_positions
    assert after - before == adapter.voice_prompt_positions(None) > len(CLIP_TOKENS)


def test_an_unknown_voice_is_refused_naming_the_field_not_charged():
    stage = stage_of("cosyvoice2-tiny")
    unknown = voice_id_for("cosyvoice2-tiny", b"never registered", 16_000, "")
    with pytest.raises(InvalidArgumentError) as err:
        stage._prompt_work(job_with(stage, unknown))
    assert err.value.field == "voice"


def test_every_chatterbox_prompt_is_charged_its_voices_conditioning_rows():
    stage = stage_of("chatterbox-tiny")
    adapter = stage.side.engine.adapter
    job = job_with(stage, None)
    prompt = adapter.job_prompt(job)
    text_positions = len(adapter._text_ids(TEXT)) + 2  # start/stop text, then two speech-start positions
    assert adapter.voice_prompt_positions(None) == len(prompt) - text_positions > 1
    work = stage._prompt_work(job)  # guided by default: its twin's prompt carries the voice rows too
    estimate = type(adapter).estimate_prompt_positions(job)
    assert job.sampling.guidance_scale is not None
    assert work.num_positions == 2 * (estimate + adapter.voice_prompt_positions(None))


def test_a_family_whose_lm_takes_no_voice_prompt_is_charged_the_routers_estimate():
    stage = stage_of("orpheus-tiny")
    job = job_with(stage, "tara")
    assert stage.side.engine.adapter.voice_prompt_positions("tara") == 0
    assert stage._prompt_work(job) == prompt_work(type(stage.side.engine.adapter), job)


def routers_estimate(model: str) -> RouterCore:
    """A Router's estimate alone (`RouterCore.prompt_work`): no handles, no Serve, no registered voice learnt."""
    core = object.__new__(RouterCore)
    core.entry, core.voices = get_entry(model), None
    return core


@pytest.mark.parametrize("model", ["cosyvoice2-tiny", "chatterbox-tiny"])
def test_the_routers_estimate_counts_the_default_voice_each_replica_reports(model):
    """A request naming no voice prefills the replica's default voice prompt (CosyVoice 2's default clip, Chatterbox's
    voice rows, in its CFG twin too). The Router cannot know it; the replica reports it in its load, and the Router's
    estimate on that load comes to what the replica charges itself, not twice on the replica."""
    stage = stage_of(model)
    adapter = stage.side.engine.adapter
    if model == "cosyvoice2-tiny":
        adapter.set_default_voice_prompt(VoicePrompt("default-clip", TRANSCRIPT, CLIP_TOKENS))
    load = stage.load()
    assert load.default_voice_positions == adapter.voice_prompt_positions(None) > 0
    guidances = (None, 3.0) if adapter.guidance is not None else (None,)
    for guidance in guidances:
        job = build_job(adapter, text=TEXT, voice=None, sampling={"guidance_scale": guidance}, req_id="r")
        routers, replicas = routers_estimate(model).prompt_work(job), stage._prompt_work(job)
        assert routers.num_positions < replicas.num_positions  # the Router alone does not know the voice
        assert load.work_here(routers) == load.work_here(replicas) == replicas
        assert predict_ttfa_s(load, work=load.work_here(routers)) == predict_ttfa_s(load, work=replicas)


def test_the_routers_estimate_counts_a_registered_chatterbox_voice_as_the_default_ones_rows():
    """Every Chatterbox voice conditions T3 on one speaker row, the perceiver's fixed queries and the emotion
    position: the Router, which would need the model's layout to count a registered voice, counts it as the
    default voice its replicas report, which is what the replica charges for it."""
    stage = stage_of("chatterbox-tiny")
    adapter = stage.side.engine.adapter
    speaker = SpeakerPrompt(tuple([0.0625] * adapter.layout.speaker_embed_size), tuple(range(10, 70)))
    voice = voice_id_for("chatterbox-tiny", b"clip c", 16_000, "")
    adapter.add_voice_prompt(VoicePrompt(voice, "", (), speaker))
    assert adapter.voice_prompt_positions(voice) == adapter.voice_prompt_positions(None)
    job = job_with(stage, voice)
    load = stage.load()
    assert load.work_here(routers_estimate("chatterbox-tiny").prompt_work(job)) == stage._prompt_work(job)
