"""A zero-shot voice from a reference clip, computed once: its S3 speech tokens (16 kHz), CAM++
x-vector (16 kHz) and S3Gen prompt mel (24 kHz, 2 frames per token), as CosyVoice 2's front end
and chatterbox's `S3Gen.embed_ref` compute them; for chatterbox (`with_lm_speaker`) also T3's
conditioning, as `ChatterboxTTS.prepare_conditionals`: the S3Gen reference from the clip's first
10 s, the voice encoder's speaker embedding of the whole clip, and the speech tokens of its first
6 s cut to 150.

`VoiceEncoder.build` loads the published encoders from chatterbox's `s3gen.safetensors` / `s3gen.pt`
(`tokenizer.*`, `speaker_encoder.*`) and `ve.safetensors`, or a directory holding `voice_encoders.pt`
(our converted layout, with `voice_encoder.*` for chatterbox's); without a path, seeded random
weights of the tiny presets (tests, the CPU config). The VoiceBank (`deployments.voices`) calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from core.messages import VoiceConditioning
from core.voices import SpeakerPrompt
from detok_stage.flow.weights import load_seeded, strip_prefix
from detok_stage.voice.campplus import CAMPPlus, CAMPPlusConfig, tiny_campplus_config
from detok_stage.voice.features import S3_SAMPLE_RATE_HZ, S3GEN_SAMPLE_RATE_HZ, resample, s3gen_mel
from detok_stage.voice.s3tokenizer import S3TokenizerConfig, S3TokenizerV2, tiny_s3tokenizer_config
from detok_stage.voice.speaker_lstm import SpeakerLSTM, SpeakerLSTMConfig, tiny_speaker_lstm_config

CONVERTED_FILE = "voice_encoders.pt"  # {"tokenizer.*": ..., "speaker_encoder.*": ..., "voice_encoder.*": ...}
SPEAKER_LSTM_FILE = "ve.safetensors"  # chatterbox's voice encoder, beside s3gen.safetensors
T3_PROMPT_WINDOW_S = 6  # ChatterboxTTS.ENC_COND_LEN: T3's prompt tokens come from the clip's start
T3_PROMPT_TOKENS = 150  # T3Config.speech_cond_prompt_len
S3GEN_REF_WINDOW_S = 10  # ChatterboxTTS.DEC_COND_LEN: S3Gen's reference is the clip's first 10 s


@dataclass(frozen=True)
class VoiceTensors:
    """What a voice is made of, before it has an id."""

    prompt_tokens: torch.Tensor  # [P] long
    prompt_mel: torch.Tensor  # [2P, 80] float32
    xvector: torch.Tensor  # [192] float32
    lm_speaker: SpeakerPrompt | None = None  # chatterbox's T3 conditioning (None: the LM takes none)

    def with_id(self, voice_id: str) -> VoiceConditioning:
        return VoiceConditioning(voice_id, self.prompt_tokens, self.prompt_mel, self.xvector)


def t3_prompt_tokens(tokenizer: S3TokenizerV2, wave_16k: torch.Tensor) -> torch.Tensor:
    """T3's prompt speech tokens [<= 150]: the clip's first 6 s, tokenized with the mel cut to 150 tokens."""
    return tokenizer.tokenize(wave_16k[: T3_PROMPT_WINDOW_S * S3_SAMPLE_RATE_HZ], max_tokens=T3_PROMPT_TOKENS)


class VoiceEncoder:
    def __init__(self, tokenizer: S3TokenizerV2, speaker: CAMPPlus, lm_speaker: SpeakerLSTM | None = None) -> None:
        self.tokenizer = tokenizer.eval()
        self.speaker = speaker.eval()
        self.lm_speaker = None if lm_speaker is None else lm_speaker.eval()  # chatterbox's voice encoder

    @classmethod
    def seeded(cls, seed: int = 0, with_lm_speaker: bool = False) -> VoiceEncoder:
        tokenizer = load_seeded(S3TokenizerV2(tiny_s3tokenizer_config()), seed)
        speaker = load_seeded(CAMPPlus(tiny_campplus_config()), seed + 1)
        lm_speaker = load_seeded(SpeakerLSTM(tiny_speaker_lstm_config()), seed + 2) if with_lm_speaker else None
        return cls(tokenizer, speaker, lm_speaker)  # type: ignore[arg-type]

    @classmethod
    def from_checkpoint(
        cls,
        path: Path,
        tokenizer_config: S3TokenizerConfig | None = None,
        speaker_config: CAMPPlusConfig | None = None,
        lm_speaker_config: SpeakerLSTMConfig | None = None,
        with_lm_speaker: bool = False,
    ) -> VoiceEncoder:
        """Published encoders (the full-size shapes unless configs are given): a chatterbox s3gen
        file / directory (and its ve.safetensors `with_lm_speaker`), or `voice_encoders.pt`."""
        state = _read_state(Path(path))
        tokenizer, speaker = S3TokenizerV2(tokenizer_config), CAMPPlus(speaker_config)
        tokenizer.load_state_dict(strip_prefix(state, "tokenizer."), strict=False)
        missing = set(tokenizer.state_dict()) - set(strip_prefix(state, "tokenizer."))
        if missing:
            raise KeyError(f"{path}: speech tokenizer tensors missing: {sorted(missing)[:5]}")
        speaker.load_state_dict(strip_prefix(state, "speaker_encoder."))
        lm_speaker = None
        if with_lm_speaker:
            lm_speaker = SpeakerLSTM(lm_speaker_config)
            lm_speaker.load_state_dict(_speaker_lstm_state(Path(path), state))
        return cls(tokenizer, speaker, lm_speaker)

    @classmethod
    def build(cls, path: Path | None, seed: int = 0, with_lm_speaker: bool = False) -> VoiceEncoder:
        if path is None:
            return cls.seeded(seed, with_lm_speaker)
        return cls.from_checkpoint(path, with_lm_speaker=with_lm_speaker)

    @torch.inference_mode()
    def encode(self, wave: torch.Tensor, sample_rate_hz: int) -> VoiceTensors:
        """A mono clip [N] (float, [-1, 1]) -> its voice; tokens and mel frames are cut to 1 : 2."""
        wave = wave.float()
        wave_16k = resample(wave, sample_rate_hz, S3_SAMPLE_RATE_HZ)
        lm_speaker = None if self.lm_speaker is None else self._t3_conditioning(wave_16k)
        if self.lm_speaker is not None:  # chatterbox: S3Gen's reference is the first 10 s
            wave = wave[: S3GEN_REF_WINDOW_S * sample_rate_hz]
            wave_16k = wave_16k[: S3GEN_REF_WINDOW_S * S3_SAMPLE_RATE_HZ]
        mel = s3gen_mel(resample(wave, sample_rate_hz, S3GEN_SAMPLE_RATE_HZ))
        tokens = self.tokenizer.tokenize(wave_16k)
        pairs = min(int(tokens.numel()), mel.shape[0] // 2)
        xvector = self.speaker.embed(wave_16k)
        return VoiceTensors(tokens[:pairs].clone(), mel[: 2 * pairs].contiguous(), xvector.contiguous(), lm_speaker)

    def _t3_conditioning(self, wave_16k: torch.Tensor) -> SpeakerPrompt:
        speaker_emb = self.lm_speaker.embed(wave_16k)  # type: ignore[union-attr]
        tokens = t3_prompt_tokens(self.tokenizer, wave_16k)
        return SpeakerPrompt(tuple(speaker_emb.tolist()), tuple(tokens.tolist()))


def encoder_file(path: Path) -> Path:
    """The file holding the encoders: `path` itself, or its voice_encoders.pt / s3gen.* (FileNotFoundError: none)."""
    candidates = [path] if path.is_file() else [path / CONVERTED_FILE, *sorted(path.glob("s3gen.*"))]
    for file in candidates:
        if file.is_file():
            return file
    raise FileNotFoundError(f"{path}: no {CONVERTED_FILE} and no s3gen.safetensors / s3gen.pt with the voice encoders")


def speaker_lstm_file(path: Path) -> Path:
    """chatterbox's ve.safetensors beside (or in) `path` (FileNotFoundError: none)."""
    file = (path.parent if path.is_file() else path) / SPEAKER_LSTM_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file.parent}: no {SPEAKER_LSTM_FILE} (chatterbox's voice encoder)")
    return file


def _speaker_lstm_state(path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """chatterbox's voice encoder: `voice_encoder.*` of our converted file, else ve.safetensors."""
    converted = strip_prefix(state, "voice_encoder.")
    if converted:
        return converted
    from safetensors.torch import load_file

    return load_file(str(speaker_lstm_file(path)))


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    file = encoder_file(path)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)
