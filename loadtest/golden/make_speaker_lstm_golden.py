"""Regenerate `tests/data/speaker_lstm_golden.npz`: chatterbox-tts's voice encoder (`VoiceEncoder`,
its librosa mel front end and silence trim) and its T3 prompt-token cut (`S3Tokenizer.forward(...,
max_len=150)` over the first 6 s), at the tiny shapes, with the seeded random weights of
`detok_stage.flow.weights` loaded by name (strictly: the names are the published `ve.safetensors`').

Run it in a scratch venv OUTSIDE the repo, never in CI (the references are not dependencies):

    python3 -m venv /tmp/cbref
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/cbref/lib/python3.11/site-packages/main.pth
    /tmp/cbref/bin/pip install --no-deps chatterbox-tts==0.1.7 s3tokenizer==0.3.0 librosa==0.11.0 scipy \
        joblib decorator pooch msgpack lazy_loader soxr audioread numba llvmlite scikit-learn threadpoolctl
    /tmp/cbref/bin/python loadtest/golden/make_speaker_lstm_golden.py

Only the voice-encoder and s3tokenizer modules are imported (the package `__init__`s, which pull in
the whole TTS stack, are bypassed). tests/detok_stage/test_speaker_lstm.py checks ours against the file.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from detok_stage.flow.weights import seeded_state_dict  # noqa: E402
from detok_stage.voice.s3tokenizer import S3TokenizerV2, tiny_s3tokenizer_config  # noqa: E402
from detok_stage.voice.speaker_lstm import SpeakerLSTM, tiny_speaker_lstm_config  # noqa: E402

OUT = REPO / "tests" / "data" / "speaker_lstm_golden.npz"
SPEAKER_SEED, TOKENIZER_SEED, AUDIO_SEED = 21, 22, 23
CLIP_S, SILENCE_S, RATE_HZ = 7.0, 0.4, 16_000


def clip() -> torch.Tensor:
    """7 s at 16 kHz: near-silence, a gliding voiced tone with noise, near-silence (so the trim cuts
    both ends and the 6 s token window cuts the tail). Deterministic."""
    gen = torch.Generator().manual_seed(AUDIO_SEED)
    t = torch.arange(int(RATE_HZ * CLIP_S)) / RATE_HZ
    pitch = 2 * torch.pi * (150.0 * t + 10.0 * t**2)
    tone = sum(torch.sin(k * pitch) / k for k in (1, 2, 3, 5))
    wave = 0.2 * tone + 0.03 * torch.randn(t.shape, generator=gen)
    edge = int(SILENCE_S * RATE_HZ)
    wave[:edge] *= 1e-3
    wave[-edge:] *= 1e-3
    return wave.float()


def import_reference() -> dict:
    root = Path(importlib.util.find_spec("chatterbox").submodule_search_locations[0])  # finds, does not run it
    for name, path in [("chatterbox", root), ("chatterbox.models", root / "models")]:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    for name in ("onnx", "torchaudio"):  # s3tokenizer.utils: its ONNX converter and file loader only
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name)
    return {
        "ve": importlib.import_module("chatterbox.models.voice_encoder.voice_encoder"),
        "melspec": importlib.import_module("chatterbox.models.voice_encoder.melspec"),
        "config": importlib.import_module("chatterbox.models.voice_encoder.config"),
        "s3tok": importlib.import_module("chatterbox.models.s3tokenizer.s3tokenizer"),
        "tts_consts": {"ENC_COND_LEN": 6 * 16_000, "speech_cond_prompt_len": 150},  # tts.py, t3_config.py
    }


def reference_speaker(ref: dict, wave: np.ndarray) -> dict[str, np.ndarray]:
    import librosa

    hp = ref["config"].VoiceEncConfig()
    hp.ve_hidden_size = tiny_speaker_lstm_config().hidden_size
    encoder = ref["ve"].VoiceEncoder(hp).eval()
    encoder.load_state_dict(seeded_state_dict(SpeakerLSTM(tiny_speaker_lstm_config()), SPEAKER_SEED), strict=True)
    trimmed, (start, end) = librosa.effects.trim(wave, top_db=20)
    mel = ref["melspec"].melspectrogram(trimmed, hp).T  # [T, 40]
    partials = ref["ve"].stride_as_partials(mel, hp, rate=1.3)
    with torch.inference_mode():
        windows = encoder(torch.from_numpy(np.ascontiguousarray(partials))).numpy()
    embedding = encoder.embeds_from_wavs([wave], sample_rate=RATE_HZ)  # what prepare_conditionals calls
    return {"trim": np.array([start, end]), "mel": mel.astype(np.float32), "windows": windows,
            "speaker_emb": embedding.mean(axis=0)}  # fmt: skip


def reference_prompt_tokens(ref: dict, wave: np.ndarray) -> np.ndarray:
    from s3tokenizer.model_v2 import ModelConfig
    from s3tokenizer.model_v2 import S3TokenizerV2 as RefV2

    cfg = tiny_s3tokenizer_config()
    tiny = ModelConfig(n_audio_state=cfg.n_state, n_audio_head=cfg.n_head, n_audio_layer=cfg.n_layer)
    # chatterbox's S3Tokenizer drops its `config` (it calls `super().__init__(name)`): its parent's
    # default config is swapped for the tiny one while it is built
    defaults = RefV2.__init__.__defaults__
    RefV2.__init__.__defaults__ = (tiny,)
    try:
        tokenizer = ref["s3tok"].S3Tokenizer().eval()
    finally:
        RefV2.__init__.__defaults__ = defaults
    state = seeded_state_dict(S3TokenizerV2(cfg), TOKENIZER_SEED)
    missing, unexpected = tokenizer.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"_mel_filters", "window"}, (missing, unexpected)
    consts = ref["tts_consts"]
    tokens, _ = tokenizer.forward([wave[: consts["ENC_COND_LEN"]]], max_len=consts["speech_cond_prompt_len"])
    return tokens[0].numpy()


def main() -> None:
    ref = import_reference()
    wave = clip().numpy()
    speaker = reference_speaker(ref, wave)
    prompt_tokens = reference_prompt_tokens(ref, wave)
    versions = {k: importlib.metadata.version(k) for k in ("chatterbox-tts", "s3tokenizer", "librosa")}
    np.savez_compressed(
        OUT, reference=np.array(", ".join(f"{k}=={v}" for k, v in versions.items())),
        torch=np.array(torch.__version__), t3_prompt_tokens=prompt_tokens, **speaker,
    )  # fmt: skip
    print(f"wrote {OUT}: trim {speaker['trim'].tolist()}, mel {speaker['mel'].shape}, "
          f"{len(speaker['windows'])} windows, {prompt_tokens.size} prompt tokens")  # fmt: skip


if __name__ == "__main__":
    main()
