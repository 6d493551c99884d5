"""The Router's audio fetches: one object per detokenizer call holds the audio of every chunk
an engine step cut (all streams), so the streams of that step share one fetch here instead of
one object-store round trip per chunk. Recent objects are kept by handle; a miss fetches again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import ray

from core.messages import AudioChunk, AudioRef

# Steps whose audio stays here: the streams of one step read their chunks within milliseconds of
# each other, so a few dozen steps cover them (an evicted step is only fetched again).
KEPT_STEPS = 32


class StepAudio:
    def __init__(self, kept_steps: int = KEPT_STEPS) -> None:
        self.kept_steps = kept_steps
        self._steps: OrderedDict[object, asyncio.Future] = OrderedDict()  # handle -> its list[AudioChunk]
        self.num_fetches = 0  # object-store reads (one per step and router, plus misses)
        self.num_chunks = 0  # chunks served

    async def get(self, ref: AudioRef) -> AudioChunk:
        """`ref`'s audio; an error of the fetch (e.g. ObjectLostError) is raised to every reader."""
        key = _key(ref.handle)
        step = self._steps.get(key)
        if step is None:
            step = asyncio.ensure_future(self._fetch(ref.handle))
            self._steps[key] = step
            while len(self._steps) > self.kept_steps:
                self._steps.popitem(last=False)
        try:
            audio = (await asyncio.shield(step))[ref.index]
        except Exception:
            if self._steps.get(key) is step:  # a failed fetch is not kept
                del self._steps[key]
            raise
        self.num_chunks += 1
        return audio

    async def _fetch(self, handle) -> list[AudioChunk]:
        self.num_fetches += 1
        return await handle


def _key(handle) -> object:
    """An object ref by its id: the cache must not keep the object alive in the detok's store."""
    return handle.binary() if isinstance(handle, ray.ObjectRef) else handle
