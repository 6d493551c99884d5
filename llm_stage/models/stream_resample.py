"""Resampling of audio that arrives in pieces, the same bits however it is cut: `StreamResampler`
runs the polyphase sinc filter of `detok_stage.voice.features.resample` (same kernels, same zero
padding) in fixed groups of output blocks aligned from the signal's start, each group one conv1d of
the same shape, so a signal pushed whole or in any pieces gives identical samples (a conv over a
longer input may pick another kernel order and differ in the last bit). Used by the streamed
speech-in front end (`llm_stage.models.step_audio2_frontend`), for whole clips too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from detok_stage.voice.features import _sinc_kernels

GROUP_OUTPUT_SAMPLES = 8000  # output samples per conv call (0.5 s at 16 kHz): how far the output may lag


class StreamResampler:
    """`push(samples)` -> output samples no later input can change; `finish()` -> the rest.
    Output block t (`up` samples) reads padded input [t*down, t*down + width)."""

    def __init__(self, from_hz: int, to_hz: int, taps_per_side: int = 6, rolloff: float = 0.99) -> None:
        self.is_identity = from_hz == to_hz
        gcd = math.gcd(from_hz, to_hz)
        self.up, self.down = to_hz // gcd, from_hz // gcd
        self.kernels, half = (None, 0) if self.is_identity else _sinc_kernels(
            self.up, self.down, taps_per_side, rolloff, torch.float32)  # fmt: skip
        self.width = 2 * half + self.down  # padded input samples one output block reads
        self.group_blocks = max(1, math.ceil(GROUP_OUTPUT_SAMPLES / self.up))
        self.group_input = (self.group_blocks - 1) * self.down + self.width
        self.right_padding = half + self.down
        self.pending = torch.zeros(half)  # padded input from the next group's first block on
        self.num_in = 0
        self.num_out = 0

    def push(self, samples: torch.Tensor) -> torch.Tensor:
        """samples [N] float32 -> the resampled samples now final (empty until a group fills)."""
        self.num_in += samples.numel()
        if self.is_identity:
            self.num_out += samples.numel()
            return samples
        self.pending = torch.cat([self.pending, samples])
        return self._groups(is_final=False)

    def finish(self) -> torch.Tensor:
        """The rest: the right zero padding, the last group zero-filled, cut at the whole signal's length."""
        if self.is_identity:
            return torch.zeros(0)
        total = math.ceil(self.up * self.num_in / self.down)
        self.pending = torch.cat([self.pending, torch.zeros(self.right_padding)])
        tail = self._groups(is_final=True)[: max(total - self.num_out, 0)]
        self.num_out = total
        return tail

    def _groups(self, is_final: bool) -> torch.Tensor:
        """Every whole group the pending input holds (and, at the end, the last one zero-filled)."""
        out = []
        while self.pending.numel() >= self.group_input or (is_final and self.pending.numel() > 0):
            window = self.pending[: self.group_input]
            window = F.pad(window, (0, self.group_input - window.numel()))
            group = F.conv1d(window.view(1, 1, -1), self.kernels, stride=self.down)  # [1, up, group_blocks]
            out.append(group.transpose(1, 2).reshape(-1))
            self.pending = self.pending[self.group_blocks * self.down :]
            if is_final and self.pending.numel() <= self.width - self.down:
                break  # what is left is padding only: no block of the signal starts there
        samples = torch.cat(out) if out else torch.zeros(0)
        if not is_final:
            self.num_out += samples.numel()
        return samples
