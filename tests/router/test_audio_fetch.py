"""The Router's step-audio fetches: the streams of one engine step share one object-store read."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from ray.exceptions import ObjectLostError

from core.messages import AudioChunk, AudioRef, TokenChunk
from router.audio_fetch import StepAudio
from router.streams import RouterCore


class _Handle:
    """Stands in for an ObjectRef to a step's audio list: counts the reads, can fail them."""

    def __init__(self, audio: list[AudioChunk], error: Exception | None = None) -> None:
        self.audio, self.error, self.num_reads = audio, error, 0

    def __await__(self):
        self.num_reads += 1
        yield from asyncio.sleep(0.01).__await__()
        if self.error is not None:
            raise self.error
        return self.audio


def _step(req_ids: list[str], error: Exception | None = None) -> tuple[_Handle, list[AudioRef]]:
    audio = [AudioChunk(rid, 0, bytes([i]) * 4, 24_000, False) for i, rid in enumerate(req_ids)]
    handle = _Handle(audio, error)
    chunk = TokenChunk("x", 0, [[0] * 7], 0, 0, 1, False)
    return handle, [AudioRef(a.req_id, 0, False, a.duration_s, 1, handle, chunk, i) for i, a in enumerate(audio)]


def test_streams_of_one_step_share_one_read_and_get_their_own_chunk():
    async def run() -> None:
        fetch = StepAudio()
        handle, refs = _step(["a", "b", "c"])
        audio = await asyncio.gather(*(fetch.get(ref) for ref in refs))
        assert [a.req_id for a in audio] == ["a", "b", "c"]
        assert handle.num_reads == 1 and fetch.num_fetches == 1 and fetch.num_chunks == 3

    asyncio.run(run())


def test_an_evicted_step_is_read_again_and_a_failed_read_is_not_kept():
    async def run() -> None:
        fetch = StepAudio(kept_steps=1)
        first, [a, _] = _step(["a", "b"])
        assert (await fetch.get(a)).req_id == "a"
        second, [c] = _step(["c"])
        await fetch.get(c)  # evicts the first step
        assert (await fetch.get(a)).req_id == "a" and first.num_reads == 2
        lost, [d] = _step(["d"], error=LookupError("object lost"))
        for _ in range(2):  # each reader sees the error; the next one reads again
            with pytest.raises(LookupError):
                await fetch.get(d)
        assert lost.num_reads == 2

    asyncio.run(run())


def test_a_reader_cancelled_mid_read_leaves_the_read_to_the_others():
    async def run() -> None:
        fetch = StepAudio()
        handle, [a, b] = _step(["a", "b"])
        first = asyncio.ensure_future(fetch.get(a))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(fetch.get(b))
        first.cancel()
        assert (await second).req_id == "b" and handle.num_reads == 1

    asyncio.run(run())


def test_a_lost_chunks_audio_is_decoded_again_on_its_own():
    """The Router lost a chunk's audio while its stream goes on: the chunk goes back to the detok stage marked
    `redo`, so the replica decoding the stream's later chunks decodes it apart from them
    (`DetokEngine.submit`; the engine side is tested in test_qwen3_tts_codec)."""
    chunk = TokenChunk("r", 3, [[1, 2]], 0, 0, 1, False)
    audio = AudioChunk("r", 3, b"\x00\x00", 24000, False)
    sent: list[list[TokenChunk]] = []

    class LostStore:
        async def get(self, ref):
            raise ObjectLostError("00" * 28, None, "")

    async def decode_batch(chunks):
        sent.append(chunks)

        async def handle():
            return [audio]

        return [SimpleNamespace(handle=handle(), index=0)]

    core = object.__new__(RouterCore)
    core.step_audio, core.detok = LostStore(), SimpleNamespace(decode_batch=SimpleNamespace(remote=decode_batch))
    event = SimpleNamespace(ref=AudioRef("r", 3, False, 0.08, 1, None, chunk))
    assert asyncio.run(core._fetch(event)) is audio
    [[redone]] = sent
    assert redone.redo and dataclasses.replace(redone, redo=False) == chunk
