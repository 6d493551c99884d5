"""GLM-4-Voice's speech tokenizer on microphone audio as it arrives: each 4 s attention block is encoded
as soon as its audio is in, so at the end of a turn only the last block (and any block the turn's
loudness invalidated) is left. Called by the Router's microphone turns once the glm4-voice family is wired.

Why it is exact: the published encoder's convs are causal and its attention block-causal (a block reads
its own and earlier blocks), so a block's outputs depend on its own and earlier log-mel frames alone,
except through the log-mel floor (8 below the 30 s window's max, known only at its end). A block encoded
early records the floor it used; at the end it is kept only if its floored frames are the final ones (the
max did not move, or none of its frames lies under the final floor), else it and every later block are
encoded again. `MicTokenizer` and `whole_clip_tokens` run the same block computation on the same shapes,
so their tokens are bit-equal whatever the pieces; both equal `SpeechTokenizer.tokens` to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.errors import InvalidArgumentError
from detok_stage.voice.features import slaney_mel_filters
from llm_stage.models.clip_audio import pcm16_wave
from llm_stage.models.glm4_voice_tokenizer import (
    FIELD,
    HOP_SAMPLES,
    N_FFT,
    SAMPLE_RATE_HZ,
    WINDOW_SAMPLES,
    SpeechTokenizer,
    check_clip,
)
from llm_stage.models.stream_resample import StreamResampler

EDGE = N_FFT // 2  # the STFT's centring: reflected on both sides of the (padded) window
FLOOR_DB = 8.0  # log10 units under the window's max


@dataclass
class EncodedBlock:
    """One block's token ids and the floor its frames were floored at."""

    ids: torch.Tensor
    floor: float


