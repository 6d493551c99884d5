"""Regenerate `tests/data/s3gen_golden.npz`: chatterbox-tts's S3Gen (flow + HiFT) at the tiny shapes,
with the seeded random weights of `detok_stage.flow.weights` loaded by name, on fixed inputs.

Run it in a scratch venv OUTSIDE the repo, never in CI (the reference is not a dependency):

    python3 -m venv /work/scratch-cosy/venv
    echo <a site-packages with torch + transformers> > /work/scratch-cosy/venv/lib/python3.11/site-packages/base.pth
    /work/scratch-cosy/venv/bin/pip install --no-deps chatterbox-tts==0.1.7
    /work/scratch-cosy/venv/bin/pip install diffusers conformer omegaconf scipy tqdm
    /work/scratch-cosy/venv/bin/python loadtest/golden/make_s3gen_golden.py

Only S3Gen's own modules are imported (the package `__init__`s, which pull in the tokenizer, T3
and torchaudio, are bypassed). The reference's randomness is replaced by ours: the flow's
`randn_like` noise by our fixed noise tensor, the NSF source's harmonic phases and noise by
`nsf_phases` / `nsf_noise`. Loading our state dict into the reference with `strict=True` also
checks that the parameter names match the published layout.
"""

from __future__ import annotations

import importlib.metadata
import sys
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from detok_stage.flow.config import tiny_s3gen_config  # noqa: E402
from detok_stage.flow.flow import CausalMaskedDiffWithXvec, Conditioning  # noqa: E402
from detok_stage.flow.hift import HiFTGenerator, nsf_noise, nsf_phases  # noqa: E402
from detok_stage.flow.weights import parity_inputs, seeded_state_dict  # noqa: E402

FLOW_SEED, HIFT_SEED = 11, 12


def import_reference():
    import importlib.util

    spec_root = Path(importlib.util.find_spec("chatterbox").submodule_search_locations[0])  # finds, does not run it
    for name, path in [
        ("chatterbox", spec_root),
        ("chatterbox.models", spec_root / "models"),
        ("chatterbox.models.s3gen", spec_root / "models" / "s3gen"),
    ]:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod
    import importlib

    return {
        n: importlib.import_module(f"chatterbox.models.s3gen.{n}")
        for n in [
            "flow",
            "flow_matching",
            "decoder",
            "transformer.upsample_encoder",
            "hifigan",
            "f0_predictor",
            "configs",
        ]
    }


