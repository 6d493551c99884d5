"""Step-Audio 2 mini's published token2wav as a stateful codec: 25 Hz CosyVoice 2 speech tokens (6561
codes, one per frame) -> 24 kHz audio, streamed per chunk the way the published streaming streams.

Each chunk's kept tokens (with the 3 look-ahead tokens after them; the last chunk pads zeros) are one
call of the flow from the request's caches (prompt run first, every attention cache cut to its last
128 positions after each call, `detok_stage.flow.step_audio2_flow`), then HiFT over the chunk before's
last 8 mel frames + this mel, cross-faded into the 3840 samples the chunk before held back
(`detok_stage.flow.step_audio2_hift`). So the audio depends on where the chunks cut, as GLM-4-Voice's
codec's does; the family's schedule cuts the reference's 25 + 3. A non-final chunk without its 3
look-ahead tokens, or keeping fewer than `MIN_CHUNK_TOKENS`, is held and decoded with the next one.

Batching: each round takes every request's next chunk; requests whose caches have the same shapes
and whose chunks the same length share one forward per Euler step (after the 128 cut every long
stream's caches have the same shape). Voices: the chunk's registered or inline voice (prompt
tokens, their mel, x-vector, as for S3Gen), else the model's default; a voice's state after its
prompt call is kept (`MAX_SETUP_STATES`) and copied into each stream that starts with it.

Cache miss (a chunk on a replica without its request's state): rebuilt from the chunk's history,
which must start at token 0, decoded in `REBUILD_CHUNK_TOKENS` chunks, audio dropped. That equals the
uninterrupted stream when it was cut the same way (the family's schedule), and is close to it otherwise.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.checkpoints import resolve_model_ref
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import TokenChunk, VoiceConditioning
from detok_stage.codecs.base import CodecAdapter, checked_codes, chunk_rounds, padded_rows
from detok_stage.flow.flow import Conditioning
from detok_stage.flow.step_audio2_config import Token2WavConfig, tiny_token2wav_config
from detok_stage.flow.step_audio2_model import FLOW_FILE, HIFT_FILE, StepAudio2Token2Wav, Token2WavStream

TOKEN2WAV_DIR = "token2wav"  # where a Step-Audio-2-mini checkpoint keeps its detokenizer
REBUILD_CHUNK_TOKENS = 25  # the published stream's chunk (28 tokens sent = 25 + 3 look-ahead)
MIN_CHUNK_TOKENS = 4  # 8 mel frames: a chunk's audio must cover the 3840 samples it holds back
MAX_CACHED_VOICES = 256
MAX_SETUP_STATES = 8  # voices whose post-prompt state is kept (the full estimator caches are ~170 MB each)


class CacheMissError(ValueError):
    """A chunk reached a replica without its request's state, and does not carry the history to rebuild it."""


@dataclass
class _Request:
    stream: Token2WavStream
    pending: list[int] = field(default_factory=list)  # kept tokens of held chunks, not decoded yet
    next_keep: int = 0  # the stream token the next chunk keeps from


@dataclass(frozen=True)
class _Work:
    """What one chunk asks of the model: a flow call over `tokens`, or the held tail (`flush`), or nothing."""

    tokens: tuple[int, ...] = ()
    last_chunk: bool = False
    flush: bool = False


def token2wav_dir(path: Path) -> Path:
    """A token2wav/ directory itself, or a Step-Audio-2-mini checkpoint holding one."""
    return path if (path / FLOW_FILE).is_file() else path / TOKEN2WAV_DIR


def load_published(path: Path, field_name: str) -> StepAudio2Token2Wav:
    directory = token2wav_dir(Path(path))
    missing = [name for name in (FLOW_FILE, HIFT_FILE) if not (directory / name).is_file()]
    if missing:
        names = ", ".join(missing)
        raise InvalidArgumentError(field_name, f"{directory} has no {names} (not Step-Audio 2's token2wav/)")
    return StepAudio2Token2Wav.from_published(directory)


