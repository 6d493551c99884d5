"""Step-Audio 2's vocoding of one streamed chunk: CosyVoice 2's 24 kHz HiFT (`detok_stage.flow.hift`'s
generator and F0 predictor, the published `hift.pt` names) with its `SineGen2` NSF source, run on
[the chunk before's last 8 mel frames, the chunk's mel], the source's first samples replaced by the
chunk before's, a Hamming cross-fade into the tail the chunk before held back, and its own last 3840
samples held back unless it is the last chunk. Called by `detok_stage.flow.step_audio2_model`.

Unlike `HiFTGenerator.advance` (exact streaming for S3Gen) the audio depends on where the chunks cut,
as the published streaming's does. The source's random draws (initial harmonic phases, noise, and
a noise the published module draws and drops) come from each stream's generator in the published
order, so a stream seeded as the reference seeds torch gives the reference's audio.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from detok_stage.flow.hift import HiFTGenerator


@dataclass(frozen=True)
class VocoderCache:
    """One stream's vocoder carry: the last mel frames [80, <= 8], source and held-back audio samples [<= 3840]."""

    mel: torch.Tensor
    source: torch.Tensor
    speech: torch.Tensor

    @property
    def shape_key(self) -> tuple[int, int, int]:
        return self.mel.shape[1], self.source.numel(), self.speech.numel()


def empty_vocoder_cache(mel_bins: int, device: torch.device | str = "cpu") -> VocoderCache:
    """A stream's first chunk has nothing before it (the published `set_stream_cache`)."""
    return VocoderCache(torch.zeros(mel_bins, 0, device=device), torch.zeros(0, device=device),
                        torch.zeros(0, device=device))  # fmt: skip


def sine_source(hift: HiFTGenerator, f0: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """f0 [N, T] (Hz per mel frame) -> merged NSF source [N, T * hop], `SineGen2`'s way: the per-sample
    phase increments are averaged down to one per frame, summed, and interpolated back up."""
    c, hop = hift.config, hift.hop
    f0_up = f0.repeat_interleave(hop, dim=1).unsqueeze(2)  # [N, S, 1]
    fn = f0_up * torch.arange(1, c.nb_harmonics + 2, device=f0.device, dtype=f0.dtype)
    rad = (fn / c.sampling_rate) % 1
    draws = [_draws(gen, rad.shape[1], c.nb_harmonics + 1) for gen in gens]
    initial = torch.cat([d[0] for d in draws]).to(rad.device)
    initial[:, 0] = 0
    rad[:, 0, :] = rad[:, 0, :] + initial
    rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / hop, mode="linear").transpose(1, 2)
    phase = torch.cumsum(rad, dim=1) * 2 * np.pi
    phase = F.interpolate(phase.transpose(1, 2) * hop, scale_factor=hop, mode="linear").transpose(1, 2)
    sines = torch.sin(phase) * c.nsf_alpha
    uv = (f0_up > c.nsf_voiced_threshold).type(f0.dtype)
    noise_amp = uv * c.nsf_sigma + (1 - uv) * c.nsf_alpha / 3
    waves = sines * uv + noise_amp * torch.cat([d[1] for d in draws]).to(rad.device)
    return torch.tanh(hift.m_source.l_linear(waves)).squeeze(2)


def _draws(gen: torch.Generator, samples: int, harmonics: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One stream's source draws in the published order: initial phases, noise, and the noise
    `SourceModuleHnNSF2` draws and does not use (drawn so the stream's later draws line up)."""
    initial = torch.rand(1, harmonics, generator=gen)
    # the published `randn_like` of a [1, samples, harmonics] view of [1, harmonics, samples] memory: filled
    # element by element in memory order (torch's path for a non-contiguous tensor), not as `randn` fills
    noise = torch.empty(1, harmonics, samples).transpose(1, 2).normal_(generator=gen)
    torch.empty(1, 1, samples).transpose(1, 2).normal_(generator=gen)
    return initial, noise


def hamming_halves(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-fade: a float64 Hamming window of 2 * samples, rising half then falling half."""
    window = torch.from_numpy(np.hamming(2 * samples))
    return window[:samples], window[samples:]


@torch.inference_mode()
def vocode_chunk(hift: HiFTGenerator, mel: torch.Tensor, caches: list[VocoderCache], gens: list[torch.Generator],
                 last_chunk: bool, mel_cache_frames: int) -> tuple[list[torch.Tensor], list[VocoderCache]]:  # fmt: skip
    """mel [N, 80, 2T] of N streams whose caches have equal shapes -> (audio [samples] per stream, their caches
    after); the cross-fade and the held-back tail are the `mel_cache_frames` frames' samples."""
    crossfade = mel_cache_frames * hift.hop
    cache_mel = torch.stack([c.mel for c in caches]).to(mel)
    full = torch.cat([cache_mel, mel], dim=2)
    source = sine_source(hift, hift.f0_predictor(full), gens)
    held_source = caches[0].source.numel()
    if held_source:
        source[:, :held_source] = torch.stack([c.source for c in caches]).to(source)
    speech = hift.decode(full, source)
    if caches[0].speech.numel():
        rising, falling = hamming_halves(crossfade)
        held = torch.stack([c.speech for c in caches]).double().cpu()
        head = speech[:, :crossfade].double().cpu() * rising + held[:, -crossfade:] * falling
        speech = torch.cat([head.to(speech), speech[:, crossfade:]], dim=1)
    after = [
        VocoderCache(full[i, :, -mel_cache_frames:], source[i, -crossfade:], speech[i, -crossfade:])
        for i in range(len(caches))
    ]  # fmt: skip
    if not last_chunk:
        speech = speech[:, :-crossfade]
    return list(speech), after


def flush(cache: VocoderCache) -> torch.Tensor:
    """A stream ending with no tokens left: the tail its last chunk held back, as it stood."""
    return cache.speech

