"""A stream resumed on a fresh LLM side from a checkpoint (what the router does when the LLM
replica serving it dies) emits the same tokens and the same chunks as an uninterrupted run:
greedy and seeded, with and without CFG, for single- and multi-codebook families."""

from __future__ import annotations

import dataclasses

import pytest

from core.config import CacheConfig, EngineConfig, ModelConfig
from core.errors import InvalidArgumentError
from core.messages import Checkpoint, Job, ResumeState, TextPiece, TokenChunk
from llm_stage.engine import LLMEngine
from llm_stage.jobs import build_job
from llm_stage.side import LLMSide
from llm_stage.wiring import build_llm_side


def _side(model: str, layout: str = "slot") -> LLMSide:
    cache = CacheConfig(layout=layout, block_size=4)  # (block_size: the paged layout's)
    return build_llm_side(EngineConfig(model=ModelConfig(name=model), cache=cache))


def _job(side: LLMSide, text: str, sampling: dict, resume: ResumeState | None = None) -> Job:
    job = build_job(side.engine.adapter, text=text, voice=None, sampling=sampling)
    return Job(**{**job.__dict__, "req_id": "r", "resume": resume})


def _run(side: LLMSide, job: Job) -> list[tuple[TokenChunk, Checkpoint | None]]:
    """Every chunk of the stream, with the checkpoint shipped alongside it."""
    side.add(job)
    out = []
    while side.engine.has_work:
        chunks = side.step()
        checkpoints = side.take_checkpoints()
        out += [(c, checkpoints.get((c.req_id, c.seq))) for c in chunks]
    return out


def _state_after(run: list[tuple[TokenChunk, Checkpoint | None]], seq: int) -> ResumeState:
    """What the router knows once chunk `seq` reached the client (as `router.resume` adds it up)."""
    tokens: list = []
    for _chunk, checkpoint in run[: seq + 1]:
        if checkpoint is not None:
            assert checkpoint.first_index == len(tokens)
            tokens += checkpoint.new_tokens
    return ResumeState(tuple(tokens), seq + 1, run[seq][0].keep_end)


def _layout(run: list[tuple[TokenChunk, Checkpoint | None]]) -> list[tuple]:
    """The chunks without their wall-clock stamps."""
    return [(c.seq, c.frames, c.window_start, c.keep_start, c.keep_end, c.is_final) for c, _ in run]


CASES = [
    ("orpheus-tiny", {"temperature": 0.0, "max_tokens": 7 * 30}),
    ("orpheus-tiny", {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 7 * 30}),
    ("csm-tiny", {"temperature": 0.8, "seed": 3, "max_tokens": 40}),
    ("dia-tiny", {"temperature": 0.0, "top_k": 0, "max_tokens": 40, "guidance_scale": 3.0}),
    ("parallel-heads-tiny", {"temperature": 0.9, "seed": 11, "max_tokens": 40, "guidance_scale": 2.0}),
    ("qwen3-tts-tiny", {"temperature": 0.9, "seed": 4, "max_tokens": 40}),
]


