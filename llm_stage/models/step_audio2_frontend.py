"""Step-Audio 2's front end on audio as it arrives (streamed microphone input): resampling to 16 kHz,
the cut into 25 s pieces and each piece's log-mel, computed piece by piece as PCM16 comes in, so at
the end of a turn only the last few frames and the encoder are left. `StreamedLogMel` frames in fixed
groups aligned from each piece's start (one STFT and one filter matmul of the same shape each), so
the result is bit-equal whatever the pieces; the step-audio2 adapter runs it on whole clips too.
Within float rounding (1e-7) of `piece_log_mel`, the published front end. Called by the Router's
microphone turns (`router.mic_turn`) and `llm_stage.models.step_audio2`.
"""

from __future__ import annotations

import numpy as np
import torch

from core.messages import AudioFeatures
from detok_stage.voice.features import slaney_mel_filters
from llm_stage.models.clip_audio import pcm16_wave
from llm_stage.models.step_audio2_encoder import MEL_PADDING_SAMPLES, PIECE_SAMPLES, SAMPLE_RATE_HZ
from llm_stage.models.stream_resample import StreamResampler

N_FFT, HOP = 400, 160
EDGE = N_FFT // 2  # the STFT's centring: reflect-padded on the left, zeros on the right (past the 479)
GROUP_FRAMES = 64  # frames per STFT call (640 ms): how far the front end may lag the audio it was given
GROUP_SAMPLES = (GROUP_FRAMES - 1) * HOP + N_FFT


def front_end_name(n_mels: int) -> str:
    """Names the features a Job may carry; the adapter uses them only when they name its own front end."""
    return f"step-audio2/log-mel-{n_mels}/v1"


class StreamedLogMel:
    """One 25 s piece of 16 kHz audio -> its log-mel [n_mels, frames], fed in pieces.

    Frame f reads the centred signal [f*160 - 200, f*160 + 200): the piece's samples 1..200 reflected
    on the left, the 479 appended zeros (and the STFT's own right padding, zeros too) on the right.
    The buffer is allocated once, zeros past the samples: that is the right padding."""

    def __init__(self, n_mels: int) -> None:
        self.filters = slaney_mel_filters(SAMPLE_RATE_HZ, N_FFT, n_mels)  # [n_mels, 201]
        self.window = torch.hann_window(N_FFT)
        self.centred = torch.zeros(EDGE + PIECE_SAMPLES + MEL_PADDING_SAMPLES + EDGE + GROUP_SAMPLES)
        self.num_samples = 0
        self.groups: list[torch.Tensor] = []  # unfloored log10 mel per group [n_mels, GROUP_FRAMES]

    def push(self, samples: torch.Tensor) -> None:
        """Append at most the piece's remaining room; compute every group whose samples all came."""
        end = self.num_samples + samples.numel()
        self.centred[EDGE + self.num_samples : EDGE + end] = samples
        self.num_samples = end
        if self.num_samples <= EDGE:
            return  # the left reflection needs samples 1..200
        self._reflect_left()
        while self._group_start(len(self.groups)) + GROUP_SAMPLES <= EDGE + self.num_samples:
            self._group()

    def finish(self) -> torch.Tensor:
        """The piece's log-mel, floored at 8 below its max and scaled as published."""
        self._reflect_left()  # a piece under 201 samples reflects its appended zeros too
        num_frames = (self.num_samples + MEL_PADDING_SAMPLES) // HOP  # the STFT's last frame is dropped
        while len(self.groups) * GROUP_FRAMES < num_frames:
            self._group()
        log_mel = torch.cat(self.groups, dim=1)[:, :num_frames]
        log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
        return (log_mel + 4.0) / 4.0

    def _reflect_left(self) -> None:
        self.centred[:EDGE] = self.centred[EDGE + 1 : 2 * EDGE + 1].flip(0)

    @staticmethod
    def _group_start(index: int) -> int:
        return index * GROUP_FRAMES * HOP

    def _group(self) -> None:
        start = self._group_start(len(self.groups))
        segment = self.centred[start : start + GROUP_SAMPLES]
        spec = torch.stft(segment, N_FFT, HOP, window=self.window, center=False, return_complex=True)
        mel = self.filters @ (spec.abs() ** 2)  # [n_mels, GROUP_FRAMES]
        self.groups.append(torch.clamp(mel, min=1e-10).log10())


class MicFrontEnd:
    """A turn's audio, PCM16 at `sample_rate_hz`, pushed in pieces -> `AudioFeatures` (one log-mel per 25 s
    piece) at `finish`. Everything but the turn's last 640 ms of frames (and 0.5 s of resampling) is done by then."""

    def __init__(self, sample_rate_hz: int, n_mels: int = 128) -> None:
        self.n_mels = n_mels
        self.resampler = StreamResampler(sample_rate_hz, SAMPLE_RATE_HZ)
        self.pieces: list[StreamedLogMel] = [StreamedLogMel(n_mels)]
        self.mels: list[torch.Tensor] = []  # finished pieces

    def push_pcm16(self, pcm16: bytes) -> None:
        self._feed(self.resampler.push(pcm16_wave(pcm16)))

    def push_wave(self, wave: torch.Tensor) -> None:
        """Float samples [N] in [-1, 1] at the turn's rate (the adapter's whole-clip path)."""
        self._feed(self.resampler.push(wave))

    def finish(self) -> AudioFeatures:
        self._feed(self.resampler.finish())
        last = self.pieces[-1]
        if last.num_samples or not self.mels:
            self.mels.append(last.finish())
        arrays = tuple(m.numpy().astype(np.float32, copy=False) for m in self.mels)
        return AudioFeatures(front_end_name(self.n_mels), arrays)

    def _feed(self, wave_16k: torch.Tensor) -> None:
        """Fill the current 25 s piece; a full one is finished and the next begun."""
        while wave_16k.numel():
            piece = self.pieces[-1]
            room = PIECE_SAMPLES - piece.num_samples
            piece.push(wave_16k[:room])
            wave_16k = wave_16k[room:]
            if piece.num_samples == PIECE_SAMPLES and wave_16k.numel():
                self.mels.append(piece.finish())
                self.pieces.append(StreamedLogMel(self.n_mels))


def whole_clip_features(wave: torch.Tensor, sample_rate_hz: int, n_mels: int) -> AudioFeatures:
    """A whole clip through the same front end (float samples [N] at its own rate)."""
    front = MicFrontEnd(sample_rate_hz, n_mels)
    front.push_wave(wave)
    return front.finish()