def build_reference(ref, cfg):
    enc, est, h = cfg.encoder, cfg.estimator, cfg.hift
    encoder = ref["transformer.upsample_encoder"].UpsampleConformerEncoder(
        input_size=enc.input_size,
        output_size=enc.output_size,
        attention_heads=enc.attention_heads,
        linear_units=enc.linear_units,
        num_blocks=enc.num_blocks,
        dropout_rate=0.0,
        positional_dropout_rate=0.0,
        attention_dropout_rate=0.0,
        normalize_before=True,
        input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn",
        use_cnn_module=False,
        macaron_style=False,
    )
    estimator = ref["decoder"].ConditionalDecoder(
        in_channels=est.in_channels,
        out_channels=est.out_channels,
        causal=True,
        channels=[est.channels],
        dropout=0.0,
        attention_head_dim=est.attention_head_dim,
        n_blocks=est.n_blocks,
        num_mid_blocks=est.num_mid_blocks,
        num_heads=est.num_heads,
        act_fn="gelu",
    )
    decoder = ref["flow_matching"].CausalConditionalCFM(
        spk_emb_dim=80, cfm_params=ref["configs"].CFM_PARAMS, estimator=estimator
    )
    flow = ref["flow"].CausalMaskedDiffWithXvec(
        vocab_size=cfg.vocab_size, input_size=enc.input_size, encoder=encoder, decoder=decoder
    )
    hift = ref["hifigan"].HiFTGenerator(
        sampling_rate=h.sampling_rate,
        base_channels=h.base_channels,
        nb_harmonics=h.nb_harmonics,
        upsample_rates=list(h.upsample_rates),
        upsample_kernel_sizes=list(h.upsample_kernel_sizes),
        istft_params={"n_fft": h.istft_n_fft, "hop_len": h.istft_hop},
        resblock_kernel_sizes=list(h.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(d) for d in h.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(h.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(d) for d in h.source_resblock_dilation_sizes],
        f0_predictor=ref["f0_predictor"].ConvRNNF0Predictor(cond_channels=h.f0_channels),
    )
    return flow.eval(), hift.eval()


class FixedRandomness:
    """Routes the reference's randn_like / U(-pi, pi) draws to our position-keyed tensors."""

    def __init__(self, flow_noise, cfg):
        self.flow_noise, self.cfg = flow_noise, cfg

    def __enter__(self):
        self.randn_like, self.sample = torch.randn_like, torch.distributions.uniform.Uniform.sample
        h, seed, fnoise = self.cfg.hift, self.cfg.nsf_seed, self.flow_noise

        def randn_like(x, *a, **k):
            if x.dim() == 3 and x.shape[1] == 80:  # the CFM's z
                return fnoise(0, x.shape[2]).unsqueeze(0).expand(x.shape[0], -1, -1).clone().to(x)
            if x.dim() == 3 and x.shape[1] == h.nb_harmonics + 1:  # SineGen noise
                return (
                    nsf_noise(seed, 0, x.shape[2], h.nb_harmonics).unsqueeze(0).expand(x.shape[0], -1, -1).clone().to(x)
                )
            return torch.zeros_like(x)  # SourceModuleHnNSF's noise branch (its output is unused)

        def sample(dist, sample_shape=torch.Size()):
            return nsf_phases(seed, h.nb_harmonics).view(1, -1, 1).expand(*sample_shape).clone()

        torch.randn_like = randn_like
        torch.distributions.uniform.Uniform.sample = sample
        return self

    def __exit__(self, *exc):
        torch.randn_like, torch.distributions.uniform.Uniform.sample = self.randn_like, self.sample


def main() -> None:
    ref = import_reference()
    version = importlib.metadata.version("chatterbox-tts")
    prompt, prompt_mel, xvector, tokens = parity_inputs()
    out = {"reference": np.array(f"chatterbox-tts=={version}"), "torch": np.array(torch.__version__)}
    for label, chunk in [("chunked", tiny_s3gen_config().chunk_tokens), ("full", 0)]:
        cfg = tiny_s3gen_config(chunk_tokens=chunk)
        ours = CausalMaskedDiffWithXvec(cfg)
        state = seeded_state_dict(ours, FLOW_SEED)
        ours.load_state_dict(state)
        ref_flow, ref_hift = build_reference(ref, cfg)
        ref_flow.load_state_dict(state, strict=True)
        ref_flow.encoder.static_chunk_size = chunk  # CosyVoice 2's streaming masks (chatterbox runs full attention)
        ref_flow.decoder.estimator.static_chunk_size = chunk * cfg.token_mel_ratio
        hift_ours = HiFTGenerator(cfg.hift, cfg.nsf_seed)
        hift_state = seeded_state_dict(hift_ours, HIFT_SEED)
        ref_hift.load_state_dict(hift_state, strict=True)
        with FixedRandomness(ours.noise, cfg), torch.inference_mode():
            mel, _ = ref_flow.inference(
                token=tokens[None],
                token_len=torch.tensor([tokens.numel()]),
                prompt_token=prompt[None],
                prompt_token_len=torch.tensor([prompt.numel()]),
                prompt_feat=prompt_mel[None],
                prompt_feat_len=torch.tensor([prompt_mel.shape[0]]),
                embedding=xvector[None],
                finalize=True,
                n_timesteps=cfg.n_timesteps,
            )
            wave, _ = ref_hift.inference(speech_feat=mel)
        out[f"mel_{label}"] = mel[0].numpy().astype(np.float32)
        if label == "chunked":
            out["wave_chunked"] = wave[0].numpy().astype(np.float32)
        with torch.inference_mode():
            our_mel = ours.inference(tokens[None], Conditioning(prompt, prompt_mel, xvector))
            hift_ours.load_state_dict(hift_state)
            our_wave = hift_ours.inference(mel)
        print(
            label, "mel max abs diff", float((our_mel - mel).abs().max()), "wave", float((our_wave - wave).abs().max())
        )
    path = REPO / "tests" / "data" / "s3gen_golden.npz"
    np.savez_compressed(path, **out)
    print("wrote", path, path.stat().st_size, "bytes;", version)


if __name__ == "__main__":
    main()
