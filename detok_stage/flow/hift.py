"""Mel -> 24 kHz wave: CosyVoice 2's `HiFTGenerator` (NSF harmonic source + iSTFT HiFi-GAN), offline
and streamed exactly.

The published vocoder is not causal: its convs look both ways, the F0 predictor too, and the sine
source's phase is the running sum of F0 over the whole utterance. Streamed, `advance` therefore
(1) predicts F0 only for frames whose `F0_RADIUS` right context exists, (2) extends the sine source
from a carried phase (summed in float64, as the offline path does), with harmonic phases and noise
fixed by seed and sample position, and (3) runs the generator on a window reaching
`decode_radius` frames either side of the frames it emits. Every emitted sample then equals the
offline one; the last `decode_radius + F0_RADIUS` frames wait for the next chunk (or the end).
`advance_many` runs the F0 predictor, the source and the generator once per group of requests whose
windows match, and the NSF noise (a function of the sample position) is drawn once per replica and
kept on the device. Parameter names follow the published `hift.pt` (chatterbox: `mel2wav.*`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from detok_stage.flow.config import HiftConfig

F0_RADIUS = 5  # five kernel-3 convs in the F0 predictor
NOISE_BLOCK = 4800  # NSF noise is drawn per block of samples, keyed by (seed, block)


def nsf_phases(seed: int, harmonics: int) -> torch.Tensor:
    """Initial phase of each harmonic (the fundamental's is 0), as the published U(-pi, pi) draw."""
    gen = torch.Generator().manual_seed(seed * 2 + 1)
    phases = (torch.rand(harmonics + 1, generator=gen) * 2 - 1) * math.pi
    phases[0] = 0.0
    return phases


def nsf_noise(seed: int, start: int, length: int, harmonics: int) -> torch.Tensor:
    """Unit Gaussian noise [harmonics + 1, length] for samples [start, start + length), by position."""
    if length <= 0:
        return torch.zeros(harmonics + 1, 0)
    first, last = start // NOISE_BLOCK, (start + length - 1) // NOISE_BLOCK
    blocks = []
    for b in range(first, last + 1):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * b + 17)
        blocks.append(torch.randn(harmonics + 1, NOISE_BLOCK, generator=gen))
    joined = torch.cat(blocks, dim=1)
    offset = start - first * NOISE_BLOCK
    return joined[:, offset : offset + length]


def get_padding(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            [
                weight_norm(
                    nn.Conv1d(channels, channels, kernel_size, 1, dilation=d, padding=get_padding(kernel_size, d))
                )
                for d in dilations
            ]
        )
        self.convs2 = nn.ModuleList(
            [
                weight_norm(nn.Conv1d(channels, channels, kernel_size, 1, padding=get_padding(kernel_size)))
                for _ in dilations
            ]
        )
        self.activations1 = nn.ModuleList([Snake(channels) for _ in dilations])
        self.activations2 = nn.ModuleList([Snake(channels) for _ in dilations])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True):
            x = x + c2(a2(c1(a1(x))))
        return x

    @staticmethod
    def radius(kernel_size: int, dilations: tuple[int, ...]) -> int:
        return sum(get_padding(kernel_size, d) + get_padding(kernel_size) for d in dilations)


class ConvRNNF0Predictor(nn.Module):
    def __init__(self, in_channels: int = 80, cond_channels: int = 512) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(F0_RADIUS):
            layers += [
                weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)),
                nn.ELU(),
            ]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.abs(self.classifier(self.condnet(x).transpose(1, 2)).squeeze(-1))


class SourceModuleHnNSF(nn.Module):
    def __init__(self, harmonics: int) -> None:
        super().__init__()
        self.l_linear = nn.Linear(harmonics + 1, 1)


@dataclass
class HiftState:
    """One request's vocoder state (frames are mel frames from the stream's start)."""

    mel: torch.Tensor  # [80, n] frames [mel_base, mel_base + n)
    mel_base: int = 0
    f0_done: int = 0  # frames whose F0 and source exist
    phase: torch.Tensor | None = None  # [H + 1] float64 running phase (cycles, mod 1) at f0_done
    source: torch.Tensor | None = None  # [samples] source of frames [source_base, f0_done)
    source_base: int = 0
    audio_done: int = 0  # frames whose audio was emitted


