"""The CosyVoice 2 / S3Gen flow-matching detokenizer as a stateful codec: speech tokens (25 Hz, one
code per frame) -> 24 kHz audio, streamed exactly with per-request caches.

Each request keeps an `S3GenStream` on this replica (encoder KV + conv inputs, one estimator KV +
conv state per Euler step, HiFT mel/F0/source history and running phase). A chunk keeping tokens
[ks, ke) lets the flow run every attention chunk (`chunk_tokens` tokens) whose 3 look-ahead tokens
lie before ke + 3, and HiFT emit every frame whose context is complete; the final chunk flushes.
So a chunk's audio is a pure function of (ks, ke, is_final, the tokens): the chunker must send
`right_context_frames >= 3`; concatenated, the chunks' audio equals `decode` of the whole stream.

Cache miss (first chunk on a new replica): the state is rebuilt from the chunk's own history, which
therefore must start at token 0 (`window_start == 0`: the family's schedule carries the whole
stream as left context) plus its `voice` (or the preset's default): the tokens before ks are run
through the same chunked forwards, their audio dropped. Slower, same audio.

Chunks of different requests are batched: each round advances every request by one attention
chunk, requests with equal chunk lengths in one forward (KV buffers stay per request).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from core.checkpoints import resolve_model_ref
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import TokenChunk, VoiceConditioning
from detok_stage.codecs.base import CodecAdapter, chunk_rounds
from detok_stage.flow.config import S3GenConfig, full_s3gen_config, tiny_s3gen_config
from detok_stage.flow.flow import Conditioning
from detok_stage.flow.flow_graphs import FlowGraphs
from detok_stage.flow.model import S3Gen, S3GenStream
from detok_stage.flow.slots import EstimatorHistory

logger = logging.getLogger(__name__)


class CacheMissError(ValueError):
    """A chunk reached a replica without its request's state, and does not carry the history to rebuild it."""


MAX_CACHED_VOICES = 256  # registered voices a replica keeps (a voice evicted is fetched again by handle)
STREAM_CHUNK_TOKENS = 25  # the published attention chunk: audio leaves per whole chunk (CosyVoice 2's hop)


def served_tiny_s3gen_config(**overrides) -> S3GenConfig:
    """The preset `cosyvoice2-tiny` / `chatterbox-tiny` serve: tiny layers, but the published 6561-token
    vocabulary (what their LMs emit) and 25-token attention chunks (what their chunk schedule cuts)."""
    return tiny_s3gen_config(**{"vocab_size": 6561, "chunk_tokens": STREAM_CHUNK_TOKENS, **overrides})


CONDS_FILE = "conds.pt"  # chatterbox's built-in voice: its `gen` part is S3Gen's reference


def published_voice(directory: Path, field: str) -> Conditioning | None:
    """The built-in voice of a chatterbox directory: `conds.pt`'s `gen` part (prompt_token [1, P],
    prompt_feat [1, 2P, 80], embedding [1, 192]), the voice its LM side serves as `default`.
    None for a directory without one (CosyVoice2-0.5B)."""
    path = Path(directory) / CONDS_FILE
    if not path.is_file():
        return None
    conds = torch.load(path, map_location="cpu", weights_only=True)
    gen = conds.get("gen") if isinstance(conds, dict) else None
    keys = ("prompt_token", "prompt_feat", "embedding")
    if not isinstance(gen, dict) or any(not isinstance(gen.get(k), torch.Tensor) for k in keys):
        raise InvalidArgumentError(field, f"{path} has no S3Gen voice (a 'gen' dict with {', '.join(keys)})")
    return Conditioning(
        gen["prompt_token"].reshape(-1).long(),
        gen["prompt_feat"].reshape(-1, gen["prompt_feat"].shape[-1]).float(),
        gen["embedding"].reshape(-1).float(),
    )


