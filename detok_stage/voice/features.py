"""Audio front ends of the zero-shot voice encoders, in plain torch (no torchaudio / librosa).

`resample` (windowed-sinc, Hann window), `slaney_mel_filters` (librosa's default filterbank),
`whisper_log_mel` (the S3 speech tokenizer's 128-bin 16 kHz input), `kaldi_fbank` (CAM++'s 80-bin
16 kHz input, Kaldi's defaults), `s3gen_mel` (the flow's 80-bin 24 kHz prompt mel, hop 480),
`speaker_mel` and `trim_silence` (chatterbox's voice encoder: 40-bin 16 kHz mel power of the clip
without its leading / trailing silence).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

S3_SAMPLE_RATE_HZ = 16_000  # speech tokenizer and CAM++
S3GEN_SAMPLE_RATE_HZ = 24_000  # the flow's prompt mel


def resample(
    wave: torch.Tensor, from_hz: int, to_hz: int, taps_per_side: int = 6, rolloff: float = 0.99
) -> torch.Tensor:
    """wave [..., N] at `from_hz` -> [..., ceil(N * to_hz / from_hz)] at `to_hz`: a Hann-windowed sinc
    low-pass at `rolloff` of the lower Nyquist, one polyphase kernel per output phase."""
    if from_hz == to_hz:
        return wave
    gcd = math.gcd(from_hz, to_hz)
    up, down = to_hz // gcd, from_hz // gcd
    kernels, half_width = _sinc_kernels(up, down, taps_per_side, rolloff, wave.dtype)
    shape, length = wave.shape[:-1], wave.shape[-1]
    flat = F.pad(wave.reshape(-1, 1, length), (half_width, half_width + down))
    out = F.conv1d(flat, kernels.to(wave.device), stride=down)  # [B, up, T]
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)
    return out[:, : math.ceil(up * length / down)].reshape(*shape, -1)


@lru_cache(maxsize=8)
def _sinc_kernels(up: int, down: int, taps_per_side: int, rolloff: float, dtype: torch.dtype):
    cutoff = min(up, down) * rolloff
    half_width = math.ceil(taps_per_side * down / cutoff)
    offsets = torch.arange(-half_width, half_width + down, dtype=torch.float64) / down
    t = (-torch.arange(up, dtype=torch.float64)[:, None] / up + offsets[None, :]) * cutoff
    t = t.clamp(-taps_per_side, taps_per_side)
    window = torch.cos(t * math.pi / taps_per_side / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    return (sinc * window * cutoff / down).unsqueeze(1).to(dtype), half_width


def _hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    linear = hz / (200.0 / 3)
    log_part = 15.0 + torch.log(hz.clamp(min=1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return torch.where(hz >= 1000.0, log_part, linear)


def _slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    linear = mel * (200.0 / 3)
    log_part = 1000.0 * torch.exp((math.log(6.4) / 27.0) * (mel - 15.0))
    return torch.where(mel >= 15.0, log_part, linear)


@lru_cache(maxsize=8)
def slaney_mel_filters(
    sample_rate_hz: int, n_fft: int, n_mels: int, fmin_hz: float = 0.0, fmax_hz: float | None = None
):
    """[n_mels, n_fft // 2 + 1] triangular filters on the Slaney mel scale, area-normalised
    (librosa.filters.mel's defaults), computed in float64."""
    fmax_hz = sample_rate_hz / 2 if fmax_hz is None else fmax_hz
    fft_hz = torch.linspace(0, sample_rate_hz / 2, n_fft // 2 + 1, dtype=torch.float64)
    low, high = _hz_to_slaney_mel(torch.tensor([fmin_hz, fmax_hz], dtype=torch.float64))
    edges_hz = _slaney_mel_to_hz(torch.linspace(float(low), float(high), n_mels + 2, dtype=torch.float64))
    widths = edges_hz.diff()
    ramps = edges_hz[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = torch.clamp(torch.minimum(rising, falling), min=0.0)
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    return weights.float()


def whisper_log_mel(wave_16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """wave [N] at 16 kHz -> [n_mels, N // 160] log10 mel (n_fft 400, hop 160, centred), floored at
    8 below its max and scaled as (x + 4) / 4: the S3 speech tokenizer's input."""
    window = torch.hann_window(400, dtype=wave_16k.dtype, device=wave_16k.device)
    spec = torch.stft(wave_16k, 400, 160, window=window, return_complex=True)
    power = spec[..., :-1].abs() ** 2
    mel = slaney_mel_filters(S3_SAMPLE_RATE_HZ, 400, n_mels).to(power) @ power
    log_mel = torch.clamp(mel, min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


def _kaldi_mel(hz: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log1p(hz / 700.0)


@lru_cache(maxsize=4)
def kaldi_mel_banks(num_bins: int, padded_window: int, sample_rate_hz: int, low_hz: float = 20.0) -> torch.Tensor:
    """[num_bins, padded_window // 2 + 1] Kaldi's triangular mel banks (HTK mel, no normalisation)."""
    num_fft_bins = padded_window // 2
    low, high = _kaldi_mel(torch.tensor(low_hz)), _kaldi_mel(torch.tensor(sample_rate_hz / 2))
    delta = (high - low) / (num_bins + 1)
    index = torch.arange(num_bins, dtype=torch.float32)[:, None]
    left, center, right = low + index * delta, low + (index + 1) * delta, low + (index + 2) * delta
    mel = _kaldi_mel(sample_rate_hz / padded_window * torch.arange(num_fft_bins, dtype=torch.float32))[None, :]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    return F.pad(banks, (0, 1))


def kaldi_fbank(wave_16k: torch.Tensor, num_bins: int = 80) -> torch.Tensor:
    """wave [N] at 16 kHz (float, [-1, 1]) -> [frames, num_bins] log mel energies with Kaldi's
    defaults: 25 ms Povey windows every 10 ms (edges snipped), DC removed, pre-emphasis 0.97,
    power spectrum over a 512-point FFT, banks from 20 Hz to Nyquist, no dither."""
    window_len, shift, padded = 400, 160, 512
    if wave_16k.numel() < window_len:
        return wave_16k.new_zeros(0, num_bins)
    frames = wave_16k.unfold(0, window_len, shift)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - 0.97 * previous
    povey = torch.hann_window(window_len, periodic=False, dtype=frames.dtype, device=frames.device).pow(0.85)
    frames = F.pad(frames * povey, (0, padded - window_len))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    energies = power @ kaldi_mel_banks(num_bins, padded, S3_SAMPLE_RATE_HZ).to(power).T
    return torch.clamp(energies, min=torch.finfo(energies.dtype).eps).log()


def s3gen_mel(wave_24k: torch.Tensor, n_fft: int = 1920, hop: int = 480, n_mels: int = 80) -> torch.Tensor:
    """wave [N] at 24 kHz -> [N // hop, n_mels] natural-log mel magnitudes (reflect-padded, uncentred
    STFT, Hann window of n_fft, Slaney filters 0-8 kHz): the flow's prompt mel, 2 frames per token."""
    side = (n_fft - hop) // 2
    padded = F.pad(wave_24k[None, None], (side, side), mode="reflect")[0, 0]
    window = torch.hann_window(n_fft, dtype=wave_24k.dtype, device=wave_24k.device)
    spec = torch.view_as_real(torch.stft(padded, n_fft, hop, window=window, center=False, return_complex=True))
    magnitude = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    mel = slaney_mel_filters(S3GEN_SAMPLE_RATE_HZ, n_fft, n_mels, 0.0, 8000.0).to(magnitude) @ magnitude
    return torch.log(torch.clamp(mel, min=1e-5)).T


def speaker_mel(wave_16k: torch.Tensor, n_mels: int = 40) -> torch.Tensor:
    """wave [N] at 16 kHz -> [1 + N // 160, n_mels] mel power (|STFT|^2, n_fft 400, hop 160, centred with
    reflect padding, Slaney filters 0-8 kHz), unscaled and not logged: chatterbox's voice-encoder input."""
    window = torch.hann_window(400, dtype=wave_16k.dtype, device=wave_16k.device)
    spec = torch.stft(wave_16k, 400, 160, window=window, center=True, pad_mode="reflect", return_complex=True)
    power = spec.abs() ** 2  # [201, frames]
    return (slaney_mel_filters(S3_SAMPLE_RATE_HZ, 400, n_mels, 0.0, 8000.0).to(power) @ power).T


def trim_silence(wave: torch.Tensor, top_db: float = 20.0, frame_len: int = 2048, hop: int = 512) -> torch.Tensor:
    """`wave` [N] without its leading and trailing silence: frames (zero-padded, centred) whose RMS is
    within `top_db` of the loudest frame's are kept, from the first one's start to one hop past the
    last one's (librosa.effects.trim's rule; all silent -> empty)."""
    padded = F.pad(wave, (frame_len // 2, frame_len // 2))
    power = padded.unfold(0, frame_len, hop).pow(2).mean(dim=1)  # [1 + N // hop]
    floor = torch.tensor(1e-10, dtype=power.dtype)
    db = 10 * torch.log10(torch.maximum(power, floor)) - 10 * torch.log10(torch.maximum(power.max(), floor))
    loud = torch.nonzero(db > -top_db).flatten()
    if loud.numel() == 0:
        return wave[:0]
    return wave[int(loud[0]) * hop : min(wave.numel(), (int(loud[-1]) + 1) * hop)]
