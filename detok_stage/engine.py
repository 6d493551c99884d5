"""Detokenizer engine: decodes ready TokenChunks from many requests in batched forwards.

`submit` queues a chunk (validated), `step` decodes up to `max_batch_chunks` of them (windows of
equal length share one forward), crops each to its kept frames and returns PCM16 AudioChunks
in per-request seq order; `release` drops a request's state. Usable in-process without Ray.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from core.config import DetokConfig
from core.errors import InvalidArgumentError
from core.graphs import graphs_available
from core.messages import AudioChunk, TokenChunk
from core.policy import PolicyKind, SchedulingPolicy
from detok_stage.codecs.base import CodecAdapter
from detok_stage.graphs import ChunkGraphs


def to_pcm16(audio: torch.Tensor) -> bytes:
    """float [-1, 1] -> little-endian int16 bytes (clipped)."""
    return (audio.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16).numpy().astype("<i2").tobytes()


REDO_MARK = "#redo-"  # a redone chunk decodes as request "<its stream>#redo-<seq>" (`TokenChunk.redo`)


@dataclass
class _RequestState:
    next_seq: int = 0  # next seq to hand out, so a request's audio leaves in order
    done: dict[int, AudioChunk] = field(default_factory=dict)


@dataclass
class _Pending:
    chunk: TokenChunk
    submitted_s: float


class DetokEngine:
    def __init__(
        self, codec: CodecAdapter, config: DetokConfig, in_order: bool = True, policy: SchedulingPolicy | None = None
    ) -> None:
        """`in_order=False` returns every chunk as soon as it is decoded (the caller orders them,
        as the router does when a request's chunks are spread over several detok replicas).
        `policy` orders queued chunks (`SchedulingPolicy.chunk_priority`; FIFO by default)."""
        self.codec = codec
        self.config = config
        self.in_order = in_order
        self.policy = policy or SchedulingPolicy(PolicyKind.FCFS)
        self._queue: list[_Pending] = []
        self._states: dict[str, _RequestState] = defaultdict(_RequestState)
        self._last_decoded_seq: dict[str, int] = {}  # stateful codecs: each request's decode order
        self._redos: dict[str, str] = {}  # a redone chunk's own request id -> its stream's (`TokenChunk.redo`)
        self.num_decoded_frames = 0  # frames through the codec, context included
        self._forward_thread = ThreadPoolExecutor(1, "detok-forward") if config.async_steps else None
        self.graphs = ChunkGraphs.build(codec, config)
        # its own CUDA stream: beside an LLM engine on the same GPU (the in-process pipeline), codec
        # kernels neither queue behind the LLM's nor hold up its one read-back per step
        self._stream = torch.cuda.Stream(config.device) if graphs_available(config.device) else None

    @property
    def has_work(self) -> bool:
        """A queued chunk can be decoded now (a stateful codec's chunk waits for its predecessor)."""
        if not self.codec.is_stateful:
            return bool(self._queue)
        through = self._decoded_through()
        return any(p.chunk.seq <= through[p.chunk.req_id] + 1 for p in self._queue)

    def _decoded_through(self) -> dict[str, int]:
        """Each queued request's last decoded seq; a request this replica has not decoded yet
        starts at its lowest queued seq (a failover replica sees a stream from mid-way)."""
        through = dict(self._last_decoded_seq)
        for pending in self._queue:
            req_id, seq = pending.chunk.req_id, pending.chunk.seq
            if req_id not in self._last_decoded_seq:
                through[req_id] = min(through.get(req_id, seq), seq - 1)
        return through

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def validate(self, chunk: TokenChunk) -> None:
        """Raise InvalidArgumentError("frames") when the codec cannot decode the chunk."""
        problem = self.codec.check_frames(chunk.frames)
        if problem is not None:
            raise InvalidArgumentError("frames", f"request {chunk.req_id} chunk {chunk.seq}: {problem}")

    def submit(self, chunk: TokenChunk) -> None:
        self.validate(chunk)
        if chunk.redo:  # decoded under a request id of its own, as a replica that never saw the stream would
            own_id = f"{chunk.req_id}{REDO_MARK}{chunk.seq}"
            self._redos[own_id] = chunk.req_id
            chunk = dataclasses.replace(chunk, req_id=own_id)
        last = self._last_decoded_seq.get(chunk.req_id)
        if last is not None and chunk.seq <= last:  # sent again: its stream resumed on another LLM replica
            self._last_decoded_seq[chunk.req_id] = chunk.seq - 1
        if self.in_order and not chunk.redo:
            self._states[chunk.req_id]  # noqa: B018  (creates the state)
        hops = dataclasses.replace(chunk.hops, detok_received_unix_s=time.time())
        self._queue.append(_Pending(dataclasses.replace(chunk, hops=hops), time.monotonic()))

    def release(self, req_id: str) -> int:
        """Forget a request; returns how many of its chunks were dropped undelivered."""
        self.codec.release(req_id)
        return self.drop_queued(req_id)

    def drop_queued(self, req_id: str) -> int:
        """Drop a request's queued chunks and its decode order, keeping its decoder state (a stream
        whose LLM replica was lost resumes elsewhere and sends its chunks here again)."""
        self._last_decoded_seq.pop(req_id, None)
        state = self._states.pop(req_id, None)
        kept = [p for p in self._queue if p.chunk.req_id != req_id]
        dropped = len(self._queue) - len(kept) + (len(state.done) if state is not None else 0)
        self._queue = kept
        return dropped

    def step(self) -> list[AudioChunk]:
        batch = self._select()
        if not batch:
            return []
        decoded, redone = self._end_redos(self._decode(batch))
        return (self._release_in_order(decoded) if self.in_order else decoded) + redone

    def _end_redos(self, decoded: list[AudioChunk]) -> tuple[list[AudioChunk], list[AudioChunk]]:
        """(the streams' audio, the redone chunks' audio under their streams' ids); a redo's own decoder state and
        order are dropped: it leaves nothing behind."""
        streams, redone = [], []
        for audio in decoded:
            own_id = audio.req_id
            if own_id not in self._redos:
                streams.append(audio)
                continue
            audio.req_id = self._redos.pop(own_id)
            self.release(own_id)
            redone.append(audio)
        return streams, redone

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def _priority(self, pending: _Pending) -> tuple:
        return self.policy.chunk_priority(pending.chunk, pending.submitted_s)

    def _select(self) -> list[TokenChunk]:
        self._queue.sort(key=self._priority)
        if self.codec.is_stateful:
            return self._select_in_seq_order()
        picked, self._queue = self._queue[: self.config.max_batch_chunks], self._queue[self.config.max_batch_chunks :]
        return [p.chunk for p in picked]

    def _select_in_seq_order(self) -> list[TokenChunk]:
        """By priority, but a stateful codec decodes each request's chunks in seq order: a chunk
        whose predecessor has not been decoded yet waits here (chunks of one stream can arrive out
        of order in concurrent decode calls; decoding one early would restart the codec's state)."""
        expected = self._decoded_through()
        picked, waiting = [], []
        for pending in self._queue:
            chunk = pending.chunk
            is_next = chunk.seq <= expected[chunk.req_id] + 1  # (a repeat of a decoded seq goes through)
            if is_next and len(picked) < self.config.max_batch_chunks:
                picked.append(chunk)
                expected[chunk.req_id] = max(expected[chunk.req_id], chunk.seq)
            else:
                waiting.append(pending)
        self._queue = waiting
        for chunk in picked:
            if chunk.is_final:
                self._last_decoded_seq.pop(chunk.req_id, None)
            else:
                self._last_decoded_seq[chunk.req_id] = max(self._last_decoded_seq.get(chunk.req_id, -1), chunk.seq)
        return picked

    def _decode(self, chunks: list[TokenChunk]) -> list[AudioChunk]:
        if self.codec.is_stateful:  # per-request decoder caches: the codec crops to the kept frames itself
            self.num_decoded_frames += sum(c.keep_end - c.keep_start for c in chunks)
            with torch.cuda.stream(self._stream):
                waves = self.codec.decode_stream(chunks)
            return [self._audio_chunk(c, w) for c, w in zip(chunks, waves, strict=True)]
        by_len: dict[int, list[TokenChunk]] = defaultdict(list)
        for chunk in chunks:
            if chunk.keep_end > chunk.keep_start:
                by_len[chunk.num_frames].append(chunk)
        groups = list(by_len.values())
        decoded = self._decode_groups_async(groups) if self._forward_thread is not None else self._decode_groups(groups)
        audio = {(c.req_id, c.seq): a for c, a in decoded}
        empty = torch.zeros(0)
        return [audio[(c.req_id, c.seq)] if (c.req_id, c.seq) in audio else self._audio_chunk(c, empty) for c in chunks]

    def _decode_groups(self, groups: list[list[TokenChunk]]) -> list[tuple[TokenChunk, AudioChunk]]:
        out = []
        for group in groups:
            out += self._cut(group, self._forward(self._frames_tensor(group)))
        return out

    def _decode_groups_async(self, groups: list[list[TokenChunk]]) -> list[tuple[TokenChunk, AudioChunk]]:
        """Each group's codec forward on the worker thread while this one builds the next group's
        input and cuts / PCM-encodes the previous group's audio."""
        assert self._forward_thread is not None
        out: list[tuple[TokenChunk, AudioChunk]] = []
        if not groups:
            return out
        pending = self._forward_thread.submit(self._forward, self._frames_tensor(groups[0]))
        for index, group in enumerate(groups):
            next_input = self._frames_tensor(groups[index + 1]) if index + 1 < len(groups) else None
            waves = pending.result()
            if next_input is not None:
                pending = self._forward_thread.submit(self._forward, next_input)
            out += self._cut(group, waves)
        return out

    def _frames_tensor(self, group: list[TokenChunk]) -> torch.Tensor:
        return torch.tensor([c.frames for c in group], dtype=torch.long)  # [G, n, K]

    @torch.inference_mode()
    def _forward(self, frames: torch.Tensor) -> torch.Tensor:
        self.num_decoded_frames += frames.shape[0] * frames.shape[1]
        with torch.cuda.stream(self._stream):  # (None: a no-op off CUDA)
            replayed = self.graphs.run(frames) if self.graphs is not None else None
            return replayed if replayed is not None else self.codec.decode(frames)

    def _cut(self, group: list[TokenChunk], waves: torch.Tensor) -> list[tuple[TokenChunk, AudioChunk]]:
        return [(c, self._audio_chunk(c, self._keep(c, w))) for c, w in zip(group, waves, strict=True)]

    def close(self) -> None:
        if self._forward_thread is not None:
            self._forward_thread.shutdown(wait=True)

    def _keep(self, chunk: TokenChunk, wave: torch.Tensor) -> torch.Tensor:
        spf = self.codec.samples_per_frame
        start = (chunk.keep_start - chunk.window_start) * spf
        return wave[start : start + (chunk.keep_end - chunk.keep_start) * spf]

    def _audio_chunk(self, chunk: TokenChunk, wave: torch.Tensor) -> AudioChunk:
        return AudioChunk(
            chunk.req_id, chunk.seq, to_pcm16(wave), self.codec.sample_rate_hz, chunk.is_final,
            num_frames=self._frames_covered(chunk, wave),
            hops=dataclasses.replace(chunk.hops, audio_ready_unix_s=time.time()),
        )  # fmt: skip

    def _frames_covered(self, chunk: TokenChunk, wave: torch.Tensor) -> int:
        """Codec frames the chunk's audio plays (what the LLM side's frame duration is measured by):
        its kept frames, except for a stateful codec whose audio runs behind them (S3Gen holds back
        HiFT's look-ahead and emits whole attention chunks): the frames its samples fill, 0 (unknown)
        when they fill no whole number."""
        if not self.codec.is_stateful:
            return chunk.keep_end - chunk.keep_start
        frames, rest = divmod(wave.numel(), self.codec.samples_per_frame)
        return frames if rest == 0 else 0

    def _release_in_order(self, decoded: list[AudioChunk]) -> list[AudioChunk]:
        ready = []
        for audio in decoded:
            state = self._states.get(audio.req_id)
            if state is None:  # released while decoding
                continue
            state.done[audio.seq] = audio
            while state.next_seq in state.done:
                out = state.done.pop(state.next_seq)
                state.next_seq += 1
                ready.append(out)
                if out.is_final:
                    self._states.pop(audio.req_id, None)
                    break
        return ready


def pcm16_to_float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0