class S3GenCodec(CodecAdapter):
    is_stateful = True
    codes_per_frame = 1
    # what a chunk schedule must give this codec (checked by `llm_stage.registry` before any engine runs)
    min_right_context_frames = 3  # the encoder's pre-lookahead
    needs_stream_history = True  # a cold replica rebuilds a request's state from the stream's token 0
    bounds_flow_history = True

    def __init__(self, model: S3Gen, device: str = "cpu", n_timesteps: int | None = None) -> None:
        if model.config.chunk_tokens <= 0:
            raise ValueError("S3GenCodec streams chunk-causal attention: config.chunk_tokens must be > 0")
        self.model = model.to(device).eval()
        self.device = device
        self.config = model.config
        self.n_timesteps = n_timesteps or model.config.n_timesteps
        self.codebook_size = model.config.vocab_size
        self.sample_rate_hz = model.config.hift.sampling_rate
        self.samples_per_frame = model.samples_per_token  # 960: 2 mel frames x hop 480
        self._states: dict[str, S3GenStream] = {}
        self.default_voice = model.default_conditioning()
        self.num_rebuilds = 0
        self.voices: OrderedDict[str, Conditioning] = OrderedDict()  # registered voices by handle, LRU

    def enable_graphs(self, batch_sizes: Sequence[int]) -> bool:
        """The flow's streamed chunk as CUDA graphs, chunk batches padded to `batch_sizes`
        (`detok_stage.flow.flow_graphs`; off CUDA the padded forward runs eagerly)."""
        graphs = FlowGraphs(self.model.flow, batch_sizes, self.n_timesteps)
        self.model.flow.graphs = graphs
        captured = graphs.capture_all(self.model.flow)
        logger.info("s3gen flow: %d CUDA graphs captured before serving (sizes %s)", captured, graphs.sizes)
        return True

    def bound_flow_history(self, sink_frames: int, window_frames: int) -> None:
        """`detok_stage.flow.slots.EstimatorHistory`: offline and streamed decoding alike (so they agree);
        set before graphs are captured and before any stream opens."""
        self.model.flow.bound_history(EstimatorHistory(sink_frames, window_frames))

    # ---- registered voices (their tensors arrive over the stage transport, once per replica) ---

    def has_voice(self, handle: str) -> bool:
        return handle in self.voices

    def add_voice(self, voice: VoiceConditioning) -> None:
        self.voices[voice.voice_id] = self.conditioning(voice)
        self.voices.move_to_end(voice.voice_id)
        while len(self.voices) > MAX_CACHED_VOICES:
            self.voices.popitem(last=False)

    def set_default_voice(self, voice: VoiceConditioning) -> None:
        self.default_voice = self.conditioning(voice)

    def chunk_conditioning(self, chunk: TokenChunk) -> Conditioning:
        """The chunk's voice: a registered one by handle, one carried inline, or the default."""
        if chunk.voice_handle is None:
            return self.conditioning(chunk.voice)
        found = self.voices.get(chunk.voice_handle)
        if found is None:
            raise CacheMissError(f"request {chunk.req_id}: voice {chunk.voice_handle} is not on this replica")
        self.voices.move_to_end(chunk.voice_handle)
        return found

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu", preset: S3GenConfig | None = None) -> S3GenCodec:
        """Published weights with the full shapes from `model_config.codec_dir`, else from
        `checkpoint_dir` (a CosyVoice2-0.5B directory holds `flow.pt` + `hift.pt`; chatterbox's holds
        `s3gen.safetensors` / `s3gen.pt`, and its built-in voice in `conds.pt`, which becomes the default
        conditioning); with neither, seeded random weights of `preset`
        (`served_tiny_s3gen_config` by default)."""
        for ref, name in (
            (model_config.codec_dir, "model.codec_dir"),
            (model_config.checkpoint_dir, "model.checkpoint_dir"),
        ):
            if ref is not None:
                path = resolve_model_ref(ref, field=name)
                codec = cls(S3Gen.from_checkpoint(preset or full_s3gen_config(), path), device)
                voice = published_voice(path, name)
                if voice is not None:
                    codec.default_voice = voice
                return codec
        return cls(S3Gen.seeded(preset or served_tiny_s3gen_config(), model_config.seed), device)

    # ---- offline ----------------------------------------------------------------------------

    def conditioning(self, voice: VoiceConditioning | None) -> Conditioning:
        if voice is None:
            return self.default_voice
        return Conditioning(
            voice.prompt_tokens.long().cpu(), voice.prompt_mel.float().cpu(), voice.xvector.float().cpu()
        )

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor, voice: VoiceConditioning | None = None) -> torch.Tensor:
        """Offline: frames [B, n, 1] -> audio [B, n * 960], the whole stream in one pass."""
        tokens = frames[..., 0].to(self.device)
        return self.model.offline(tokens, self.conditioning(voice), self.n_timesteps).float().cpu()

    # ---- streamed ---------------------------------------------------------------------------

    def release(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def cache_bytes(self, req_id: str) -> int:
        state = self._states.get(req_id)
        return 0 if state is None else state.nbytes

    @torch.inference_mode()
    def decode_stream(self, chunks: list[TokenChunk]) -> list[torch.Tensor]:
        """Audio of each chunk, in list order (a request's chunks in seq order)."""
        out: list[torch.Tensor | None] = [None] * len(chunks)
        for round_ in chunk_rounds(chunks):  # one round: each request's earliest pending chunk
            streams = {rid: self._take(chunks[i]) for rid, i in round_.items()}
            pieces = self._run(streams)
            finals = [rid for rid, index in round_.items() if chunks[index].is_final]
            flushed = self.model.mel2wav.advance_many(
                [(streams[rid].hift, streams[rid].flow.spks.new_zeros(self.config.mel_bins, 0), True) for rid in finals]
            )
            for rid, wave in zip(finals, flushed, strict=True):
                pieces[rid].append(wave)
            for rid, index in round_.items():
                if chunks[index].is_final:
                    self._states.pop(rid, None)
                else:
                    self._states[rid] = streams[rid]
                out[index] = torch.cat(pieces[rid]).float().cpu() if pieces[rid] else torch.zeros(0)
        return [a if a is not None else torch.zeros(0) for a in out]

    def _take(self, chunk: TokenChunk) -> S3GenStream:
        """The request's stream, ready to advance through this chunk (rebuilt on a miss)."""
        stream = self._states.get(chunk.req_id)
        if stream is None or stream.next_keep != chunk.keep_start:
            stream = self._rebuild(chunk)
        self._extend(stream, chunk)
        return stream

    def _extend(self, stream: S3GenStream, chunk: TokenChunk) -> None:
        """Append the chunk's tokens the flow may use: through keep_end + look-ahead (all at the end)."""
        flow = stream.flow
        known = len(flow.tokens) - flow.num_prompt  # stream tokens already held
        end = chunk.window_start + len(chunk.frames)
        use_to = end if chunk.is_final else min(end, chunk.keep_end + self.config.pre_lookahead_len)
        if use_to > known:
            if chunk.window_start > known:
                raise CacheMissError(
                    f"request {chunk.req_id} chunk {chunk.seq}: tokens {known}..{chunk.window_start} missing"
                )
            flow.tokens += [f[0] for f in chunk.frames[known - chunk.window_start : use_to - chunk.window_start]]
        flow.ended = chunk.is_final
        stream.next_keep = chunk.keep_end

    def _rebuild(self, chunk: TokenChunk) -> S3GenStream:
        if chunk.keep_start > 0 and chunk.window_start != 0:
            raise CacheMissError(
                f"request {chunk.req_id} chunk {chunk.seq}: no cached state on this replica and the chunk's "
                f"history starts at token {chunk.window_start}, not 0"
            )
        stream = self.model.new_stream(self.chunk_conditioning(chunk), self.n_timesteps)
        if chunk.keep_start > 0:
            self.num_rebuilds += 1
            history = TokenChunk(chunk.req_id, -1, chunk.frames, 0, 0, chunk.keep_start, False)
            self._extend(stream, history)
            self._run({chunk.req_id: stream})  # the audio the earlier chunks already carried
        return stream

    def _run(self, streams: dict[str, S3GenStream]) -> dict[str, list[torch.Tensor]]:
        """Advance every stream as far as its tokens allow, one attention chunk per round, equal
        chunk lengths batched; feed each new mel chunk to HiFT. Returns the new audio per request."""
        flow = self.model.flow
        pieces: dict[str, list[torch.Tensor]] = {rid: [] for rid in streams}
        while True:
            by_len: dict[int, list[str]] = defaultdict(list)
            for rid, stream in streams.items():
                n = flow.next_chunk_len(stream.flow)
                if n:
                    by_len[n].append(rid)
            if not by_len:
                return pieces
            for length, rids in by_len.items():
                starts = [streams[r].flow.tokens_done for r in rids]
                mels = flow.advance([streams[r].flow for r in rids], length)
                items = []
                for rid, start, mel in zip(rids, starts, mels, strict=True):
                    drop = max(0, 2 * streams[rid].flow.num_prompt - start * self.config.token_mel_ratio)
                    items.append((streams[rid].hift, mel[:, drop:], False))
                for rid, wave in zip(rids, self.model.mel2wav.advance_many(items), strict=True):
                    if wave.numel():
                        pieces[rid].append(wave)
