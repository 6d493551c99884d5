"""Token -> mel: CosyVoice 2's `CausalMaskedDiffWithXvec` (chatterbox's S3Gen `flow`), offline and streamed.

Offline, `inference` runs the whole [prompt tokens, tokens] sequence through the chunk-causal encoder
and `n_timesteps` Euler steps of the estimator (cosine t schedule, CFG on the x-vector, prompt mel
and encoder output), starting from the fixed noise sliced at each frame's absolute position.

Streamed, `advance` moves requests on by one attention chunk (`chunk_tokens` tokens, 2x mel frames)
at a time, once the chunk's 3 look-ahead tokens exist (or the stream ended), all of them in one
forward per Euler step: the encoder continues from each request's kept keys/values and conv inputs,
and each Euler step from its own (`detok_stage.flow.slots`), so the mel of every chunk equals the
offline mel and no chunk is computed twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.flow.config import S3GenConfig
from detok_stage.flow.encoder import EncoderBatch, UpsampleConformerEncoder
from detok_stage.flow.estimator import CausalConditionalDecoder, StreamCtx
from detok_stage.flow.slots import FRAMES, STEPS, TOKENS, EstimatorHistory, FlowSlot, FlowSlots, SlotBatch

if TYPE_CHECKING:
    from detok_stage.flow.flow_graphs import FlowGraphs


class CausalConditionalCFM(nn.Module):
    """Holds the estimator under the published name `decoder.estimator`."""

    def __init__(self, estimator: CausalConditionalDecoder) -> None:
        super().__init__()
        self.estimator = estimator


@dataclass
class Conditioning:
    """A voice as the flow uses it: prompt speech tokens [P], their mel [2P, 80], the speaker x-vector [192]."""

    prompt_tokens: torch.Tensor
    prompt_mel: torch.Tensor
    xvector: torch.Tensor

    def __post_init__(self) -> None:
        """Two mel frames per prompt token; a longer side is cut to fit (as chatterbox's `embed_ref` does)."""
        pairs = min(int(self.prompt_tokens.numel()), self.prompt_mel.shape[0] // 2)
        self.prompt_tokens = self.prompt_tokens.reshape(-1)[:pairs]
        self.prompt_mel = self.prompt_mel[: 2 * pairs]


@dataclass(eq=False)
class FlowState:
    """One request's flow stream: its voice, its tokens so far, and its slot in the flow's pools (encoder
    and per-Euler-step estimator keys/values and conv inputs); dropping the state frees the slot."""

    cond: Conditioning
    spks: torch.Tensor  # [80] projected x-vector
    slot: FlowSlot
    n_timesteps: int
    tokens: list[int] = field(default_factory=list)  # prompt tokens then stream tokens
    ended: bool = False
    tokens_done: int = 0  # tokens the encoder and estimator have run (prompt included)

    @property
    def num_prompt(self) -> int:
        return int(self.cond.prompt_tokens.numel())

    @property
    def nbytes(self) -> int:
        return self.slot.nbytes


class CausalMaskedDiffWithXvec(nn.Module):
    def __init__(self, config: S3GenConfig) -> None:
        super().__init__()
        self.config = config
        enc = config.encoder
        self.input_embedding = nn.Embedding(config.vocab_size, enc.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.mel_bins)
        self.encoder = UpsampleConformerEncoder(enc)
        self.encoder_proj = nn.Linear(enc.output_size, config.mel_bins)
        self.decoder = CausalConditionalCFM(CausalConditionalDecoder(config.estimator))
        gen = torch.Generator().manual_seed(config.noise_seed)
        self.register_buffer(
            "rand_noise", torch.randn(1, config.mel_bins, config.noise_frames, generator=gen), persistent=False
        )
        self.graphs: FlowGraphs | None = None  # set by `S3GenCodec.enable_graphs`
        self.history = EstimatorHistory()  # every earlier frame (`bound_history` sets a window)

    def bound_history(self, history: EstimatorHistory) -> None:
        """The frames the estimator's attention reads from now on, offline and streamed alike (set before
        any stream opens and before CUDA graphs are captured: their key shapes follow it)."""
        if history.bounded and self.config.chunk_tokens <= 0:
            raise ValueError("a bounded estimator history needs chunk-causal attention (chunk_tokens > 0)")
        if self.slots.open_slots and history != self.history:
            raise RuntimeError("the estimator history changes only while no stream is open")
        self.history = history

    # ---- pieces shared by both paths ----------------------------------------------------------

    def noise(self, start: int, length: int) -> torch.Tensor:
        """The fixed noise for mel frames [start, start + length) ([80, length]; wraps past its end)."""
        idx = torch.arange(start, start + length, device=self.rand_noise.device) % self.rand_noise.shape[2]
        return self.rand_noise[0][:, idx]

    def project_speaker(self, xvector: torch.Tensor) -> torch.Tensor:
        weight = self.spk_embed_affine_layer.weight
        return self.spk_embed_affine_layer(F.normalize(torch.atleast_2d(xvector).to(weight), dim=1))

    def t_span(self, n_timesteps: int) -> torch.Tensor:
        t = torch.linspace(0, 1, n_timesteps + 1, device=self.rand_noise.device)
        return 1 - torch.cos(t * 0.5 * torch.pi)

    def _embed(self, tokens: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's tokens embedded, zero rows after it up to `width`: ([N, width, D], exists [N, width])."""
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tokens], dtype=torch.long)
        exists = torch.arange(width).unsqueeze(0) < torch.tensor([len(t) for t in tokens]).unsqueeze(1)
        device = self.rand_noise.device
        exists = exists.to(device, non_blocking=True)
        return self.input_embedding(padded.to(device)) * exists.unsqueeze(-1).to(self.rand_noise.dtype), exists

    def _euler(self, z: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, n_timesteps: int,
               ctx_for_step) -> torch.Tensor:  # fmt: skip
        """z, mu, cond [B, 80, T], spks [B, 80]: rows interleaved (cond, uncond) per request for CFG."""
        rate = self.config.cfg_rate
        t_span = self.t_span(n_timesteps)
        x = z
        mu_in = torch.stack([mu, torch.zeros_like(mu)], 1).flatten(0, 1)
        spks_in = torch.stack([spks, torch.zeros_like(spks)], 1).flatten(0, 1)
        cond_in = torch.stack([cond, torch.zeros_like(cond)], 1).flatten(0, 1)
        estimator = self.decoder.estimator
        for k in range(n_timesteps):
            t, r = t_span[k], t_span[k + 1]
            x_in = x.repeat_interleave(2, dim=0)
            t_in = t.expand(x_in.shape[0])
            v = estimator(x_in, mu_in, t_in, spks_in, cond_in, ctx_for_step(k)).view(x.shape[0], 2, *x.shape[1:])
            x = x + (r - t) * ((1.0 + rate) * v[:, 0] - rate * v[:, 1])
        return x

    # ---- offline ------------------------------------------------------------------------------

    @torch.inference_mode()
    def inference(self, tokens: torch.Tensor, cond: Conditioning, n_timesteps: int | None = None) -> torch.Tensor:
        """tokens [B, N] (one voice for the batch) -> mel [B, 80, 2N]: the whole sequence in one pass."""
        n_timesteps = n_timesteps or self.config.n_timesteps
        b = tokens.shape[0]
        prompt = cond.prompt_tokens.long().view(1, -1).expand(b, -1)
        seq = torch.cat([prompt.to(tokens.device), tokens.long()], dim=1)
        la = self.config.pre_lookahead_len
        emb, exists = self._embed(seq.tolist(), seq.shape[1] + la)
        mu = self.encoder_proj(self.encoder(emb, exists, self.config.chunk_tokens)).transpose(1, 2)
        frames = mu.shape[2]
        conds = torch.zeros_like(mu)
        p_frames = cond.prompt_mel.shape[0]
        conds[:, :, :p_frames] = cond.prompt_mel.T.to(mu)
        spks = self.project_speaker(cond.xvector).expand(b, -1)
        z = self.noise(0, frames).unsqueeze(0).expand(b, -1, -1)
        chunk = self.config.chunk_tokens * self.config.token_mel_ratio
        mel = self._euler(z, mu, spks, conds, n_timesteps, lambda k: StreamCtx(chunk, history=self.history))
        return mel[:, :, p_frames:]

    # ---- streamed -----------------------------------------------------------------------------

    @property
    def slots(self) -> FlowSlots:
        """The pools every streamed request of this flow keeps its state in (made on the module's device)."""
        pools = getattr(self, "_slots", None)
        device = self.rand_noise.device
        if pools is None or (pools.device != device and not pools.open_slots):
            pools = FlowSlots(device, self.config.token_mel_ratio)
            self._slots = pools
        return pools

    def new_state(self, cond: Conditioning, n_timesteps: int) -> FlowState:
        return FlowState(
            cond=cond,
            spks=self.project_speaker(cond.xvector)[0],
            slot=self.slots.open(),
            n_timesteps=n_timesteps,
            tokens=[int(t) for t in cond.prompt_tokens.tolist()],
        )

    def next_chunk_len(self, state: FlowState) -> int:
        """Tokens the next attention chunk of this request covers, 0 while it must wait for more."""
        c = self.config.chunk_tokens
        s = state.tokens_done
        end = (s // c + 1) * c
        total = len(state.tokens)
        if end + self.config.pre_lookahead_len <= total:
            return end - s
        if state.ended and total > s:
            return min(end, total) - s
        return 0

    @torch.inference_mode()
    def advance(self, states: list[FlowState], length: int) -> list[torch.Tensor]:
        """Run the next `length` tokens of every request (all its next chunk) -> mel [80, 2 * length] each,
        prompt frames included (the caller drops those). The requests share one forward per Euler step
        (a CUDA graph's replay where `graphs` has one for the shape)."""
        for s in states:
            s.slot.hold(s.tokens_done + length)
        mel = self.graphs.run(self, states, length) if self.graphs is not None else None
        if mel is None:
            inputs, spans = self.round_inputs(states, length)
            mel = self.round(*inputs, n_timesteps=states[0].n_timesteps, spans=spans)
        chunk_frames = self.config.chunk_tokens * self.config.token_mel_ratio
        for s in states:
            s.tokens_done += length
            next_chunk_start = s.tokens_done * self.config.token_mel_ratio // chunk_frames * chunk_frames
            s.slot.forget_behind(self.history, next_chunk_start)
        return list(mel)

    def round_inputs(
        self, states: list[FlowState], length: int, num_tokens: int | None = None
    ) -> tuple[list[torch.Tensor], tuple[tuple[int, int], tuple[int, int]]]:
        """The device inputs of `round` for the requests' next `length` tokens (their slots hold the
        blocks): embedded tokens + look-ahead and where they exist, speakers, prompt-mel condition,
        noise, then the token, mel-frame and estimator `SlotBatch` tensors (the encoder's keys padded
        to `num_tokens`; the estimator's as long as its history asks); and the encoder batches'
        position spans (`SlotBatch.span`)."""
        la = self.config.pre_lookahead_len
        ratio = self.config.token_mel_ratio
        starts = [s.tokens_done for s in states]
        emb, exists = self._embed([s.tokens[st : st + length + la] for s, st in zip(states, starts, strict=True)],
                                  length + la)  # fmt: skip
        ids = [s.slot.id for s in states]
        chunk = self.config.chunk_tokens
        tokens = SlotBatch.build(self.slots, TOKENS, ids, starts, length, chunk, num_tokens)
        frame_starts = [st * ratio for st in starts]
        frames = SlotBatch.build(self.slots, FRAMES, ids, frame_starts, length * ratio, chunk * ratio,
                                 tokens.num_keys * ratio)  # fmt: skip
        if self.history.bounded:
            steps = SlotBatch.build_bounded(self.slots, STEPS, ids, frame_starts, length * ratio, chunk * ratio,
                                            self.history)  # fmt: skip
        else:
            steps = SlotBatch.build(self.slots, STEPS, ids, frame_starts, length * ratio, chunk * ratio,
                                    frames.num_keys)  # fmt: skip
        spks = torch.stack([s.spks for s in states])
        conds = self._prompt_mel_at(states, length * ratio, spks)
        batches = [*tokens.tensors(), *frames.tensors(), *steps.tensors()]
        return [emb, exists, spks, conds, self._noise_at(frames), *batches], (tokens.span, frames.span)

    def round(self, emb: torch.Tensor, exists: torch.Tensor, spks: torch.Tensor, conds: torch.Tensor, z: torch.Tensor,
              *batches: torch.Tensor, n_timesteps: int, spans: tuple | None = None) -> torch.Tensor:  # fmt: skip
        """One streamed chunk of G requests on the device, nothing read back (capturable): the encoder
        over their tokens, then `n_timesteps` Euler steps -> mel [G, 80, frames]; keys, values and conv
        inputs updated in their slots. `spans` None (a CUDA graph): position spans fixed by the shapes."""
        n = len(batches) // 3
        token_span, frame_span = spans or (None, None)
        tokens = SlotBatch.of_tensors(self.slots, TOKENS, list(batches[:n]), token_span)
        frames = SlotBatch.of_tensors(self.slots, FRAMES, list(batches[n : 2 * n]), frame_span)
        steps = SlotBatch.of_tensors(self.slots, STEPS, list(batches[2 * n :]))
        chunk = self.config.chunk_tokens
        mu = self.encoder_proj(self.encoder(emb, exists, chunk, EncoderBatch(tokens, frames))).transpose(1, 2)
        chunk_frames = chunk * self.config.token_mel_ratio
        return self._euler(z, mu, spks, conds, n_timesteps, lambda k: StreamCtx(chunk_frames, steps, k))

    def _noise_at(self, frames: SlotBatch) -> torch.Tensor:
        """The fixed noise at each request's new mel frames: [G, 80, frames]."""
        index = frames.query_positions % self.rand_noise.shape[2]  # [G, frames]
        return self.rand_noise[0][:, index].transpose(0, 1)

    def _prompt_mel_at(self, states: list[FlowState], frames: int, like: torch.Tensor) -> torch.Tensor:
        """The condition [G, 80, frames] (dtype and device of `like`): the voice's prompt mel where the new
        frames still cover it, else 0."""
        conds = like.new_zeros(len(states), self.config.mel_bins, frames)
        ratio = self.config.token_mel_ratio
        for g, s in enumerate(states):
            f0 = s.tokens_done * ratio
            if f0 < s.cond.prompt_mel.shape[0]:
                part = s.cond.prompt_mel[f0 : f0 + frames].T.to(like)
                conds[g, :, : part.shape[1]] = part
        return conds