@pytest.mark.parametrize(("model", "sampling"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_resumed_stream_continues_with_the_uninterrupted_chunks(model: str, sampling: dict):
    side = _side(model)
    reference = _run(side, _job(side, "resume me where I stopped", sampling))
    assert len(reference) >= 4, "the stream must be long enough to resume mid-way"
    for lost_after in (0, len(reference) // 2):
        state = _state_after(reference, lost_after)
        assert state.tokens, "the checkpoint must carry tokens"
        fresh = _side(model)  # another replica: same weights, nothing of this stream
        resumed = _run(fresh, _job(fresh, "resume me where I stopped", sampling, state))
        assert _layout(resumed) == _layout(reference[lost_after + 1 :])


def test_seeded_resume_continues_from_the_tokens_alone_and_another_seed_does_not():
    """Draws are keyed by (seed, tokens drawn): the tokens are the whole state a resume needs, and
    the seed is what keys them (the same tokens under another seed go on differently)."""
    side = _side("orpheus-tiny")
    sampling = {"temperature": 1.0, "seed": 5, "max_tokens": 7 * 30}
    reference = _run(side, _job(side, "the seed matters", sampling))
    state = _state_after(reference, 1)
    resumed = _run(_side("orpheus-tiny"), _job(side, "the seed matters", sampling, state))
    assert [c.frames for c, _ in resumed] == [c.frames for c, _ in reference[2:]]
    reseeded = _run(_side("orpheus-tiny"), _job(side, "the seed matters", {**sampling, "seed": 6}, state))
    assert [c.frames for c, _ in reseeded] != [c.frames for c, _ in reference[2:]]


def test_resume_that_overflows_the_context_is_refused():
    side = _side("orpheus-tiny")
    max_seq_len = side.engine.cache_config.max_seq_len
    state = ResumeState((0,) * max_seq_len, 1, 4)
    with pytest.raises(Exception, match="context holds"):
        side.add(_job(side, "too long", {"max_tokens": 10}, state))
    assert isinstance(side.engine, LLMEngine) and "r" not in side.chunkers


MIGRATION_CASES = [
    ("orpheus-tiny", {"temperature": 0.0, "max_tokens": 7 * 30}),
    ("orpheus-tiny", {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 7 * 30}),
    ("parallel-heads-tiny", {"temperature": 0.0, "max_tokens": 40, "guidance_scale": 2.0}),
    ("parallel-heads-tiny", {"temperature": 0.9, "seed": 11, "max_tokens": 40, "guidance_scale": 2.0}),
    ("csm-tiny", {"temperature": 0.8, "seed": 3, "max_tokens": 40}),
]


@pytest.mark.parametrize(
    ("model", "sampling"), MIGRATION_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(MIGRATION_CASES)]
)
def test_kv_migration_mid_stream_gives_the_uninterrupted_chunks(model: str, sampling: dict):
    """The stream leaves one engine with its KV rows (and its CFG twin's) and sampler state; the
    other engine decodes at once, no prefill, and cuts exactly the chunks of an uninterrupted run."""
    text = "move me to another replica"
    source = _side(model)
    reference = _run(source, _job(source, text, sampling))
    source = _side(model)
    source.add(_job(source, text, sampling))
    before: list[TokenChunk] = []
    while len(before) < 2:
        before += source.step()
    state, kv = source.move_out("r")
    assert kv is not None and "r" not in source.engine.requests and source.engine.scheduler.slots.num_used == 0
    target = _side(model)
    target.add(_job(target, text, sampling, state), kv)
    req = target.engine.requests["r"]
    assert req.status.value == "decoding" and all(row.num_cached == row.num_known - 1 for row in req.unit)
    assert _layout([(c, None) for c in before + _drain(target)]) == _layout(reference)


@pytest.mark.parametrize(("source_layout", "target_layout"), [("paged", "slot"), ("slot", "paged")])
def test_kv_moves_between_the_slot_and_the_paged_layout(source_layout: str, target_layout: str):
    """A guided stream (its CFG twin's rows too) moves from a paged cache to a slot cache and back:
    the uninterrupted run's chunks, and the source's blocks all free once it left."""
    model, sampling = "parallel-heads-tiny", {"temperature": 0.9, "seed": 11, "max_tokens": 40, "guidance_scale": 2.0}
    text = "move me to another replica"
    reference = _run(_side(model), _job(_side(model), text, sampling))
    source = _side(model, source_layout)
    source.add(_job(source, text, sampling))
    before: list[TokenChunk] = []
    while len(before) < 2:
        before += source.step()
    state, kv = source.move_out("r")
    blocks = source.engine.scheduler.blocks
    assert kv is not None and (blocks is None or blocks.num_free == blocks.num_blocks)
    target = _side(model, target_layout)
    target.add(_job(target, text, sampling, state), kv)
    assert target.engine.requests["r"].status.value == "decoding"
    assert _layout([(c, None) for c in before + _drain(target)]) == _layout(reference)


def _drain(side: LLMSide) -> list[TokenChunk]:
    chunks: list[TokenChunk] = []
    while side.engine.has_work:
        chunks += side.step()
    return chunks


def test_kv_that_does_not_fit_is_prefilled_again():
    """A snapshot whose rows do not match the request (or no free slot) falls back to re-prefill."""
    source = _side("orpheus-tiny")
    sampling = {"temperature": 0.0, "max_tokens": 7 * 30}
    reference = _run(source, _job(source, "fallback", sampling))
    source = _side("orpheus-tiny")
    source.add(_job(source, "fallback", sampling))
    before: list[TokenChunk] = []
    while len(before) < 2:
        before += source.step()
    state, kv = source.move_out("r")
    short = type(kv)(tuple(k[:, :, :-1] for k in kv.keys), tuple(v[:, :, :-1] for v in kv.values))
    target = _side("orpheus-tiny")
    target.add(_job(target, "fallback", sampling, state), short)
    assert target.engine.requests["r"].status.value == "waiting"
    assert _layout([(c, None) for c in before + _drain(target)]) == _layout(reference)


# ---- streamed text (native text streaming): the text the lost replica had got is replayed ----------

STREAMED_TEXT = [
    TextPiece("r", "", " where I"),
    TextPiece("r", "", " stopped", flush=True),
    TextPiece("r", "", ".", end=True),
]


def _run_streamed(side: LLMSide, job: Job, pieces: list[TextPiece]) -> list[tuple[TokenChunk, Checkpoint | None]]:
    """`_run` for a streamed-text job, its pieces pushed one per few steps (it waits for text between)."""
    side.add(job)
    out, step = [], 0
    while side.engine.has_work or pieces:
        if pieces and step % 3 == 0:
            assert side.push_text(pieces.pop(0))
        chunks = side.step()
        checkpoints = side.take_checkpoints()
        out += [(c, checkpoints.get((c.req_id, c.seq))) for c in chunks]
        step += 1
        assert step < 500, "the stream never ended (text it read never came)"
    return out


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0, "max_tokens": 40}, {"temperature": 0.9, "seed": 4, "max_tokens": 40}]
)
def test_a_streamed_text_stream_resumes_with_the_text_it_was_sent_replayed(sampling: dict):
    side = _side("qwen3-tts-tiny")
    job = dataclasses.replace(_job(side, "resume me", sampling), text_streaming=True)
    reference = _run_streamed(side, job, list(STREAMED_TEXT))
    assert len(reference) >= 4, "the stream must be long enough to resume mid-way"
    state = _state_after(reference, len(reference) // 2)
    for num_replayed in (len(STREAMED_TEXT), 1):  # the rest is sent to the new replica as it comes
        fresh = _side("qwen3-tts-tiny")
        replayed = dataclasses.replace(state, text_pieces=tuple(STREAMED_TEXT[:num_replayed]))
        resumed = _run_streamed(fresh, dataclasses.replace(job, resume=replayed), list(STREAMED_TEXT[num_replayed:]))
        assert _layout(resumed) == _layout(reference[len(reference) // 2 + 1 :])


def test_a_family_that_lays_text_out_as_it_comes_refuses_to_resume_streamed_text():
    side = _side("cosyvoice2-tiny")
    job = dataclasses.replace(_job(side, "resume me", {"max_tokens": 20}), text_streaming=True)
    with pytest.raises(InvalidArgumentError) as err:
        side.add(dataclasses.replace(job, resume=ResumeState((), 0, 0)))
    assert err.value.field == "text_streaming"


# ---- speech in: the answer's text across a resume ---------------------------------------------------


def _speech_in_job(side: LLMSide, text_only: bool, resume: ResumeState | None = None) -> Job:
    import numpy as np

    from core.messages import AudioClip

    t = np.arange(16_000) / 16_000
    clip = AudioClip((0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes(), 16_000)
    text = "" if side.engine.adapter.family == "glm4-voice" else "Answer."  # (prompts whose answers have text)
    job = build_job(side.engine.adapter, text=text, audio=clip, text_only=text_only,
                    sampling={"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 60})  # fmt: skip
    return dataclasses.replace(job, req_id="r", resume=resume)


def _events(side: LLMSide, job: Job, stop_after: int | None = None) -> list:
    """The stream's chunks and text deltas (with their checkpoints) in step order, until its end or its
    `stop_after`-th event (then, as a lost replica, nothing more)."""
    side.add(job)
    events: list = []
    while side.engine.has_work:
        chunks = side.step()
        checkpoints = side.take_checkpoints()
        events += [(c, checkpoints.get((c.req_id, c.seq))) for c in chunks]
        events += [(delta, delta.checkpoint) for delta in side.take_text()]
        if stop_after is not None and len(events) >= stop_after:
            return events[:stop_after]
    return events


@pytest.mark.parametrize("model", ["step-audio2-tiny", "glm4-voice-tiny"])
@pytest.mark.parametrize("text_only", [True, False])
def test_a_resumed_answer_goes_on_after_the_text_sent_saying_none_twice(model: str, text_only: bool):
    """The Router adds up the checkpoints of the chunks and the text that reached the client
    (`router.resume`); a stream resumed from them (seeded) says the rest of the uninterrupted text,
    none of it twice (its text deltas carried no checkpoint before: a spoken answer repeated the text
    after its last chunk, and a text-only answer could not resume)."""
    from core.messages import TextDelta
    from router.resume import StreamProgress

    whole = _events(_side(model), _speech_in_job(_side(model), text_only))
    text = "".join(e.text for e, _ in whole if isinstance(e, TextDelta))
    assert text and len(whole) >= 3
    lost = _events(_side(model), _speech_in_job(_side(model), text_only), stop_after=len(whole) // 2)
    progress = StreamProgress()
    for event, checkpoint in lost:
        if isinstance(event, TextDelta):
            progress.record_text(event)
        else:
            progress._extend(checkpoint)
            progress.next_seq, progress.frames_shipped = event.seq + 1, event.keep_end
    said = "".join(e.text for e, _ in lost if isinstance(e, TextDelta))
    resumed = _side(model)
    rest = _events(resumed, _speech_in_job(resumed, text_only, progress.resume_state()))
    assert said + "".join(e.text for e, _ in rest if isinstance(e, TextDelta)) == text
