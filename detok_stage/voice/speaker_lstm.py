"""Chatterbox's voice encoder in torch: the speaker embedding its T3 is conditioned on (`speaker_emb`).

A clip at 16 kHz, its leading / trailing silence trimmed, becomes 40-bin mel power frames; windows
of 160 frames every 77 (Resemble's rate 1.3) go through a 3-layer LSTM, whose last layer's final
state is projected (ReLU) and L2-normalised; the windows' embeddings are averaged and normalised
again. Parameter names are the published `ve.safetensors`' (`lstm.*`, `proj.*`, `similarity_*`).
Used by `detok_stage.voice.encoder` for families whose LM takes a speaker embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.voice.features import speaker_mel, trim_silence

PARTIAL_FRAMES = 160  # frames per window (1.6 s)
PARTIAL_STEP = 77  # round(16000 / 1.3 / 160): frames between window starts
MIN_COVERAGE = 0.8  # a last, partly filled window counts when this much of it is audio
TRIM_TOP_DB = 20.0


@dataclass(frozen=True)
class SpeakerLSTMConfig:
    num_mels: int = 40
    hidden_size: int = 256
    num_layers: int = 3
    embed_size: int = 256  # T3's speaker_embed_size


def tiny_speaker_lstm_config() -> SpeakerLSTMConfig:
    """The tiny presets' encoder: a narrow LSTM, the published embedding size (T3's input)."""
    return SpeakerLSTMConfig(hidden_size=32)


def window_starts(num_frames: int) -> list[int]:
    """Start frames of the windows over `num_frames` mel frames (the last may run past the end: it is
    zero-padded). One window at least; a trailing window is kept if MIN_COVERAGE of it is audio."""
    num_windows, remainder = divmod(max(num_frames - PARTIAL_FRAMES + PARTIAL_STEP, 0), PARTIAL_STEP)
    if num_windows == 0 or (remainder + PARTIAL_FRAMES - PARTIAL_STEP) / PARTIAL_FRAMES >= MIN_COVERAGE:
        num_windows += 1
    return [i * PARTIAL_STEP for i in range(num_windows)]


def mel_windows(mel: torch.Tensor) -> torch.Tensor:
    """mel [T, M] -> [num_windows, PARTIAL_FRAMES, M], zero-padded past the end."""
    starts = window_starts(mel.shape[0])
    padded = F.pad(mel, (0, 0, 0, max(0, starts[-1] + PARTIAL_FRAMES - mel.shape[0])))
    return torch.stack([padded[s : s + PARTIAL_FRAMES] for s in starts])


class SpeakerLSTM(nn.Module):
    def __init__(self, config: SpeakerLSTMConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or SpeakerLSTMConfig()
        self.lstm = nn.LSTM(config.num_mels, config.hidden_size, num_layers=config.num_layers, batch_first=True)
        self.proj = nn.Linear(config.hidden_size, config.embed_size)
        # the published training's similarity scale / offset (kept so its state dict loads strictly)
        self.similarity_weight = nn.Parameter(torch.tensor([10.0]))
        self.similarity_bias = nn.Parameter(torch.tensor([-5.0]))

    def window_embeddings(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [B, PARTIAL_FRAMES, M] -> [B, embed_size], each L2-normalised."""
        _, (final_hidden, _) = self.lstm(windows)  # [layers, B, H]
        embeddings = F.relu(self.proj(final_hidden[-1]))
        return embeddings / torch.linalg.norm(embeddings, dim=1, keepdim=True)

    @torch.inference_mode()
    def embed(self, wave_16k: torch.Tensor) -> torch.Tensor:
        """A clip [N] at 16 kHz -> its speaker embedding [embed_size] (unit norm)."""
        voiced = trim_silence(wave_16k.float(), TRIM_TOP_DB)
        mel = speaker_mel(voiced, self.config.num_mels)
        mean = self.window_embeddings(mel_windows(mel)).mean(dim=0)
        return mean / torch.linalg.norm(mean)