class HiFTGenerator(nn.Module):
    def __init__(self, config: HiftConfig, nsf_seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.nsf_seed = nsf_seed
        base = config.base_channels
        self.m_source = SourceModuleHnNSF(config.nb_harmonics)
        self.conv_pre = weight_norm(nn.Conv1d(config.in_channels, base, 7, 1, padding=3))
        self.ups = nn.ModuleList()
        for i, (u, k) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True)):
            self.ups.append(
                weight_norm(nn.ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            )
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        rates = list(config.upsample_rates)
        cum = np.cumprod([1] + rates[::-1][:-1])[::-1]
        n_fft = config.istft_n_fft
        for i, (u, k, d) in enumerate(
            zip(cum, config.source_resblock_kernel_sizes, config.source_resblock_dilation_sizes, strict=False)
        ):
            u = int(u)
            ch = base // 2 ** (i + 1)
            conv = nn.Conv1d(n_fft + 2, ch, 1, 1) if u == 1 else nn.Conv1d(n_fft + 2, ch, u * 2, u, padding=u // 2)
            self.source_downs.append(conv)
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList()
        for i in range(len(self.ups)):
            ch = base // 2 ** (i + 1)
            for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True):
                self.resblocks.append(ResBlock(ch, k, d))
        self.conv_post = weight_norm(nn.Conv1d(ch, n_fft + 2, 7, 1, padding=3))
        self.f0_predictor = ConvRNNF0Predictor(config.in_channels, config.f0_channels)
        self.register_buffer("stft_window", torch.hann_window(n_fft, periodic=True), persistent=False)
        self.register_buffer("phases", nsf_phases(nsf_seed, config.nb_harmonics).double(), persistent=False)
        self.register_buffer("_noise", torch.zeros(config.nb_harmonics + 1, 0), persistent=False)
        self.decode_radius = self._decode_radius()

    @property
    def hop(self) -> int:
        return self.config.hop

    def _decode_radius(self) -> int:
        """Mel frames either side that can reach a sample of `decode` (a safe over-estimate: the mel
        and source paths' reaches added as if in series)."""
        c = self.config
        reach = 3.0  # conv_pre
        rate = 1
        for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes, strict=True)):
            reach += math.ceil(k / u) / rate
            rate *= u
            reach += (
                max(
                    ResBlock.radius(k2, d)
                    for k2, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes, strict=True)
                )
                / rate
            )
            reach += ResBlock.radius(c.source_resblock_kernel_sizes[i], c.source_resblock_dilation_sizes[i]) / rate
        stft_rate = rate  # iSTFT frames per mel frame
        reach += (1 + 3 + c.istft_n_fft // c.istft_hop) / stft_rate  # reflection pad, conv_post, iSTFT overlap
        reach += 2 * max(c.upsample_rates) / stft_rate + c.istft_n_fft / self.hop  # source downs, source STFT
        return math.ceil(reach) + 1

    # ---- source ---------------------------------------------------------------------------------

    def source(
        self, f0: torch.Tensor, start_samples: list[int], phase: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 [G, frames] of G requests whose frames start at samples `start_samples`, running phases
        [G, H+1] (cycles) -> (source samples [G, frames * hop], phases after them)."""
        c = self.config
        f0_up = f0.repeat_interleave(self.hop, dim=1).double()  # [G, S]
        harm = torch.arange(1, c.nb_harmonics + 2, dtype=torch.float64, device=f0.device).view(1, -1, 1)
        cycles = phase.unsqueeze(2) + torch.cumsum(f0_up.unsqueeze(1) * harm / c.sampling_rate, dim=2)
        theta = 2 * math.pi * (cycles % 1)
        sine = c.nsf_alpha * torch.sin(theta + self.phases.view(1, -1, 1))
        uv = (f0_up > c.nsf_voiced_threshold).double().unsqueeze(1)
        noise_amp = uv * c.nsf_sigma + (1 - uv) * c.nsf_alpha / 3
        noise = self._noise_at(start_samples, f0_up.shape[1]).double()
        waves = (sine * uv + noise_amp * noise).float()  # [G, H+1, S]
        merged = torch.tanh(self.m_source.l_linear(waves.transpose(1, 2))).squeeze(-1)
        return merged, cycles[:, :, -1] % 1

    def _noise_at(self, start_samples: list[int], length: int) -> torch.Tensor:
        """`nsf_noise` of each request's samples [start, start + length): [G, H+1, length], gathered from
        blocks drawn once per replica (the noise depends on the position only) and kept on the device."""
        end = max(start_samples) + length
        have = self._noise.shape[1]
        if end > have:
            blocks = -(-end // NOISE_BLOCK)
            more = nsf_noise(self.nsf_seed, have, blocks * NOISE_BLOCK - have, self.config.nb_harmonics)
            self._noise = torch.cat([self._noise, more.to(self._noise)], dim=1)
        starts = torch.tensor(start_samples, dtype=torch.long).to(self._noise.device, non_blocking=True)
        index = starts.unsqueeze(1) + torch.arange(length, device=self._noise.device)  # [G, length]
        return self._noise[:, index].transpose(0, 1)

    # ---- generator ------------------------------------------------------------------------------

    def decode(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, T], source [B, T * hop] -> wave [B, T * hop]."""
        c = self.config
        n_fft, hop = c.istft_n_fft, c.istft_hop
        spec = torch.view_as_real(torch.stft(s, n_fft, hop, n_fft, window=self.stft_window, return_complex=True))
        s_stft = torch.cat([spec[..., 0], spec[..., 1]], dim=1)
        x = self.conv_pre(x)
        kernels = len(c.resblock_kernel_sizes)
        for i in range(len(self.ups)):
            x = F.leaky_relu(x, c.lrelu_slope)
            x = self.ups[i](x)
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                xs = xs + self.resblocks[i * kernels + j](x)
            x = xs / kernels
        x = self.conv_post(F.leaky_relu(x))
        magnitude = torch.exp(x[:, : n_fft // 2 + 1]).clip(max=1e2)
        phase = torch.sin(x[:, n_fft // 2 + 1 :])
        wave = torch.istft(
            torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase)),
            n_fft,
            hop,
            n_fft,
            window=self.stft_window,
        )
        return wave.clamp(-c.audio_limit, c.audio_limit)

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor) -> torch.Tensor:
        """Offline: mel [B, 80, T] -> wave [B, T * hop]."""
        f0 = self.f0_predictor(mel)
        zero = torch.zeros(f0.shape[0], self.config.nb_harmonics + 1, dtype=torch.float64, device=mel.device)
        return self.decode(mel, self.source(f0, [0] * f0.shape[0], zero)[0])

    # ---- streamed -------------------------------------------------------------------------------

    def new_state(self) -> HiftState:
        return HiftState(mel=torch.zeros(self.config.in_channels, 0, device=self.stft_window.device))

    @torch.inference_mode()
    def advance(self, state: HiftState, mel: torch.Tensor, final: bool) -> torch.Tensor:
        """Append mel [80, n] to one request's stream -> the wave samples that are now exact (all at `final`)."""
        return self.advance_many([(state, mel, final)])[0]

    @torch.inference_mode()
    def advance_many(self, items: list[tuple[HiftState, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """`advance` for many requests, batched (rows are independent, so batching changes nothing): F0 and
        source over the requests whose windows have the same lengths, the generator over those whose
        windows have the same length."""
        assert len({id(state) for state, _, _ in items}) == len(items), "one item per request"
        for state, mel, _ in items:
            state.mel = torch.cat([state.mel, mel.to(state.mel)], dim=1)
        self._extend_sources(items)
        outs = [self.phases.new_zeros(0).float() for _ in items]
        hop, r = self.hop, self.decode_radius
        windows: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, int, int]]] = {}
        for index, (state, _, final) in enumerate(items):
            total = state.mel_base + state.mel.shape[1]
            # the generator's window: wide enough that the frames it emits are exact
            limit = total if final else min(total, state.f0_done) - r
            if limit > state.audio_done:
                ws = max(0, state.audio_done - r)
                we = total if final else limit + r
                assert state.source is not None
                x = state.mel[:, ws - state.mel_base : we - state.mel_base]
                src = state.source[(ws - state.source_base) * hop : (we - state.source_base) * hop]
                windows.setdefault(we - ws, []).append((index, x, src, state.audio_done - ws, limit - ws))
                state.audio_done = limit
            self._forget(state)
        for group in windows.values():
            waves = self.decode(torch.stack([g[1] for g in group]), torch.stack([g[2] for g in group]))
            for (index, _, _, a, b), wave in zip(group, waves, strict=True):
                outs[index] = wave[a * hop : b * hop]
        return outs

    def _extend_sources(self, items: list[tuple[HiftState, torch.Tensor, bool]]) -> None:
        """F0 and source of each request's frames whose F0 predictor context is now complete, one F0
        forward and one source per group of requests with equal window and frame counts."""
        groups: dict[tuple[int, int, int], list[tuple[HiftState, int, int]]] = {}
        for state, _, final in items:
            total = state.mel_base + state.mel.shape[1]
            f0_limit = total if final else total - F0_RADIUS
            if f0_limit > state.f0_done:
                ws = max(0, state.f0_done - F0_RADIUS)
                key = (total - ws, state.f0_done - ws, f0_limit - state.f0_done)  # window, context, new frames
                groups.setdefault(key, []).append((state, ws, f0_limit))
        harmonics = self.config.nb_harmonics + 1
        for (_, skip, count), group in groups.items():
            mels = torch.stack([state.mel[:, ws - state.mel_base :] for state, ws, _ in group])
            f0 = self.f0_predictor(mels)[:, skip : skip + count]
            zero = self.phases.new_zeros(harmonics)
            phases = torch.stack([state.phase if state.phase is not None else zero for state, _, _ in group])
            src, after = self.source(f0, [state.f0_done * self.hop for state, _, _ in group], phases)
            for (state, _, f0_limit), row, phase in zip(group, src, after, strict=True):
                state.source = row if state.source is None else torch.cat([state.source, row])
                state.phase = phase
                state.f0_done = f0_limit

    def _forget(self, state: HiftState) -> None:
        """Drop the mel and source no later window reaches (windows already cut hold their own views)."""
        hop, r = self.hop, self.decode_radius
        keep_from = max(0, min(state.audio_done - r, state.f0_done - F0_RADIUS))
        if keep_from > state.mel_base:
            state.mel = state.mel[:, keep_from - state.mel_base :]
            state.mel_base = keep_from
        src_from = max(0, state.audio_done - r)
        if state.source is not None and src_from > state.source_base:
            state.source = state.source[(src_from - state.source_base) * hop :]
            state.source_base = src_from
