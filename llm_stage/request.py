"""Request lifecycle inside the LLM engine: a status enum and the per-request record.

Created by `LLMEngine.add_request`, mutated only by the scheduler's `update` / `cancel` /
`preempt`. A position holds a `Token`: one vocab id, or a tuple of ids (K codebooks, plus
model-specific lanes). A guided (CFG) request owns a hidden unconditional `twin`. A streaming-text
request reads its text from a `text_feed`: positions past the text that has arrived wait for it. A
family that places positions of its own between its sampled tokens (CosyVoice 2's text streaming: text
between speech) keeps them in `positions`; otherwise each output token is the next position.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from core.messages import SamplingParams
from llm_stage.text_feed import TextFeed

Token = int | tuple[int, ...]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV slot yet
    PREFILLING = "prefilling"  # has a slot, prompt partly in the cache
    DECODING = "decoding"  # prompt cached, generating one token per step
    FINISHED = "finished"
    CANCELLED = "cancelled"


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-speech / EOS id was sampled
    LENGTH = "length"  # max_tokens or the context was reached
    CANCELLED = "cancelled"


@dataclass(eq=False)  # identity: requests are compared by object, never by value
class Request:
    req_id: str
    prompt_ids: list[Token]
    sampling: SamplingParams
    arrival_s: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_cached: int = 0  # tokens whose K/V are in the cache
    output_ids: list[Token] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    twin: Request | None = None  # the hidden unconditional row of a guided (CFG) request
    is_twin: bool = False
    num_preemptions: int = 0
    # Playback clock fed by the router (streaming-aware scheduling).
    first_audio_s: float | None = None  # monotonic time the first chunk left for the client
    audio_sent_s: float = 0.0  # seconds of audio shipped so far
    tokens_to_next_chunk: int = 0  # engine steps until the smallest next chunk can be cut
    text_feed: TextFeed | None = None  # native text streaming: the text its positions read, as it arrives
    # the known positions after the prompt when the adapter lays them out (`LMAdapter.record_token`);
    # None: the output tokens, one position each
    positions: list[Token] | None = None
    # the conversation key its prompt's KV stays under in its slot when it ends, for a later request whose
    # prompt starts the same (`llm_stage.kept_prompts`); None: not kept
    keeps_prompt_as: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_known(self) -> int:
        """Prompt plus generated (or laid-out) positions."""
        return self.prompt_len + len(self.output_ids if self.positions is None else self.positions)

    @property
    def num_ready(self) -> int:
        """Known positions that can be computed: all, but those whose streamed text has not arrived."""
        if self.text_feed is None:
            return self.num_known
        return min(self.num_known, self.text_feed.ready_through)

    @property
    def num_prompt_left(self) -> int:
        """Known positions still to prefill (after a preemption, generated ones are re-prefilled too)."""
        return max(0, self.num_ready - self.num_cached)

    @property
    def is_waiting_for_text(self) -> bool:
        """The next position to compute reads streamed text that has not arrived: no batch row, KV kept."""
        return self.text_feed is not None and self.num_cached >= self.text_feed.ready_through

    @property
    def unit(self) -> list[Request]:
        """The rows scheduled together: the request, then its twin."""
        return [self] if self.twin is None else [self, self.twin]

    @property
    def is_done(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.CANCELLED)

    def token_at(self, index: int) -> Token:
        """Token at absolute position `index` of prompt + output."""
        if index < self.prompt_len:
            return self.prompt_ids[index]
        after = self.output_ids if self.positions is None else self.positions
        return after[index - self.prompt_len]

    def history(self, window: int) -> list[Token]:
        """The last `window` tokens of prompt + output (all when window == 0)."""
        tokens = self.prompt_ids + self.output_ids
        return tokens if window == 0 else tokens[-window:]
