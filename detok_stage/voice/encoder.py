"""A zero-shot voice from a reference clip, computed once: its S3 speech tokens (16 kHz), CAM++
x-vector (16 kHz) and S3Gen prompt mel (24 kHz, 2 frames per token), as CosyVoice 2's front end
and chatterbox's `S3Gen.embed_ref` compute them.

`VoiceEncoder.build` loads the published encoders from chatterbox's `s3gen.safetensors` / `s3gen.pt`
(`tokenizer.*`, `speaker_encoder.*`) or a directory holding `voice_encoders.pt` (our converted layout);
without a path, seeded random weights of the tiny presets (tests, the CPU config).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from core.messages import VoiceConditioning
from detok_stage.flow.weights import load_seeded, strip_prefix
from detok_stage.voice.campplus import CAMPPlus, CAMPPlusConfig, tiny_campplus_config
from detok_stage.voice.features import S3_SAMPLE_RATE_HZ, S3GEN_SAMPLE_RATE_HZ, resample, s3gen_mel
from detok_stage.voice.s3tokenizer import S3TokenizerConfig, S3TokenizerV2, tiny_s3tokenizer_config

CONVERTED_FILE = "voice_encoders.pt"  # {"tokenizer.*": ..., "speaker_encoder.*": ...}


@dataclass(frozen=True)
class VoiceTensors:
    """What a voice is made of, before it has an id."""

    prompt_tokens: torch.Tensor  # [P] long
    prompt_mel: torch.Tensor  # [2P, 80] float32
    xvector: torch.Tensor  # [192] float32

    def with_id(self, voice_id: str) -> VoiceConditioning:
        return VoiceConditioning(voice_id, self.prompt_tokens, self.prompt_mel, self.xvector)


class VoiceEncoder:
    def __init__(self, tokenizer: S3TokenizerV2, speaker: CAMPPlus) -> None:
        self.tokenizer = tokenizer.eval()
        self.speaker = speaker.eval()

    @classmethod
    def seeded(cls, seed: int = 0) -> VoiceEncoder:
        tokenizer = load_seeded(S3TokenizerV2(tiny_s3tokenizer_config()), seed)
        speaker = load_seeded(CAMPPlus(tiny_campplus_config()), seed + 1)
        return cls(tokenizer, speaker)  # type: ignore[arg-type]

    @classmethod
    def from_checkpoint(
        cls, path: Path, tokenizer_config: S3TokenizerConfig | None = None, speaker_config: CAMPPlusConfig | None = None
    ) -> VoiceEncoder:
        """Published encoders (the full-size shapes unless configs are given): a chatterbox s3gen
        file / directory, or `voice_encoders.pt`."""
        state = _read_state(Path(path))
        tokenizer, speaker = S3TokenizerV2(tokenizer_config), CAMPPlus(speaker_config)
        tokenizer.load_state_dict(strip_prefix(state, "tokenizer."), strict=False)
        missing = set(tokenizer.state_dict()) - set(strip_prefix(state, "tokenizer."))
        if missing:
            raise KeyError(f"{path}: speech tokenizer tensors missing: {sorted(missing)[:5]}")
        speaker.load_state_dict(strip_prefix(state, "speaker_encoder."))
        return cls(tokenizer, speaker)

    @classmethod
    def build(cls, path: Path | None, seed: int = 0) -> VoiceEncoder:
        return cls.seeded(seed) if path is None else cls.from_checkpoint(path)

    @torch.inference_mode()
    def encode(self, wave: torch.Tensor, sample_rate_hz: int) -> VoiceTensors:
        """A mono clip [N] (float, [-1, 1]) -> its voice; tokens and mel frames are cut to 1 : 2."""
        wave = wave.float()
        wave_16k = resample(wave, sample_rate_hz, S3_SAMPLE_RATE_HZ)
        wave_24k = resample(wave, sample_rate_hz, S3GEN_SAMPLE_RATE_HZ)
        mel = s3gen_mel(wave_24k)
        tokens = self.tokenizer.tokenize(wave_16k)
        pairs = min(int(tokens.numel()), mel.shape[0] // 2)
        xvector = self.speaker.embed(wave_16k)
        return VoiceTensors(tokens[:pairs].clone(), mel[: 2 * pairs].contiguous(), xvector.contiguous())


def encoder_file(path: Path) -> Path:
    """The file holding the encoders: `path` itself, or its voice_encoders.pt / s3gen.* (FileNotFoundError: none)."""
    candidates = [path] if path.is_file() else [path / CONVERTED_FILE, *sorted(path.glob("s3gen.*"))]
    for file in candidates:
        if file.is_file():
            return file
    raise FileNotFoundError(f"{path}: no {CONVERTED_FILE} and no s3gen.safetensors / s3gen.pt with the voice encoders")


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    file = encoder_file(path)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)
