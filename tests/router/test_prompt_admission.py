"""Admission charges a request's own prompt work (router.admission.prefill_s): a speech-in clip's
positions and encode at the replica's measured prefill pace; a text-only answer's first output is its
first text (no chunk, no detok). Hand-built load reports, pure: no Ray."""

from dataclasses import replace

import pytest

from core.messages import AudioClip, ChatTurn, SamplingParams
from llm_stage.jobs import build_job
from llm_stage.models.orpheus import OrpheusAdapter
from llm_stage.models.step_audio2 import StepAudio2Adapter
from llm_stage.prompt_work import PromptWork, prompt_work
from router.admission import (
    Admission,
    ReplicaLoad,
    admits_anywhere,
    credible_ttfa_s,
    decide,
    first_chunk_s,
    is_credible,
    predict_ttfa_s,
    start_to_first_output_s,
)
from router.deadlines import best_predicted_ttfa_s

STEP_S = 0.02


def busy(**fields) -> ReplicaLoad:
    """A replica running 3 streams (its limit 9), its step and both detok and prefill paces measured:
    2000 prompt positions a second beyond a step, and an encoder at 0.05 s per second of audio."""
    base = ReplicaLoad(num_active=3, max_streams=16, max_queued=2, step_s=STEP_S, first_chunk_tokens=24,
                       avg_stream_s=6.0, real_time_streams=11.0, measured_streams=8, detok_first_chunk_s=0.1,
                       prefill_tokens_per_s=2000.0, encoder_s_per_audio_s=0.05)  # fmt: skip
    return replace(base, **fields)


def clip(duration_s: float) -> AudioClip:
    return AudioClip(b"\x01\x00" * round(duration_s * 16_000), 16_000)


def speech_in(duration_s: float, text_only: bool = False) -> PromptWork:
    """What the Router estimates for a Step-Audio 2 request carrying `duration_s` of audio."""
    job = build_job(StepAudio2Adapter, text="", audio=clip(duration_s), text_only=text_only)
    return prompt_work(StepAudio2Adapter, job)


TTS = prompt_work(OrpheusAdapter, build_job(OrpheusAdapter, text="Hello there, how are you today?", voice="tara"))


def test_the_estimate_counts_the_familys_positions_per_audio_second():
    long, short = speech_in(25.0), speech_in(2.0)
    assert long.audio_s == pytest.approx(25.0) and short.audio_s == pytest.approx(2.0)
    # 315 positions for a 25 s piece (its placeholders and two markers), ~12.6 a second
    assert StepAudio2Adapter.audio_prompt_positions(25.0) == 315
    assert long.num_positions - short.num_positions == 315 - StepAudio2Adapter.audio_prompt_positions(2.0)
    assert StepAudio2Adapter.audio_prompt_positions(50.0) == 630  # two pieces
    assert TTS.audio_s == 0.0 and 0 < TTS.num_positions < short.num_positions
    assert OrpheusAdapter.audio_prompt_positions(25.0) == 0  # a family that takes no audio


def test_a_long_clip_is_predicted_later_than_a_short_one_and_a_tts_prompt():
    load = busy()
    long_s, short_s, tts_s = (predict_ttfa_s(load, work=w) for w in (speech_in(25.0), speech_in(2.0), TTS))
    assert long_s > short_s > tts_s > predict_ttfa_s(load)  # no work: the step that prefills, nothing more
    long = speech_in(25.0)
    own_s = long.num_positions / 2000.0 + 25.0 * 0.05  # its positions beyond the step, and its encode
    assert long_s - predict_ttfa_s(load) == pytest.approx(own_s)
    # a deadline the TTS prompt makes and the long clip does not: the clip is refused, the prompt admitted
    deadline_s = (long_s + tts_s) / 2
    assert decide(load, deadline_s, TTS) is Admission.ADMIT
    assert decide(load, deadline_s, long) is Admission.REJECT
    assert not admits_anywhere([load], deadline_s, long) and admits_anywhere([load], deadline_s, TTS)


def test_the_measured_prefill_pace_moves_the_prediction():
    long = speech_in(25.0)
    slow, fast = busy(prefill_tokens_per_s=500.0), busy(prefill_tokens_per_s=5000.0)
    assert predict_ttfa_s(slow, work=long) - predict_ttfa_s(fast, work=long) == pytest.approx(
        long.num_positions / 500.0 - long.num_positions / 5000.0
    )
    slow_encoder = busy(encoder_s_per_audio_s=0.2)
    assert predict_ttfa_s(slow_encoder, work=long) - predict_ttfa_s(busy(), work=long) == pytest.approx(25.0 * 0.15)
    # a queued request is charged its own prefill too (at least what recent first chunks took)
    full = busy(num_active=9, ends_in_s=(0.5,) * 9, measured_first_chunk_s=0.3)
    assert predict_ttfa_s(full, work=long) == pytest.approx(0.5 + first_chunk_s(full, long))
    assert start_to_first_output_s(full, TTS) == pytest.approx(max(first_chunk_s(full, TTS), 0.3))


