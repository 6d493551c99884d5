"""Regenerate `tests/data/step_audio2_token2wav_golden.npz`: mels and audio of the reference Step-Audio 2
token2wav (VoxServe's self-contained port of stepfun-ai/Step-Audio2's: `vox_serve/tokenizer/step_audio_2.py`
+ `hifigan.py`) on the tiny layout `tests/step_audio2_layout.py` writes (seeded weights, seed 3), for two
voices and token sequences, each decoded as one last chunk ("whole") and streamed at two chunk cuts.

The reference is not installed: extract it OUTSIDE the repo, with scipy (HiFT's window) in a folder
of its own, and name that folder:

    git -C <vox-serve clone> archive <commit> vox_serve/tokenizer/step_audio_2.py \\
        vox_serve/tokenizer/hifigan.py vox_serve/tokenizer/base.py | tar -x -C /tmp/sa2ref
    pip install --no-deps --target /tmp/sa2ref/site scipy
    python -m tests.data.make_step_audio2_token2wav_golden /tmp/sa2ref <commit> \\
        tests/data/step_audio2_token2wav_golden.npz

in the repo's venv (it has einops), on CPU. Stubbed, as the decode path does not use them: onnxruntime
(CAM++), `vox_serve.tokenizer.s3` (the speech tokenizer), librosa / torchaudio (prompt-audio features),
`hf_hub_download` and `download_github_file` (downloads). `StepAudio2Decoder.__init__` (downloads, full
sizes) is skipped: the tiny modules are built from the reference's classes and load the written
`flow.pt` / `hift.pt` with the reference's own loading (`generator.` stripped, strict), so the layout's
names are checked too. Each stream then runs the reference's `setup_cache` (prompt + its first 3
tokens as look-ahead; both caches cut to 128 as `init_cache` cuts them) and `StepAudio2Decoder.forward`
per chunk (last chunk `last_chunk=True`).

The vocoder's starting state: VoxServe's `init_cache` starts HiFT from the prompt mel's last 8 frames
with zero source / speech caches (fixed shapes for its batching), so a stream's first 3840 samples are
the prompt's tail faded in; stepfun-ai/Step-Audio2's `token2wav.py` (`set_stream_cache`) starts them
empty. We follow the original: the goldens start the reference's `forward` from empty HiFT caches.
torch is seeded with 0 before each stream (setup's noise, then each chunk's flow noise and HiFT draws,
in order), as our codec seeds each stream's generator (`Token2WavConfig.noise_seed`).
"""

from __future__ import annotations

import importlib.machinery
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

SEED = 3
NOISE_SEED = 0
# name, voice (the preset default, or parity_inputs' with a 20-token prompt), tokens, cuts: (start, end) kept
CASES = [
    ("short", "default", 40, {"whole": [(0, 40)], "cut25": [(0, 25), (25, 40)], "cutb": [(0, 10), (10, 22), (22, 40)]}),
    ("long", "prompt20", 80, {"cut25": [(0, 25), (25, 50), (50, 75), (75, 80)], "cutb": [(0, 30), (30, 64), (64, 80)]}),
]


def case_tokens(length: int, index: int) -> list[int]:
    gen = torch.Generator().manual_seed(200 + index)
    return torch.randint(0, 6561, (length,), generator=gen).tolist()


