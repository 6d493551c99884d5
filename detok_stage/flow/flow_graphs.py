"""The S3Gen flow's streamed chunk (encoder + every Euler step of the estimator) as CUDA graphs.

One graph per shape: requests padded to a captured batch size, a whole attention chunk of tokens,
and key positions padded to a power of two (`key_bucket`), so a stream replays the same few graphs
as it grows. Eager on the same inputs where no graph fits (a stream's shorter last chunk, more
requests than the largest size, a stream past the largest bucket, the first round that makes the
pools, a different number of Euler steps), and off CUDA, where the padded computation runs eagerly
(what the CPU tests check against the unpadded one).

Padding rows belong to a scratch slot held for the replica's life: they write their keys, values
and conv inputs there, see only their own keys, and their output is dropped. Captures warm up on
scratch rows only, so no request's state runs twice. The pools' addresses are baked into the
graphs: when a pool is reallocated (`FlowSlots.generation`), the graphs are dropped and captured
again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from core.graphs import GraphCache, graphs_available, padded_size
from detok_stage.flow.flow import CausalMaskedDiffWithXvec, Conditioning, FlowState

logger = logging.getLogger(__name__)

MIN_KEY_TOKENS = 64  # the smallest key bucket (2.6 s of 25 Hz tokens)
MAX_KEY_TOKENS = 4096  # past this a chunk runs eagerly (164 s of speech, prompt included)


def key_bucket(tokens: int) -> int | None:
    """Key positions (tokens) a chunk reaching `tokens` is padded to: the next power of two from 64."""
    bucket = MIN_KEY_TOKENS
    while bucket < tokens:
        bucket *= 2
    return bucket if bucket <= MAX_KEY_TOKENS else None


class FlowGraphs:
    def __init__(self, flow: CausalMaskedDiffWithXvec, sizes: Sequence[int], n_timesteps: int) -> None:
        self.sizes = sorted(set(sizes))
        self.n_timesteps = n_timesteps
        mel_bins = flow.config.mel_bins
        silent = Conditioning(
            torch.zeros(0, dtype=torch.long), torch.zeros(0, mel_bins), torch.zeros(flow.config.spk_embed_dim)
        )
        self.scratch = flow.new_state(silent, n_timesteps)
        self.graphs = GraphCache(lambda *inputs: flow.round(*inputs, n_timesteps=n_timesteps), "s3gen flow")
        self.generation = flow.slots.generation
        self.num_runs = 0  # chunks run on the padded path (replayed on CUDA)

    def run(self, flow: CausalMaskedDiffWithXvec, states: list[FlowState], length: int) -> torch.Tensor | None:
        """Mel [G, 80, 2 * length] of the requests' next whole attention chunk from the padded forward
        (a graph's replay on CUDA), or None: run it eagerly. The requests' slots already hold the blocks."""
        count = len(states)
        size = padded_size(self.sizes, count)
        keys = key_bucket(max(s.tokens_done for s in states) + length)
        if (
            size is None or keys is None or length != flow.config.chunk_tokens or not flow.slots.kv
            or any(s.n_timesteps != self.n_timesteps for s in states)
        ):  # fmt: skip
            return None
        self._prepare_scratch(flow, length)
        inputs, _ = flow.round_inputs(states + [self.scratch] * (size - count), length, keys)
        if not graphs_available(inputs[0].device):
            self.num_runs += 1
            return flow.round(*inputs, n_timesteps=self.n_timesteps)[:count]
        if not self.graphs.has(inputs) and not self._capture(flow, size, length, keys):
            return None
        out = self.graphs(*inputs)
        if out is None:
            return None
        self.num_runs += 1
        return out[:count].clone()  # (the graph's output buffer is reused by its next replay)

    @torch.inference_mode()
    def capture_all(self, flow: CausalMaskedDiffWithXvec) -> int:
        """Before serving, on CUDA: every size at the smallest key bucket, on scratch rows (the pools made
        first by one eager scratch round), so the first streams replay instead of waiting for captures;
        longer streams' buckets are captured as they reach them. Returns the graphs captured."""
        if not graphs_available(flow.rand_noise.device):
            return 0
        length = flow.config.chunk_tokens
        self._prepare_scratch(flow, length)
        if not flow.slots.kv:
            inputs, spans = flow.round_inputs([self.scratch] * self.sizes[-1], length, MIN_KEY_TOKENS)
            flow.round(*inputs, n_timesteps=self.n_timesteps, spans=spans)
            self._prepare_scratch(flow, length)
        for size in self.sizes:
            self._capture(flow, size, length, MIN_KEY_TOKENS)
        return self.graphs.num_captured

    def _capture(self, flow: CausalMaskedDiffWithXvec, size: int, length: int, keys: int) -> bool:
        """Capture the shape on scratch rows only (its warm-up runs change no request's state)."""
        inputs, _ = flow.round_inputs([self.scratch] * size, length, keys)
        return self.graphs.capture(inputs)

    def _prepare_scratch(self, flow: CausalMaskedDiffWithXvec, length: int) -> None:
        """The scratch rows write positions [0, length); the pools fit every slot's blocks (grown here,
        outside any capture), and graphs captured on pools since reallocated are dropped."""
        self.scratch.tokens = [0] * (length + flow.config.pre_lookahead_len)
        self.scratch.tokens_done = 0
        self.scratch.slot.hold(length)
        flow.slots.fit()
        if flow.slots.generation != self.generation:
            self.graphs = GraphCache(self.graphs.fn, self.graphs.name)
            self.generation = flow.slots.generation
            logger.info("s3gen flow: pools reallocated, CUDA graphs captured again as shapes recur")
