"""What Ray itself costs per audio chunk on the cluster's data path, in CPU milliseconds per chunk
of each process (CPU time, so a box shared with other work skews it less than wall time).

Three plain Ray actors stand in for the stages, without engines: `Detok` puts each chunk's audio
(PCM16 of `--frames` codec frames) in its object store and answers a batch call with the refs;
`LLM` sends one batch call per step of `--streams` chunks and yields each stream's events;
the driver, as the Router, reads the events and fetches the audio. Variants: `per-chunk` (an
object per chunk, one await per ref: as today), `per-step` (an object per chunk, one `ray.get` of
a step's refs), `step-object` (one object per step holding every chunk's audio, fetched once by
the Router and shared by the streams), and `inline` (the audio inside the event: the two-hop
path, for reference).
Usage: python -m loadtest.chunk_path_bench --steps 300 --streams 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import ray

from core.messages import AudioChunk, AudioRef, TokenChunk

SAMPLES_PER_FRAME = 2048  # orpheus-tiny's codec (SNAC, 24 kHz)
VARIANTS = ("per-chunk", "per-step", "step-object", "inline")


def audio_chunk(req_id: str, seq: int, num_frames: int) -> AudioChunk:
    return AudioChunk(req_id, seq, bytes(2 * SAMPLES_PER_FRAME * num_frames), 24_000, False, "", num_frames)


def token_chunk(req_id: str, seq: int, num_frames: int) -> TokenChunk:
    frames = [[seq % 4096 + k for k in range(7)] for _ in range(num_frames + 3)]
    return TokenChunk(req_id, seq, frames, 0, 3, 3 + num_frames, False)


@ray.remote(num_cpus=0)
class Detok:
    def decode_batch(self, chunks: list[TokenChunk], variant: str) -> list:
        audios = [audio_chunk(c.req_id, c.seq, c.keep_end - c.keep_start) for c in chunks]
        if variant == "inline":
            return audios
        step = ray.put(audios) if variant == "step-object" else None
        return [(index, AudioRef(c.req_id, c.seq, False, a.duration_s, a.num_frames, step or ray.put(a), c))
                for index, (c, a) in enumerate(zip(chunks, audios, strict=True))]  # fmt: skip

    def cpu_s(self) -> float:
        return time.process_time()


@ray.remote(num_cpus=0)
class LLM:
    def __init__(self, detok) -> None:
        self.detok = detok

    async def run(self, steps: int, streams: int, frames: int, variant: str):
        """Yields each step's events, one per stream (a stand-in for the per-stream generators)."""
        for step in range(steps):
            chunks = [token_chunk(f"s{i}", step, frames) for i in range(streams)]
            for event in await self.detok.decode_batch.remote(chunks, variant):
                yield event

    def cpu_s(self) -> float:
        return time.process_time()


async def route(llm, steps: int, streams: int, frames: int, variant: str) -> int:
    """The Router's side of one run; returns the audio bytes received (checked by the caller)."""
    received, step_refs, fetched = 0, [], {}
    async for item in llm.run.options(num_returns="streaming").remote(steps, streams, frames, variant):
        event = await item
        if variant == "inline":
            received += len(event.pcm16)
            continue
        index, ref = event
        if variant == "per-chunk":
            received += len((await ref.handle).pcm16)
        elif variant == "step-object":  # one fetch per step; the other streams' events find it here
            if ref.handle not in fetched:
                fetched = {ref.handle: await ref.handle}
            received += len(fetched[ref.handle][index].pcm16)
        else:
            step_refs.append(ref.handle)
            if len(step_refs) == streams:
                received += sum(len(a.pcm16) for a in await asyncio.to_thread(ray.get, step_refs))
                step_refs = []
    return received


def run_variant(variant: str, steps: int, streams: int, frames: int) -> dict:
    detok = Detok.remote()
    llm = LLM.remote(detok)
    asyncio.run(route(llm, 5, streams, frames, variant))  # warm up
    before = ray.get([detok.cpu_s.remote(), llm.cpu_s.remote()]) + [time.process_time()]
    start_s = time.perf_counter()
    received = asyncio.run(route(llm, steps, streams, frames, variant))
    wall_s = time.perf_counter() - start_s
    after = ray.get([detok.cpu_s.remote(), llm.cpu_s.remote()]) + [time.process_time()]
    num_chunks = steps * streams
    if received != num_chunks * 2 * SAMPLES_PER_FRAME * frames:
        raise RuntimeError(f"{variant}: received {received} audio bytes, expected more")
    per_chunk_ms = [round(1000 * (a - b) / num_chunks, 3) for a, b in zip(after, before, strict=True)]
    for actor in (llm, detok):
        ray.kill(actor)
    return {"variant": variant, "chunks": num_chunks, "wall_ms_per_chunk": round(1000 * wall_s / num_chunks, 3),
            "cpu_ms_per_chunk": dict(zip(("detok", "llm", "router"), per_chunk_ms, strict=True))}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--streams", type=int, default=8, help="chunks per engine step (one per stream)")
    p.add_argument("--frames", type=int, default=4, help="codec frames per chunk")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        rows = [run_variant(v, args.steps, args.streams, args.frames) for _ in range(args.repeats) for v in VARIANTS]
    finally:
        ray.shutdown()
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
