"""Regenerate tests/data/qwen3_tts/: golden outputs of the reference Qwen3-TTS implementation, the
`qwen-tts` package (0.1.1, PyPI), at toy sizes with random weights.

The reference needs transformers 4.57.3, so it runs in its own virtualenv outside the repo, e.g.

    python3 -m venv /tmp/qwen-tts-venv
    /tmp/qwen-tts-venv/bin/pip install torch==2.13.0 transformers==4.57.3 einops
    /tmp/qwen-tts-venv/bin/pip install --no-deps qwen-tts==0.1.1
    /tmp/qwen-tts-venv/bin/python tests/data/make_qwen3_tts_golden.py

(the audio I/O packages it imports at module level, librosa / soundfile / sox / onnxruntime /
torchaudio, serve only audio files, the 25 Hz tokenizer and voice cloning, and are stubbed here).
It writes, with the reference's own `save_pretrained`, a tiny checkpoint in the published layout
(checkpoint/: config.json, model.safetensors, speech_tokenizer/) and golden.json + golden_audio.npz:
greedy frames of `Qwen3TTSForConditionalGeneration.generate` (talker + code predictor, the
CustomVoice non-streaming prompt; `streaming_frames`: its streaming-text prompt) and waveforms of
`Qwen3TTSTokenizerV2Model.decode`.
tests/llm_stage/test_qwen3_tts_golden.py checks ours against them without the reference installed.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.metadata
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
import transformers  # noqa: F401  (imported before the stubs: it probes which audio packages exist)

STUBBED = ["librosa", "librosa.filters", "soundfile", "sox", "onnxruntime", "torchaudio", "torchaudio.compliance",
           "torchaudio.compliance.kaldi"]  # fmt: skip
for _name in STUBBED:
    _module = types.ModuleType(_name)
    _module.__spec__ = importlib.machinery.ModuleSpec(_name, None)
    sys.modules[_name] = _module
sys.modules["librosa.filters"].mel = None  # type: ignore[attr-defined]

from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig  # noqa: E402
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration  # noqa: E402
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config  # noqa: E402
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model  # noqa: E402

NUM_CODEBOOKS, CODEBOOK_SIZE = 4, 64
ROLE_IDS, TAIL_IDS = [1, 6, 7], [2, 7, 1, 6, 7]  # "<|im_start|>assistant\n" ... "<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [  # (text ids, speaker): speaker "eric" speaks a dialect, so its prompt thinks in it
    (list(range(20, 31)), "ryan"),
    ([200, 17, 399, 42, 42, 42, 100], "eric"),
    ([300, 301], "ryan"),
]
NUM_FRAMES = 14
EOS_FACTOR = 1.0
REPETITION_PENALTY = 1.3  # stronger than the published 1.05, so it shows in greedy codebook-0 picks


def tts_config() -> Qwen3TTSConfig:
    predictor = {
        "vocab_size": CODEBOOK_SIZE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 1000000,
        "num_code_groups": NUM_CODEBOOKS,
    }  # fmt: skip
    talker = {
        "vocab_size": CODEBOOK_SIZE + 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
        "text_vocab_size": 400, "text_hidden_size": 32, "num_code_groups": NUM_CODEBOOKS,
        "codec_pad_id": 100, "codec_bos_id": 101, "codec_eos_token_id": 102, "codec_think_id": 103,
        "codec_nothink_id": 104, "codec_think_bos_id": 105, "codec_think_eos_id": 106,
        "codec_language_id": {"english": 110, "chinese": 111, "sichuan_dialect": 113},
        "spk_id": {"ryan": 120, "eric": 124}, "spk_is_dialect": {"ryan": False, "eric": "sichuan_dialect"},
        "code_predictor_config": predictor,
    }  # fmt: skip
    return Qwen3TTSConfig(
        talker_config=talker, tts_model_type="custom_voice", tts_model_size="tiny",
        tokenizer_type="qwen3_tts_tokenizer_12hz", im_start_token_id=1, im_end_token_id=2, tts_pad_token_id=3,
        tts_bos_token_id=4, tts_eos_token_id=5,
    )  # fmt: skip


def tokenizer_config() -> Qwen3TTSTokenizerV2Config:
    decoder = {
        "codebook_size": CODEBOOK_SIZE, "codebook_dim": 32, "latent_dim": 32, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 16, "sliding_window": 8, "num_quantizers": NUM_CODEBOOKS, "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2], "decoder_dim": 32,
    }  # fmt: skip
    encoder = {
        "hidden_size": 32, "num_filters": 8, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4],
        "codebook_size": CODEBOOK_SIZE, "vector_quantization_hidden_dimension": 32, "upsample_groups": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 64, "sliding_window": 8, "codebook_dim": 32, "num_quantizers": 8,
        "num_semantic_quantizers": 1, "frame_rate": 12.5,
    }  # fmt: skip
    return Qwen3TTSTokenizerV2Config(encoder_config=encoder, decoder_config=decoder, encoder_valid_num_quantizers=4)


def randomize(model: torch.nn.Module, seed: int, scales: dict[str, float]) -> None:
    """Weights wide enough that greedy picks are not near-ties and the decoder is audible: matrices
    ~ N(0, 1 / fan_in) (times `scales` by name fragment), vectors perturbed around their init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = next((s for fragment, s in scales.items() if fragment in name), 1.0)
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() > 1:
                p.copy_(noise * scale / max(1, p[0].numel()) ** 0.5)
            elif name.endswith("cluster_usage"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.add_(0.1 * noise * scale)


def greedy_frames(
    model: Qwen3TTSForConditionalGeneration, text_ids: list[int], speaker: str, streaming: bool = False
) -> torch.Tensor:
    """Greedy frames of the reference's `generate`; `streaming` is its streaming-text layout
    (`non_streaming_mode=False`: the prompt ends with the first text id, every later text id and
    then `tts_eos` ride on one generated frame each, `tts_pad` after them)."""
    input_ids = torch.tensor([ROLE_IDS + text_ids + TAIL_IDS])
    codes, _ = model.generate(
        input_ids=[input_ids], languages=["auto"], speakers=[speaker], non_streaming_mode=not streaming,
        max_new_tokens=NUM_FRAMES, do_sample=False, subtalker_dosample=False, repetition_penalty=REPETITION_PENALTY,
    )  # fmt: skip
    return codes[0]


def stop_early(model: Qwen3TTSForConditionalGeneration, factor: float = EOS_FACTOR) -> None:
    """Point the codec head's EOS row along the row of a code the last prompt picks late and rarely
    (its first pick after frame 5 that differs from its first frame's), so some prompts stop early."""
    first = greedy_frames(model, *PROMPTS[-1])[:, 0].tolist()
    code = next(c for c in first[5:] if c != first[0])
    with torch.no_grad():
        head = model.talker.codec_head.weight
        head[model.config.talker_config.codec_eos_token_id] = factor * head[code]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "qwen3_tts")
    args = parser.parse_args()
    out: Path = args.out
    torch.manual_seed(0)
    model = Qwen3TTSForConditionalGeneration(tts_config()).eval()
    randomize(model, 1, {"embedding_sum": 8.0, "codec_head": 3.0, "lm_head": 3.0})
    stop_early(model)
    tokenizer = Qwen3TTSTokenizerV2Model(tokenizer_config()).eval()
    randomize(tokenizer, 2, {"embedding_sum": 8.0, "decoder.decoder.6": 0.02})
    model.save_pretrained(str(out / "checkpoint"))
    tokenizer.save_pretrained(str(out / "checkpoint" / "speech_tokenizer"))

    golden: dict = {"reference": f"qwen-tts {importlib.metadata.version('qwen-tts')}",
                    "transformers": transformers.__version__, "torch": torch.__version__, "cases": []}  # fmt: skip
    audio: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for index, (text_ids, speaker) in enumerate(PROMPTS):
            codes = greedy_frames(model, text_ids, speaker)
            streaming = greedy_frames(model, text_ids, speaker, streaming=True)
            golden["cases"].append(
                {
                    "role_ids": ROLE_IDS,
                    "text_ids": text_ids,
                    "speaker": speaker,
                    "frames": codes.tolist(),
                    "streaming_frames": streaming.tolist(),
                }
            )
            audio[f"generated_{index}"] = tokenizer.decode(codes[None]).audio_values[0].numpy()
        random_codes = torch.randint(
            0, CODEBOOK_SIZE, (1, 40, NUM_CODEBOOKS), generator=torch.Generator().manual_seed(5)
        )
        golden["random_codes"] = random_codes[0].tolist()
        audio["random"] = tokenizer.decode(random_codes).audio_values[0].numpy()
    (out / "golden.json").write_text(json.dumps(golden, indent=1))
    np.savez_compressed(out / "golden_audio.npz", **{k: v.astype(np.float32) for k, v in audio.items()})
    for key, wave in audio.items():
        print(f"{key}: {wave.shape[0]} samples, std {wave.std():.3f}, clipped {np.mean(np.abs(wave) >= 1):.3f}")
    print("frames:", [len(case["frames"]) for case in golden["cases"]])


if __name__ == "__main__":
    main()