class StepAudio2Codec(CodecAdapter):
    is_stateful = True
    codes_per_frame = 1
    min_right_context_frames = 3  # the encoder's pre-lookahead
    needs_stream_history = True  # a cold replica rebuilds a request's state from the stream's token 0

    def __init__(self, model: StepAudio2Token2Wav, device: str = "cpu") -> None:
        self.model = model.to(device).eval()
        self.device = device
        self.config = model.config
        self.codebook_size = model.config.vocab_size
        self.sample_rate_hz = model.config.hift.sampling_rate
        self.samples_per_frame = model.config.samples_per_token  # 960
        self.default_voice = model.default_conditioning()
        self.voices: OrderedDict[str, Conditioning] = OrderedDict()  # registered voices by handle, LRU
        self._setups: OrderedDict[str, Token2WavStream] = OrderedDict()  # voice -> state after its prompt
        self._requests: dict[str, _Request] = {}
        self.num_rebuilds = 0

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu", preset: Token2WavConfig | None = None
              ) -> StepAudio2Codec:  # fmt: skip
        """The published token2wav/ from `codec_dir` (the directory or a checkpoint holding it), else from
        `checkpoint_dir`'s token2wav/; with neither, seeded random weights of `preset`
        (`tiny_token2wav_config` by default) from `model.seed`."""
        refs = ((model_config.codec_dir, "model.codec_dir"), (model_config.checkpoint_dir, "model.checkpoint_dir"))
        for ref, name in refs:
            if ref is not None:
                return cls(load_published(resolve_model_ref(ref, field=name), name), device)
        return cls(StepAudio2Token2Wav.seeded(preset or tiny_token2wav_config(), model_config.seed), device)

    # ---- voices ---------------------------------------------------------------------------------

    def has_voice(self, handle: str) -> bool:
        return handle in self.voices

    def add_voice(self, voice: VoiceConditioning) -> None:
        self.voices[voice.voice_id] = _conditioning(voice)
        self.voices.move_to_end(voice.voice_id)
        while len(self.voices) > MAX_CACHED_VOICES:
            self.voices.popitem(last=False)

    def set_default_voice(self, voice: VoiceConditioning) -> None:
        self.default_voice = _conditioning(voice)
        self._setups.pop("default", None)  # its post-prompt state was the old voice's

    def _voice(self, chunk: TokenChunk) -> tuple[str, Conditioning]:
        """(a key naming the voice, the voice): registered by handle, carried inline, or the default."""
        if chunk.voice_handle is not None:
            found = self.voices.get(chunk.voice_handle)
            if found is None:
                raise CacheMissError(f"request {chunk.req_id}: voice {chunk.voice_handle} is not on this replica")
            return f"handle:{chunk.voice_handle}", found
        if chunk.voice is not None:
            return f"inline:{chunk.voice.voice_id}", _conditioning(chunk.voice)
        return "default", self.default_voice

    def _new_stream(self, chunk: TokenChunk) -> Token2WavStream:
        key, voice = self._voice(chunk)
        setup = self._setups.get(key)
        if setup is None:
            setup = self._setups[key] = self.model.new_stream(voice)
            while len(self._setups) > MAX_SETUP_STATES:
                self._setups.popitem(last=False)
        self._setups.move_to_end(key)
        return setup.copy()

    # ---- offline --------------------------------------------------------------------------------

    def decode(self, frames: torch.Tensor, voice: VoiceConditioning | None = None) -> torch.Tensor:
        """frames [B, n, 1] -> audio [B, n * 960]: each row streamed in the published 25 + 3 chunks."""
        rows = []
        for i, row in enumerate(frames[..., 0].tolist()):
            rid = f"\0offline-{i}"
            starts = list(range(0, len(row), REBUILD_CHUNK_TOKENS)) or [0]
            chunks = [TokenChunk(rid, k, [[t] for t in row], 0, s, min(len(row), s + REBUILD_CHUNK_TOKENS),
                                 k == len(starts) - 1, voice=voice) for k, s in enumerate(starts)]  # fmt: skip
            try:
                rows.append(torch.cat(self.decode_stream(chunks)))
            finally:
                self.release(rid)
        return padded_rows(rows)

    # ---- streamed -------------------------------------------------------------------------------

    def release(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def cache_bytes(self, req_id: str) -> int:
        request = self._requests.get(req_id)
        return 0 if request is None else request.stream.nbytes

    @torch.inference_mode()
    def decode_stream(self, chunks: list[TokenChunk]) -> list[torch.Tensor]:
        """Audio of each chunk, in list order (a request's chunks in seq order): one round per chunk
        of each request, requests with equal cache shapes and chunk lengths batched."""
        for chunk in chunks:  # refuse bad ids before any state changes
            self._checked([f[0] for f in chunk.frames], "frames")
        out: list[torch.Tensor] = [torch.zeros(0)] * len(chunks)
        for round_ in chunk_rounds(chunks):
            work = {rid: self._take(chunks[i]) for rid, i in round_.items()}
            audio = self._run(work)
            for rid, index in round_.items():
                out[index] = audio.get(rid, torch.zeros(0))
                if chunks[index].is_final:
                    self._requests.pop(rid, None)
        return out

    def _take(self, chunk: TokenChunk) -> _Work:
        """The request's state ready for this chunk (rebuilt on a miss), and what the chunk asks of it."""
        request = self._requests.get(chunk.req_id)
        if request is None or request.next_keep != chunk.keep_start:
            request = self._rebuild(chunk)
        self._requests[chunk.req_id] = request
        request.pending += [f[0] for f in chunk.kept_frames]
        request.next_keep = chunk.keep_end
        lookahead = [f[0] for f in chunk.frames[chunk.keep_end - chunk.window_start :]][: self.config.pre_lookahead_len]
        return self._work(request, lookahead, chunk.is_final)

    def _work(self, request: _Request, lookahead: list[int], is_final: bool) -> _Work:
        if is_final:
            tokens, request.pending = request.pending, []
            return _Work(tuple(tokens), last_chunk=True) if tokens else _Work(flush=True)
        if len(lookahead) < self.config.pre_lookahead_len or len(request.pending) < MIN_CHUNK_TOKENS:
            return _Work()  # held: decoded with the next chunk
        tokens, request.pending = request.pending, []
        return _Work(tuple(tokens + lookahead))

    def _run(self, work: dict[str, _Work]) -> dict[str, torch.Tensor]:
        """Every request's flow call, grouped by cache shapes and chunk length -> audio per request."""
        groups: dict[tuple, list[str]] = defaultdict(list)
        audio: dict[str, torch.Tensor] = {}
        for rid, item in work.items():
            stream = self._requests[rid].stream
            if item.flush:
                audio[rid] = stream.vocoder.speech.float().cpu()
            elif item.tokens:
                groups[(stream.shape_key, len(item.tokens), item.last_chunk)].append(rid)
        for (_, _, last_chunk), rids in groups.items():
            streams = [self._requests[rid].stream for rid in rids]
            _, waves = self.model.advance(streams, [list(work[rid].tokens) for rid in rids], last_chunk)
            for rid, wave in zip(rids, waves, strict=True):
                audio[rid] = wave.float().cpu()
        return audio

    def _rebuild(self, chunk: TokenChunk) -> _Request:
        if chunk.keep_start > 0 and chunk.window_start != 0:
            raise CacheMissError(
                f"request {chunk.req_id} chunk {chunk.seq}: no cached state on this replica and the chunk's "
                f"history starts at token {chunk.window_start}, not 0"
            )
        request = _Request(self._new_stream(chunk))
        if chunk.keep_start == 0:
            return request
        self.num_rebuilds += 1
        tokens = [f[0] for f in chunk.frames]
        for start in range(0, chunk.keep_start, REBUILD_CHUNK_TOKENS):
            end = min(chunk.keep_start, start + REBUILD_CHUNK_TOKENS)
            request.pending += tokens[start:end]
            item = self._work(request, tokens[end : end + self.config.pre_lookahead_len], is_final=False)
            if item.tokens:  # the audio the earlier chunks carried, dropped
                self.model.advance([request.stream], [list(item.tokens)], last_chunk=False)
        request.next_keep = chunk.keep_start
        return request

    def _checked(self, tokens: list[int], field_name: str) -> list[int]:
        return checked_codes(tokens, self.codebook_size, field_name)


def _conditioning(voice: VoiceConditioning) -> Conditioning:
    return Conditioning(voice.prompt_tokens.long().cpu(), voice.prompt_mel.float().cpu(), voice.xvector.float().cpu())
