"""Qwen3-TTS native text streaming against the reference's streaming-text generation
(`generate(non_streaming_mode=False)` of qwen-tts, golden `streaming_frames` written by
tests/data/make_qwen3_tts_golden.py): the same greedy frames whatever the pieces and their timing,
while the request waits for text holding its KV slot but no batch row, beside other streams."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from core.config import CacheConfig, DetokConfig, ModelConfig, SchedulerConfig
from core.errors import InvalidArgumentError
from core.messages import Job, SamplingParams, TextPiece
from llm_stage.chunking import ChunkSchedule
from llm_stage.engine import LLMEngine
from llm_stage.models.qwen3_tts import PresetChatTokenizer, Qwen3TTSAdapter, load_qwen3_tts
from llm_stage.side import LLMSide
from llm_stage.text_feed import TextFeed, last_word_start, split_last_word
from tests.factories import STEP_MODES

DATA = Path(__file__).resolve().parents[1] / "data" / "qwen3_tts"
CONFIG = ModelConfig(name="qwen3-tts", checkpoint_dir=DATA / "checkpoint")
MAX_FRAMES = 13
PENALTY = 1.3  # the golden script's repetition_penalty
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=PENALTY, max_tokens=MAX_FRAMES)


@functools.cache
def golden() -> dict:
    return json.loads((DATA / "golden.json").read_text())


@functools.cache
def adapter() -> Qwen3TTSAdapter:
    return Qwen3TTSAdapter(load_qwen3_tts(CONFIG), PresetChatTokenizer())


def as_text(ids: list[int]) -> str:
    """Golden text ids as a string the test feed maps back one character per id."""
    return "".join(chr(i) for i in ids)


def engine(async_steps: bool = False, slots: int = 4) -> LLMEngine:
    return LLMEngine(
        adapter(), CacheConfig(num_slots=slots, max_seq_len=64),
        SchedulerConfig(max_batch_size=slots, prefill_token_budget=16, async_steps=async_steps),
    )  # fmt: skip


def add_streaming(eng: LLMEngine, req_id: str, case: dict, first_ids: list[int]) -> None:
    prompt = adapter().streaming_talker_prompt(case["role_ids"], adapter().codec_prefix(case["speaker"]))
    spec = adapter().spec
    feed = TextFeed(lambda text, final: ([ord(c) for c in text], ""), (spec.tts_eos_id,), spec.tts_pad_id)
    feed.first_position = len(prompt) - 1
    feed.push(as_text(first_ids))
    eng.add_prompt(req_id, prompt, GREEDY, text_feed=feed)


def run(eng: LLMEngine, feeds: dict[str, list[tuple[int, list[int], bool]]], max_steps: int = 200) -> dict:
    """Step `eng`; at step s, push each (s, ids, end) of `feeds[req_id]`; collect frames and the
    steps at which a stream waited for text (its slot kept, no row in the batch)."""
    frames: dict[str, list] = {req_id: [] for req_id in feeds}
    waited: dict[str, int] = dict.fromkeys(feeds, 0)
    for step in range(max_steps):
        for req_id, pushes in feeds.items():
            for at_step, ids, end in pushes:
                if at_step == step:
                    eng.push_text(req_id, as_text(ids), end=end)
        for req_id in feeds:
            req = eng.requests.get(req_id)
            if req is not None and req.is_waiting_for_text:
                waited[req_id] += 1
                assert req.slot is not None or req.num_cached == 0
        for out in eng.step():
            frames[out.req_id].extend(out.new_frames)
        if step > max(s for pushes in feeds.values() for s, _, _ in pushes) and not eng.scheduler.has_requests:
            break
    return {"frames": frames, "waited": waited}


@pytest.mark.parametrize(("async_steps", "kv_layout"), STEP_MODES, indirect=["kv_layout"])
def test_text_arriving_late_gives_the_reference_streaming_frames(async_steps, kv_layout):
    """Every case's text in pieces: the first id opens the stream, later ids come one every 3 steps
    (slower than frames), so each stream waits for text again and again."""
    eng = engine(async_steps)
    feeds = {}
    for index, case in enumerate(golden()["cases"]):
        req_id, ids = f"c{index}", case["text_ids"]
        add_streaming(eng, req_id, case, ids[:1])
        rest = ids[1:]
        feeds[req_id] = [(3 * (k + 1), [i], False) for k, i in enumerate(rest)] + [(3 * (len(rest) + 1), [], True)]
    result = run(eng, feeds)
    expected = {f"c{i}": case["streaming_frames"] for i, case in enumerate(golden()["cases"])}
    assert result["frames"] == expected
    assert result["waited"]["c0"] > 10  # 11 text ids at a third of the frame rate


@pytest.mark.parametrize("async_steps", [False, True])
def test_whole_text_up_front_and_ragged_pieces_agree(async_steps):
    cases = golden()["cases"]
    eng = engine(async_steps)
    add_streaming(eng, "whole", cases[0], cases[0]["text_ids"])
    add_streaming(eng, "ragged", cases[0], cases[0]["text_ids"][:3])
    ids = cases[0]["text_ids"]
    feeds = {"whole": [(0, [], True)], "ragged": [(5, ids[3:4], False), (6, ids[4:9], False), (20, ids[9:], True)]}
    result = run(eng, feeds)
    assert result["frames"]["whole"] == result["frames"]["ragged"] == cases[0]["streaming_frames"]
    assert result["waited"]["whole"] == 0 and result["waited"]["ragged"] > 0


def test_a_stream_waiting_for_text_holds_its_slot_and_no_batch_row_beside_a_running_one():
    cases = golden()["cases"]
    eng = engine(slots=2)
    add_streaming(eng, "idle", cases[0], cases[0]["text_ids"][:1])
    prefix = adapter().codec_prefix(cases[0]["speaker"])
    whole = adapter().talker_prompt(cases[0]["role_ids"], cases[0]["text_ids"], prefix)
    eng.add_prompt("whole", whole, GREEDY)
    frames: dict[str, list] = {"idle": [], "whole": []}

    def step() -> None:
        for out in eng.step():
            frames[out.req_id] += out.new_frames

    for _ in range(6):  # prompts in, then "idle" waits for its second text id
        step()
    idle = eng.requests["idle"]
    assert idle.is_waiting_for_text and idle.slot is not None
    assert eng.scheduler.num_waiting_for_text == 1 and eng.last_batch_size == 1
    while eng.has_work:
        step()
    assert frames["whole"] == cases[0]["frames"]  # the non-streaming stream ran unchanged beside it
    assert not eng.has_work and eng.scheduler.has_requests  # only text can wake the engine now
    assert len(frames["idle"]) == 1  # its first frame came with the prompt; the next one needs text
    eng.push_text("idle", as_text(cases[0]["text_ids"][1:]), end=True)
    while eng.has_work:
        step()
    assert frames["idle"] == cases[0]["streaming_frames"]


def test_the_side_counts_text_that_ends_a_wait():
    """`LLMSide.num_text_waits` (the `text_waits` stat): text that came while its stream was
    waiting for it counts; text that came while it still had some does not."""
    cases = golden()["cases"]
    side = LLMSide(engine(), ChunkSchedule.from_config(DetokConfig()))
    add_streaming(side.engine, "s", cases[0], cases[0]["text_ids"][:1])
    assert side.push_text(TextPiece("s", "here", as_text(cases[0]["text_ids"][1:2])))
    assert side.num_text_waits == 0  # not computed up to its text yet
    while side.engine.has_work:
        side.engine.step()
    assert side.engine.requests["s"].is_waiting_for_text
    assert side.push_text(TextPiece("s", "here", as_text(cases[0]["text_ids"][2:]), end=True))
    assert side.num_text_waits == 1 and not side.push_text(TextPiece("gone", "here", "x"))


def test_push_text_refuses_what_it_cannot_take():
    eng = engine()
    case = golden()["cases"][2]
    prefix = adapter().codec_prefix(case["speaker"])
    eng.add_prompt("whole", adapter().talker_prompt(case["role_ids"], case["text_ids"], prefix), GREEDY)
    with pytest.raises(InvalidArgumentError) as err:
        eng.push_text("whole", "more")
    assert err.value.field == "text"
    add_streaming(eng, "s", case, case["text_ids"])
    assert eng.push_text("s", end=True)
    with pytest.raises(InvalidArgumentError, match="already ended"):
        eng.push_text("s", "late")
    assert not eng.push_text("nobody", "x")


def test_streaming_job_through_add_job_reads_the_preset_tokenizer():
    """The whole path from a Job: byte ids of the pieces, the same frames as all the text at once."""
    eng = engine()
    job = Job("a", "Hello", "ryan", GREEDY, 1.0, text_streaming=True)
    eng.add_job(job)
    eng.add_job(Job("b", "Hello there.", "ryan", GREEDY, 1.0, text_streaming=True))
    eng.push_text("b", end=True)
    got: dict[str, list] = {"a": [], "b": []}
    for step in range(80):
        if step == 4:
            eng.push_text("a", " there.", end=True)
        for out in eng.step():
            got[out.req_id] += out.new_frames
        if step > 4 and not eng.scheduler.has_requests:
            break
    assert got["a"] == got["b"] and got["a"]
    with pytest.raises(InvalidArgumentError) as err:
        eng.add_job(Job("c", "Hi", "ryan", SamplingParams(guidance_scale=2.0), 1.0, text_streaming=True))
    assert err.value.field == "sampling.guidance_scale"


def test_split_last_word_holds_back_what_may_still_merge():
    words = {"Hello": 1, " wor": 2, " world": 3, "ld": 4, "!": 5, "o": 6}

    def encode(text: str) -> list[int]:  # greedy longest match over `words`
        ids, at = [], 0
        while at < len(text):
            piece = max((w for w in words if text.startswith(w, at)), key=len)
            ids.append(words[piece])
            at += len(piece)
        return ids

    feed = TextFeed(split_last_word(encode), (9,), 8)
    assert feed.push("Hello") == 0 and feed.push(" wor") == 1  # "Hello" final, " wor" may grow
    assert feed.push("ld") == 0 and feed.held_text == " world"
    assert feed.push("!") == 1 and feed.ids == [1, 3]
    feed.end()
    assert [feed.at(i) for i in range(5)] == [1, 3, 5, 9, 8]


def test_last_word_start_is_the_last_pre_token_break_the_text_shows():
    assert last_word_start("Hello") == 0 and last_word_start("Hello wor") == 5
    assert last_word_start("friend.") == 6 and last_word_start("friend. ") == 7  # "." may still grow: "..."
    assert last_word_start("in 12") == 4  # digits are single pre-tokens
    assert last_word_start("\u4f60\u597d\uff0c\u4e16") == 3  # CJK: a letter run, punctuation, a letter run


def test_a_streaming_text_request_is_not_moved_out_its_text_comes_here():
    from core.config import EngineConfig
    from llm_stage.wiring import build_llm_side

    side = build_llm_side(EngineConfig(model=ModelConfig(name="qwen3-tts-tiny")))
    side.add(Job("s", "Hello", "ryan", GREEDY, 1.0, text_streaming=True))
    side.add(Job("w", "Hello", "ryan", GREEDY, 1.0))
    for _ in range(3):
        side.step()
    assert side.move_out("s") is None and "s" in side.engine.requests
    assert side.move_out("w") is not None and "w" not in side.engine.requests


@pytest.mark.parametrize(
    "pieces", [["hello world"], ["he", "llo", " w", "or", "ld"], ["h", "e", "l", "l", "o", " ", "t"]]
)
def test_bpe_pieces_tokenize_as_the_whole_text_does(tmp_path, pieces):
    """The checkpoint's byte-level BPE (Qwen2 style): however the text is cut, the feed's ids are the
    ones the whole text gets (merges across pieces are kept)."""
    from llm_stage.models.qwen3_tts import QwenChatTokenizer
    from tests.published_layouts import qwen_tokenizer_files

    qwen_tokenizer_files(tmp_path)
    tokenizer = QwenChatTokenizer(tmp_path)
    feed = TextFeed(tokenizer.text_splitter(), (5,), 3)
    for piece in pieces:
        feed.push(piece)
    feed.end()
    whole = tokenizer.tokenizer.encode("".join(pieces))
    assert feed.ids == whole and feed.held_text == "" and len(whole) < len("".join(pieces))  # merges happened