def _module(name: str, package: bool = False, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def stub_modules(root: Path) -> None:
    def unused(*args, **kwargs):
        raise RuntimeError("not on the decode path")

    _module("onnxruntime", SessionOptions=unused, InferenceSession=unused, GraphOptimizationLevel=None)
    _module("librosa", filters=types.SimpleNamespace(mel=unused))
    torchaudio = _module("torchaudio", package=True, load=unused, transforms=types.SimpleNamespace(Resample=unused))
    kaldi = _module("torchaudio.compliance.kaldi", fbank=unused)
    torchaudio.compliance = _module("torchaudio.compliance", package=True, kaldi=kaldi)
    import huggingface_hub  # installed (transformers needs it): only its download is replaced

    huggingface_hub.hf_hub_download = unused
    vox = _module("vox_serve", package=True)
    vox.__path__ = [str(root / "vox_serve")]
    _module("vox_serve.utils", download_github_file=unused)
    tokenizer = _module("vox_serve.tokenizer", package=True)
    tokenizer.__path__ = [str(root / "vox_serve" / "tokenizer")]
    _module("vox_serve.tokenizer.s3", S3TokenizerV2=unused)


def reference_decoder(ref, hifigan, config, directory: Path):
    """The reference's modules at the tiny shapes, loading the written token2wav/ its own way."""
    e, d, h = config.encoder, config.estimator, config.hift
    encoder = ref.UpsampleConformerEncoderV2(
        input_size=e.input_size, output_size=e.output_size, pre_lookahead_len=e.pre_lookahead_len,
        num_blocks=e.num_blocks, num_up_blocks=e.num_up_blocks, up_stride=e.up_stride, up_scale_factor=2,
        attention_heads=e.attention_heads, linear_units=e.linear_units,
    )
    estimator = ref.DiT(in_channels=d.in_channels, out_channels=d.out_channels, mlp_ratio=d.mlp_ratio, depth=d.depth,
                        num_heads=d.num_heads, head_dim=d.head_dim, hidden_size=d.hidden_size)
    flow = ref.CausalMaskedDiffWithXvec(input_size=e.input_size, output_size=80, spk_embed_dim=192,
                                        vocab_size=config.vocab_size, encoder=encoder,
                                        decoder=ref.CausalConditionalCFM(estimator, inference_cfg_rate=0.7))
    flow.load_state_dict(torch.load(directory / "flow.pt", map_location="cpu", weights_only=True), strict=True)
    hift = hifigan.HiFTGenerator(base_channels=h.base_channels, nb_harmonics=h.nb_harmonics, device="cpu",
                                 f0_predictor=hifigan.ConvRNNF0Predictor(cond_channels=h.f0_channels))
    state = torch.load(directory / "hift.pt", map_location="cpu", weights_only=True)
    hift.load_state_dict({k.replace("generator.", ""): v for k, v in state.items()}, strict=True)
    decoder = ref.StepAudio2Decoder.__new__(ref.StepAudio2Decoder)
    torch.nn.Module.__init__(decoder)
    decoder.device, decoder.float16 = "cpu", False
    decoder.flow, decoder.hift = flow.eval(), hift.eval()
    decoder.mel_cache_len, decoder.source_cache_len = 8, 8 * 480
    decoder.speech_window = torch.from_numpy(np.hamming(2 * decoder.source_cache_len))
    return decoder


def reference_stream(ref, decoder, voice, tokens: list[int], cuts: list[tuple[int, int]]):
    """setup_cache as init_cache runs it (HiFT caches empty, as the original's set_stream_cache), then
    `forward` per chunk -> (mel, audio) per chunk."""
    prompt, prompt_mel, xvector = voice
    torch.manual_seed(NOISE_SEED)
    pt = prompt[None]
    cache = decoder.flow.setup_cache(torch.cat([pt, pt[:, :3]], dim=1), prompt_mel[None], xvector[None], n_timesteps=10)
    b = 1
    conv, att = cache["estimator_cnn_cache"], cache["estimator_att_cache"][:, :, :, :, -128:, :]
    state = ref.StepAudio2DecoderCache(
        spk_emb=xvector[None], conformer_cnn_cache=cache["conformer_cnn_cache"],
        conformer_att_cache=cache["conformer_att_cache"][:, :, :, -128:, :],
        estimator_cnn_cache=conv.view(b, 2, *conv.shape[1:]), estimator_att_cache=att.view(b, 2, *att.shape[1:]),
        hift_mel_cache=torch.zeros(1, 80, 0), hift_source_cache=torch.zeros(1, 1, 0),
        hift_speech_cache=torch.zeros(1, 0),
    )
    mels, audio = [], []
    inference_chunk = decoder.flow.inference_chunk

    def recording(*args, **kwargs):
        mel, new = inference_chunk(*args, **kwargs)
        mels.append(mel[0].clone())
        return mel, new

    decoder.flow.inference_chunk = recording
    for i, (start, end) in enumerate(cuts):
        last = i == len(cuts) - 1
        chunk = tokens[start:end] + ([] if last else tokens[end : end + 3])
        speech, state = decoder.forward(torch.tensor([chunk]), state, last_chunk=last)
        audio.append(speech[0].clone())
    decoder.flow.inference_chunk = inference_chunk
    return mels, audio


def main(reference_dir: str, commit: str, out: str) -> None:
    root = Path(reference_dir).resolve()
    sys.path[:0] = [str(root), str(root / "site")]
    stub_modules(root)
    import vox_serve.tokenizer.hifigan as hifigan
    import vox_serve.tokenizer.step_audio_2 as ref

    from detok_stage.flow.weights import parity_inputs
    from tests.step_audio2_layout import token2wav_model, write_token2wav

    ours = token2wav_model(SEED)
    directory = write_token2wav(Path(tempfile.mkdtemp()) / "token2wav", ours)
    decoder = reference_decoder(ref, hifigan, ours.config, directory)
    default = ours.default_conditioning()
    prompt, prompt_mel, xvector, _ = parity_inputs(seed=11, prompt_tokens=20, tokens=1, vocab=6561)
    voices = {"default": (default.prompt_tokens, default.prompt_mel, default.xvector),
              "prompt20": (prompt, prompt_mel, xvector)}
    arrays: dict[str, np.ndarray] = {"reference": np.array(f"vox-serve/vox-serve@{commit}")}
    arrays.update(prompt20_tokens=prompt.numpy(), prompt20_mel=prompt_mel.numpy(), prompt20_xvector=xvector.numpy())
    for index, (name, voice, length, cuts) in enumerate(CASES):
        tokens = case_tokens(length, index)
        arrays[f"{name}_tokens"] = np.array(tokens)
        for cut_name, cut in cuts.items():
            mels, audio = reference_stream(ref, decoder, voices[voice], tokens, cut)
            arrays[f"{name}_{cut_name}_cuts"] = np.array(cut)
            arrays[f"{name}_{cut_name}_mel"] = torch.cat(mels, dim=1).numpy()
            arrays[f"{name}_{cut_name}_audio"] = torch.cat(audio).float().numpy()
            arrays[f"{name}_{cut_name}_samples"] = np.array([a.numel() for a in audio])
    np.savez_compressed(out, **arrays)
    print({k: v.shape for k, v in arrays.items()})


if __name__ == "__main__":
    main(*sys.argv[1:4])