def test_a_text_only_answer_is_not_charged_detok_nor_its_first_chunks_steps():
    load = busy()
    answer, spoken = speech_in(5.0, text_only=True), speech_in(5.0)
    text_s = predict_ttfa_s(load, work=answer)
    # its first text: the step that prefills it (and samples it) and its prompt work at the measured pace
    assert text_s == pytest.approx(STEP_S + answer.num_positions / 2000.0 + 5.0 * 0.05)
    detok_heavy = busy(detok_first_chunk_s=2.0)
    assert predict_ttfa_s(detok_heavy, work=answer) == pytest.approx(text_s)  # the detok stage plays no part
    assert predict_ttfa_s(detok_heavy, work=spoken) > predict_ttfa_s(load, work=spoken) + 1.8
    assert decide(detok_heavy, 1.0, answer) is Admission.ADMIT
    assert decide(detok_heavy, 1.0, spoken) is Admission.REJECT
    # recent streams' first chunks do not hold a queued text-only answer to their time
    full = busy(num_active=9, ends_in_s=(0.5,) * 9, measured_first_chunk_s=1.5)
    assert start_to_first_output_s(full, answer) == pytest.approx(text_s)


def test_nothing_is_refused_on_an_unmeasured_pace():
    """A replica that never prefilled (or encoded) since it started charges nothing for a prompt's
    positions (or audio): the prediction is the old one, the step that prefills it, and a request
    the old prediction admitted is admitted, however long its clip."""
    long = speech_in(60.0)
    unmeasured = busy(prefill_tokens_per_s=0.0, encoder_s_per_audio_s=0.0)
    assert predict_ttfa_s(unmeasured, work=long) == pytest.approx(predict_ttfa_s(unmeasured))
    deadline_s = predict_ttfa_s(unmeasured) + 0.01
    assert decide(unmeasured, deadline_s, long) is Admission.ADMIT
    encoder_only = replace(unmeasured, encoder_s_per_audio_s=0.05)  # the encoder measured, the positions not
    assert predict_ttfa_s(encoder_only, work=long) == pytest.approx(predict_ttfa_s(unmeasured) + 60.0 * 0.05)
    # and the step prior alone refuses nothing, prompt work or not (`is_credible`)
    prior = replace(busy(), step_s=0.0)
    assert decide(prior, 0.01, long) is Admission.ADMIT and credible_ttfa_s(prior, long) is None


def test_a_long_clips_own_prefill_is_credible_beside_short_measured_ttfas():
    """`credible_ttfa_factor` bounds a prediction by what recent streams measured, so a transient
    refuses nothing; a request's own prompt work at the measured pace is no transient, so it is added
    to that bound (recent short prompts did not carry it)."""
    long = speech_in(60.0)
    measured = busy(measured_ttfa_s=0.4)  # recent streams met first audio in 0.4 s: the bound is 1.2 s
    predicted_s = predict_ttfa_s(measured, work=long)
    assert predicted_s > 3 * 0.4 and is_credible(measured, predicted_s, long)
    assert decide(measured, 1.2, long) is Admission.REJECT
    assert not is_credible(measured, predicted_s)  # without its work the same figure would be a transient
    assert best_predicted_ttfa_s([measured], long) == pytest.approx(predicted_s)
    assert best_predicted_ttfa_s([measured], TTS) == pytest.approx(predict_ttfa_s(measured, work=TTS))
    transient = replace(measured, ends_in_s=(40.0,) * 3, num_active=9)  # waits: 40 s, far past 3 x 0.4 s
    assert decide(transient, 15.0, long) is Admission.QUEUE  # the rule still holds with the work added


def test_the_work_travels_with_the_jobs_fields():
    job = build_job(StepAudio2Adapter, text="What did I say?", audio=clip(3.0),
                    sampling=SamplingParams(max_tokens=8), text_only=True)  # fmt: skip
    work = prompt_work(StepAudio2Adapter, job)
    assert work.text_only and work.audio_s == pytest.approx(3.0)
    assert work.num_positions == StepAudio2Adapter.estimate_prompt_positions(job)
    assert prompt_work(OrpheusAdapter, build_job(OrpheusAdapter, text="Hi.", voice="tara")).audio_s == 0.0


def test_a_long_prompt_is_charged_the_steps_its_prefill_budget_spreads_it_over():
    long = speech_in(25.0)  # 334 positions: two steps at a 256-position budget, one at 512
    assert predict_ttfa_s(busy(prefill_token_budget=256), work=long) == pytest.approx(
        predict_ttfa_s(busy(prefill_token_budget=512), work=long) + STEP_S
    )
    assert predict_ttfa_s(busy(prefill_token_budget=512), work=long) == pytest.approx(predict_ttfa_s(busy(), work=long))
    assert predict_ttfa_s(busy(prefill_token_budget=256), work=TTS) == pytest.approx(predict_ttfa_s(busy(), work=TTS))


