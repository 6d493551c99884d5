"""Regenerate tests/data/voice_encoders_golden.npz: outputs of the reference zero-shot voice encoders
at toy sizes with seeded random weights (`detok_stage.flow.weights.seeded_state_dict`, keyed by
parameter name, so ours and the reference get the same weights without sharing code).

References: `s3tokenizer` 0.3.0 (PyPI; the torch port of CosyVoice 2's `speech_tokenizer_v2.onnx`,
its `S3TokenizerV2` and `log_mel_spectrogram`), `chatterbox-tts` 0.1.7 (its `s3gen/xvector.py`
CAM++ and `s3gen/utils/mel.py` prompt mel) and torchaudio 2.11.1's `compliance/kaldi.py` fbank
(pure torch; loaded from its file because torchaudio's compiled extension does not load on
torch 2.13). Run it in a scratch virtualenv outside the repo that sees this project's torch:

    python3 -m venv /work/scratch-voices
    echo /work/main/.venv/lib/python3.11/site-packages > /work/scratch-voices/lib/python3.11/site-packages/main.pth
    /work/scratch-voices/bin/pip install --no-deps s3tokenizer==0.3.0 chatterbox-tts==0.1.7 torchaudio==2.11.1 \
        librosa==0.11.0 scipy joblib decorator pooch msgpack lazy_loader soxr audioread numba einops
    /work/scratch-voices/bin/python tests/data/make_voice_encoders_golden.py

tests/detok_stage/test_voice_encoders.py checks ours against the file without the references.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).with_name("voice_encoders_golden.npz")
TOKENIZER_SEED, SPEAKER_SEED, AUDIO_SEED = 11, 12, 13
CLIP_SAMPLES = 16_000 * 3  # 3 s at 16 kHz; the 24 kHz clip has the same duration


def clips() -> tuple[torch.Tensor, torch.Tensor]:
    """A 16 kHz and a 24 kHz clip: a few harmonics plus noise, deterministic."""
    gen = torch.Generator().manual_seed(AUDIO_SEED)
    out = []
    for rate in (16_000, 24_000):
        t = torch.arange(rate * 3) / rate
        tone = sum(torch.sin(2 * torch.pi * f * t) / (i + 1) for i, f in enumerate((180.0, 360.0, 900.0)))
        out.append(0.2 * tone + 0.05 * torch.randn(t.shape, generator=gen))
    return out[0], out[1]


def _site() -> Path:
    return Path(importlib.util.find_spec("s3tokenizer").origin).parents[1]


def import_references() -> dict:
    site = _site()
    spec = importlib.util.spec_from_file_location("kaldi_ref", site / "torchaudio/compliance/kaldi.py")
    torchaudio_stub = types.ModuleType("torchaudio")  # kaldi.py imports it only for MFCC's DCT
    sys.modules["torchaudio"] = torchaudio_stub
    kaldi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kaldi)
    compliance = types.ModuleType("torchaudio.compliance")
    compliance.kaldi = kaldi
    torchaudio_stub.compliance = compliance
    sys.modules["torchaudio.compliance"], sys.modules["torchaudio.compliance.kaldi"] = compliance, kaldi
    for name in ("chatterbox", "chatterbox.models", "chatterbox.models.s3gen", "chatterbox.models.s3gen.utils"):
        package = types.ModuleType(name)  # skip the package __init__s (they import the whole TTS stack)
        package.__path__ = [str(site / name.replace(".", "/"))]
        sys.modules[name] = package
    import s3tokenizer.utils as s3_utils
    from chatterbox.models.s3gen.utils.mel import mel_spectrogram
    from chatterbox.models.s3gen.xvector import CAMPPlus
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2

    return {"kaldi": kaldi, "s3_utils": s3_utils, "mel": mel_spectrogram, "CAMPPlus": CAMPPlus,
            "S3TokenizerV2": S3TokenizerV2, "ModelConfig": ModelConfig}  # fmt: skip


def main() -> None:
    from detok_stage.flow.weights import seeded_state_dict
    from detok_stage.voice.campplus import CAMPPlus, tiny_campplus_config
    from detok_stage.voice.s3tokenizer import S3TokenizerV2, tiny_s3tokenizer_config

    ref = import_references()
    wave_16k, wave_24k = clips()
    tok_cfg, spk_cfg = tiny_s3tokenizer_config(), tiny_campplus_config()

    ref_tok = ref["S3TokenizerV2"](
        "speech_tokenizer_v2_25hz",
        ref["ModelConfig"](n_audio_state=tok_cfg.n_state, n_audio_head=tok_cfg.n_head, n_audio_layer=tok_cfg.n_layer),
    ).eval()
    ref_tok.load_state_dict(seeded_state_dict(S3TokenizerV2(tok_cfg), TOKENIZER_SEED))
    log_mel = ref["s3_utils"].log_mel_spectrogram(wave_16k)
    with torch.inference_mode():
        hidden, _ = ref_tok.encoder(log_mel[None], torch.tensor([log_mel.shape[-1]]))
        tokens, _ = ref_tok.quantize(log_mel[None], torch.tensor([log_mel.shape[-1]]))

    ref_spk = ref["CAMPPlus"](
        embedding_size=192,
        growth_rate=spk_cfg.growth_rate,
        bn_size=spk_cfg.bn_size,
        init_channels=spk_cfg.init_channels,
    ).eval()
    ref_spk.load_state_dict(seeded_state_dict(CAMPPlus(spk_cfg), SPEAKER_SEED))
    fbank = ref["kaldi"].fbank(wave_16k[None], num_mel_bins=80)
    with torch.inference_mode():
        xvector = ref_spk.inference([wave_16k])[0]

    prompt_mel = ref["mel"](wave_24k[None])[0].T
    versions = {k: importlib.metadata.version(k) for k in ("s3tokenizer", "chatterbox-tts", "torchaudio", "librosa")}
    np.savez_compressed(
        OUT,
        reference=np.array(", ".join(f"{k}=={v}" for k, v in versions.items())),
        torch=np.array(torch.__version__),
        log_mel=log_mel.numpy(), hidden=hidden[0].numpy(), tokens=tokens[0].numpy(),
        fbank=fbank.numpy(), xvector=xvector.numpy(), prompt_mel=prompt_mel.numpy(),
    )  # fmt: skip
    print(f"wrote {OUT}: {tokens.shape[1]} tokens, x-vector {tuple(xvector.shape)}, mel {tuple(prompt_mel.shape)}")


if __name__ == "__main__":
    main()