class WindowStream:
    """One 30 s window fed in pieces -> its token ids. Log-mel in groups of one block's frames (2 x block
    conv frames) from the centred signal, a group once every sample it reads has come."""

    def __init__(self, tokenizer: SpeechTokenizer) -> None:
        shape = tokenizer.shape
        check_streamable(tokenizer)
        self.tok, self.block = tokenizer, shape.quantize_causal_block_size
        self.group_frames = 2 * self.block
        self.filters = slaney_mel_filters(SAMPLE_RATE_HZ, N_FFT, shape.num_mel_bins)
        self.window = torch.hann_window(N_FFT)
        self.centred = torch.zeros(EDGE + WINDOW_SAMPLES + shape.samples_per_token + EDGE)
        self.num_samples = 0
        self.num_encoded_at_finish = 0  # blocks `finish` had left to encode (the end-of-turn work)
        self.raw: list[torch.Tensor] = []  # unfloored log10 mel per group [n_mels, frames]
        self.blocks: list[EncodedBlock] = []
        self.past: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(tokenizer.layers)  # to the last block

    @property
    def room(self) -> int:
        return WINDOW_SAMPLES - self.num_samples

    def push(self, samples: torch.Tensor) -> None:
        """Append at most `room` samples; compute every whole group, and encode every block it completes."""
        end = self.num_samples + samples.numel()
        self.centred[EDGE + self.num_samples : EDGE + end] = samples
        self.num_samples = end
        if self.num_samples <= EDGE:
            return  # the left reflection needs samples 1..200
        self._reflect_left()
        while self._group_end(len(self.raw)) <= EDGE + self.num_samples:
            self._group(self.group_frames)
        while len(self.blocks) < len(self.raw) and self.num_samples < WINDOW_SAMPLES:
            self._encode(len(self.blocks), self._floor(), is_last=False)

    def finish(self) -> torch.Tensor:
        """The window's token ids: the right edge padded as the extractor pads it, stale blocks encoded again."""
        self._reflect_left()
        per_token = self.tok.shape.samples_per_token
        padded = self.num_samples + (-self.num_samples % per_token)
        self.centred[EDGE + padded : 2 * EDGE + padded] = self.centred[padded - 1 : padded - 1 + EDGE].flip(0)
        num_frames = padded // HOP_SAMPLES  # the centred STFT's last frame is dropped, as published
        while len(self.raw) * self.group_frames < num_frames:
            self._group(min(self.group_frames, num_frames - len(self.raw) * self.group_frames))
        floor = self._floor()
        self._drop_from(self._first_stale(floor))
        num_blocks = -(-num_frames // self.group_frames)
        self.num_encoded_at_finish = num_blocks - len(self.blocks)
        while len(self.blocks) < num_blocks:
            self._encode(len(self.blocks), floor, is_last=len(self.blocks) == num_blocks - 1)
        return torch.cat([b.ids for b in self.blocks])

    def _reflect_left(self) -> None:
        self.centred[:EDGE] = self.centred[EDGE + 1 : 2 * EDGE + 1].flip(0)

    def _group_end(self, index: int) -> int:
        """The centred sample whole group `index` reads up to (exclusive): 40 samples past its last hop."""
        return ((index + 1) * self.group_frames - 1) * HOP_SAMPLES + N_FFT

    def _group(self, frames: int) -> None:
        start = len(self.raw) * self.group_frames * HOP_SAMPLES
        segment = self.centred[start : start + (frames - 1) * HOP_SAMPLES + N_FFT]
        spec = torch.stft(segment, N_FFT, HOP_SAMPLES, window=self.window, center=False, return_complex=True)
        mel = self.filters @ (spec.abs() ** 2)  # [n_mels, frames]
        self.raw.append(torch.clamp(mel, min=1e-10).log10())

    def _floor(self) -> float:
        """8 under the max of the frames so far, in float32 as the published front end computes it."""
        return float(torch.stack([g.max() for g in self.raw]).max() - FLOOR_DB)

    def _drop_from(self, index: int) -> None:
        """Forget blocks from `index` on, and their keys / values."""
        del self.blocks[index:]
        keep = index * self.block
        self.past = [None if not keep or kv is None else (kv[0][:, :, :keep], kv[1][:, :, :keep]) for kv in self.past]

    def _first_stale(self, floor: float) -> int:
        """The first block whose frames floor differently at the final floor (every later one reads it)."""
        for index, block in enumerate(self.blocks):
            if block.floor != floor and float(self._frames(index).min()) < floor:
                return index
        return len(self.blocks)

    def _frames(self, index: int) -> torch.Tensor:
        """Unfloored mel frames block `index`'s convs read: [2 jb - 4, 2 je - 1) from frame 0 on."""
        first = index * self.group_frames - 4
        frames = torch.cat(self.raw[max(0, index - 1) : index + 1], dim=1)
        offset = max(0, index - 1) * self.group_frames
        end = min((index + 1) * self.group_frames - 1, offset + frames.shape[1])
        return frames[:, max(0, first - offset) : end - offset]

    def _encode(self, index: int, floor: float, is_last: bool) -> None:
        """Block `index` (conv frames [jb, je)) through convs, layers on the earlier blocks' keys, pool, VQ."""
        tok, shape = self.tok, self.tok.shape
        param = tok.conv1.weight
        mel = (torch.maximum(self._frames(index), torch.tensor(floor)) + 4.0) / 4.0
        if index == 0:
            mel = F.pad(mel, (4, 0))  # the causal convs' left zeros
        x = F.gelu(F.conv1d(mel[None].to(param), param, tok.conv1.bias))  # conv1 outputs [2 jb - 2, 2 je - 1)
        if index == 0:
            x[..., :2] = 0.0  # conv2's left padding is zeros, not conv1 of zeros
        x = F.gelu(F.conv1d(x, tok.conv2.weight, tok.conv2.bias, stride=2)).transpose(1, 2)  # [1, L, D]
        start = index * self.block
        x = x + tok.embed_positions.weight[start : start + x.shape[1]]
        key_valid = None
        if is_last:  # keys past the audio are masked: conv frame j starts on sample 320 j
            frames = torch.arange(start + x.shape[1], device=x.device)
            key_valid = 2 * HOP_SAMPLES * frames < self.num_samples
        for i, layer in enumerate(tok.layers):
            x, self.past[i] = layer.forward_cached(x, self.past[i], key_valid)
        pool = shape.pool
        x = F.pad(x.transpose(1, 2), (0, -x.shape[1] % pool))
        pooled = (F.avg_pool1d if shape.pooling_type == "avg" else F.max_pool1d)(x, pool).transpose(1, 2)
        ids = tok.quantize(pooled)[0]
        if is_last:  # tokens kept: those whose first conv frame holds audio
            ids = ids[: -(-self.num_samples // shape.samples_per_token) - start // pool]
        self.blocks.append(EncodedBlock(ids.cpu(), floor))


class MicTokenizer:
    """A turn's audio pushed in pieces -> its GLM-4-Voice token ids at `finish`: 30 s windows, each block
    of a window encoded once its audio is in. PCM16 at `sample_rate_hz` is resampled to 16 kHz as it comes."""

    def __init__(self, tokenizer: SpeechTokenizer, sample_rate_hz: int = SAMPLE_RATE_HZ) -> None:
        check_streamable(tokenizer)
        self.tokenizer = tokenizer
        self.resampler = None if sample_rate_hz == SAMPLE_RATE_HZ else StreamResampler(sample_rate_hz, SAMPLE_RATE_HZ)
        self.window = WindowStream(tokenizer)
        self.done: list[torch.Tensor] = []  # finished windows' ids
        self.num_samples = 0

    def push_pcm16(self, pcm16: bytes) -> None:
        self.push_wave(pcm16_wave(pcm16))

    def push_wave(self, wave: torch.Tensor) -> None:
        """Float samples [N] at the turn's rate."""
        if wave.numel():
            check_clip(wave, FIELD)
        self._feed(self.resampler.push(wave.float()) if self.resampler else wave.float())

    @torch.inference_mode()
    def finish(self) -> torch.LongTensor:
        if self.resampler:
            self._feed(self.resampler.finish())
        if self.num_samples == 0:
            raise InvalidArgumentError(FIELD, "is empty")
        if self.window.num_samples:
            self.done.append(self.window.finish())
        return torch.cat(self.done)

    @torch.inference_mode()
    def _feed(self, wave_16k: torch.Tensor) -> None:
        self.num_samples += wave_16k.numel()
        while wave_16k.numel():
            room = self.window.room
            self.window.push(wave_16k[:room])
            wave_16k = wave_16k[room:]
            if self.window.room == 0:  # a full window's tokens are final
                self.done.append(self.window.finish())
                self.window = WindowStream(self.tokenizer)


def whole_clip_tokens(tokenizer: SpeechTokenizer, clip_16k: torch.Tensor) -> torch.LongTensor:
    """A whole 16 kHz clip through the streamed path (what `MicTokenizer` gives, however it is cut)."""
    check_clip(clip_16k, FIELD)
    mic = MicTokenizer(tokenizer)
    mic.push_wave(clip_16k)
    return mic.finish()


def check_streamable(tokenizer: SpeechTokenizer) -> None:
    """The streamed path needs the published structure: causal convs, block-causal bidirectional layers, the
    pooling and the quantizer after the last layer, blocks a whole number of tokens."""
    shape = tokenizer.shape
    block = shape.quantize_causal_block_size
    if not (
        shape.encoder_causal_convolution
        and block
        and not (shape.encoder_causal_attention or shape.quantize_causal_encoder)
        and shape.pooling_position == shape.quantize_position
        and block % shape.pool == 0
    ):
        raise ValueError("streamed tokens need causal convs, block-causal attention and pooling at the quantizer")