def test_the_front_end_is_charged_only_where_the_replica_runs_it():
    """A whole clip's log-mel is computed on the replica when it is added; a streamed turn's came with it
    (the Router computed it as the audio arrived: `Job.audio_features`), so only its encoder is charged."""
    from core.messages import AudioFeatures

    job = build_job(StepAudio2Adapter, text="", audio=clip(10.0))
    whole = prompt_work(StepAudio2Adapter, job)
    streamed = prompt_work(StepAudio2Adapter, replace(job, audio_features=AudioFeatures("log-mel-128", ())))
    assert whole.front_end_audio_s == pytest.approx(10.0) and streamed.front_end_audio_s == 0.0
    load = busy(front_end_s_per_audio_s=0.01)
    assert predict_ttfa_s(load, work=whole) == pytest.approx(predict_ttfa_s(load, work=streamed) + 10.0 * 0.01)


def test_a_conversations_earlier_turns_are_charged_as_they_are_prefilled_again():
    """Every turn of a conversation is prefilled again (no KV kept across turns): its earlier clips'
    positions, encode and front end and its earlier text count beside the last turn's."""
    history = (ChatTurn("user", "First question.", clip(10.0)), ChatTurn("assistant", "A first answer, spoken."))
    alone = speech_in(2.0)
    job = build_job(StepAudio2Adapter, text="", audio=clip(2.0), history=history)
    conversation = prompt_work(StepAudio2Adapter, job)
    assert conversation.audio_s == pytest.approx(12.0) and conversation.front_end_audio_s == pytest.approx(12.0)
    earlier_positions = StepAudio2Adapter.audio_prompt_positions(10.0)
    assert conversation.num_positions >= alone.num_positions + earlier_positions
    assert start_to_first_output_s(busy(), conversation) > start_to_first_output_s(busy(), alone)


def test_prompts_waiting_to_prefill_there_hold_back_a_request_starting_now():
    """A replica with 4000 positions waiting to prefill (a burst of long clips): one starting now is
    prefilled after them, at the pace and over the steps the budget spreads them over; the router ranks
    the replica without that queue first. One that waits for a slot anyway is charged as before."""
    queued = busy(queued_prefill_positions=4000, prefill_token_budget=512)
    clear = busy(prefill_token_budget=512)
    behind_s = 4000 / 2000.0 + (4000 // 512) * STEP_S
    assert predict_ttfa_s(queued, work=TTS) == pytest.approx(predict_ttfa_s(clear, work=TTS) + behind_s)
    assert best_predicted_ttfa_s([queued, clear], work=TTS) == pytest.approx(predict_ttfa_s(clear, work=TTS))
    unmeasured = busy(queued_prefill_positions=4000, prefill_tokens_per_s=0.0)  # no pace, no budget: nothing
    assert predict_ttfa_s(unmeasured) == pytest.approx(predict_ttfa_s(busy(prefill_tokens_per_s=0.0)))
    measured = replace(queued, measured_ttfa_s=0.3)  # the queue is measured work, no transient: credible
    assert credible_ttfa_s(measured, TTS) == pytest.approx(predict_ttfa_s(queued, work=TTS))
    full = dict(num_active=16, ends_in_s=(3.0,))  # past its stream limit: it waits for a slot first
    assert predict_ttfa_s(replace(queued, **full)) == pytest.approx(predict_ttfa_s(replace(clear, **full)))


def test_a_turn_tokenized_as_it_came_is_charged_its_positions_and_no_encoder():
    from llm_stage.models.glm4_voice import Glm4VoiceAdapter

    job = build_job(Glm4VoiceAdapter, text="", audio=clip(8.0))
    whole, streamed = (
        prompt_work(Glm4VoiceAdapter, job),
        prompt_work(Glm4VoiceAdapter, replace(job, audio_tokens=(1,) * 100)),
    )
    assert whole.audio_s == whole.front_end_audio_s == pytest.approx(8.0)
    assert streamed.audio_s == streamed.front_end_audio_s == 0.0 and streamed.num_positions == whole.num_positions


def test_a_replica_that_kept_the_conversations_last_prompt_is_charged_only_the_new_turn():
    work = PromptWork(num_positions=900, audio_s=30.0, front_end_audio_s=30.0, earlier_key="conv-1",
                      earlier_positions=800, earlier_audio_s=27.0)  # fmt: skip
    kept, other = busy(kept_prompt_keys=("conv-0", "conv-1")), busy()
    assert kept.work_here(work) == PromptWork(100, pytest.approx(3.0), False, pytest.approx(3.0))
    assert other.work_here(work) is work and kept.work_here(None) is None
    assert predict_ttfa_s(kept, work=kept.work_here(work)) < predict_ttfa_s(other, work=work)
    assert best_predicted_ttfa_s([other, kept], work=work) == pytest.approx(credible_ttfa_s(kept, work))
    assert credible_ttfa_s(kept, work) == pytest.approx(predict_ttfa_s(kept, work=kept.work_here(work)))
