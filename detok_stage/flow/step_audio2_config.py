"""Shapes of Step-Audio 2 mini's `token2wav/` detokenizer (token -> mel flow with a DiT estimator,
mel -> wave CosyVoice 2 HiFT), and how its streaming keeps caches.

`full_token2wav_config()` is the published `flow.pt` / `hift.pt` (stepfun-ai/Step-Audio-2-mini:
`UpsampleConformerEncoderV2` 512 wide, 6 + 4 blocks of 8 heads; DiT of 16 blocks, 512 hidden, 8 x 64
heads). `tiny_token2wav_config()` keeps the published vocabulary, 80 mels and 24 kHz hop 480, with few
layers and channels, for tests and the `step-audio2-tiny` preset. `config_from_state` reads the shapes
back from a state dict (the published directory has no config we read: its flow.yaml is HyperPyYAML).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from detok_stage.flow.config import EncoderConfig, HiftConfig


@dataclass(frozen=True)
class DiTConfig:
    """The flow's estimator: a DiT over mel frames (adaLN-Zero, a causal conv block per transformer block)."""

    in_channels: int = 320  # x, mu, speaker, prompt-mel condition (80 each)
    out_channels: int = 80
    hidden_size: int = 512
    depth: int = 16
    num_heads: int = 8
    head_dim: int = 64
    mlp_ratio: float = 4.0
    frequency_embedding_size: int = 256  # the timestep's sinusoid
    time_scale: float = 1000.0  # t in [0, 1] is embedded as t * 1000

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


@dataclass(frozen=True)
class Token2WavConfig:
    vocab_size: int = 6561
    spk_embed_dim: int = 192
    mel_bins: int = 80
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: DiTConfig = field(default_factory=DiTConfig)
    hift: HiftConfig = field(default_factory=HiftConfig)
    n_timesteps: int = 10  # Euler steps on a cosine t schedule
    cfg_rate: float = 0.7  # (1 + rate) * cond - rate * uncond
    att_cache_frames: int = 128  # every attention cache is cut to its last 128 positions after each call
    mel_cache_frames: int = 8  # HiFT runs on these mel frames of the chunk before plus the chunk's
    noise_seed: int = 0  # each stream's generator (flow noise, then HiFT's source draws, in call order)
    default_prompt_tokens: int = 0  # the default voice's prompt (0: none, a seeded x-vector only)

    @property
    def token_mel_ratio(self) -> int:
        return self.encoder.up_stride

    @property
    def pre_lookahead_len(self) -> int:
        return self.encoder.pre_lookahead_len

    @property
    def samples_per_token(self) -> int:
        return self.token_mel_ratio * self.hift.hop  # 960 at 25 Hz tokens, 24 kHz

    @property
    def crossfade_samples(self) -> int:
        return self.mel_cache_frames * self.hift.hop  # 3840: the tail each chunk holds back


def full_token2wav_config(**overrides) -> Token2WavConfig:
    """The published token2wav/ shapes (StepAudio2Decoder's, about 130M flow + 20M HiFT parameters)."""
    return Token2WavConfig(**overrides)


def tiny_token2wav_config(**overrides) -> Token2WavConfig:
    """Two blocks of everything, narrow; the published vocabulary (what the LM emits), 80 mels, hop 480.
    Its default voice has a 6-token prompt, so the prompt's setup call is part of every stream."""
    base = dict(
        encoder=EncoderConfig(input_size=64, output_size=64, attention_heads=2, linear_units=64, num_blocks=2,
                              num_up_blocks=2),
        estimator=DiTConfig(hidden_size=64, depth=2, num_heads=2, head_dim=16, mlp_ratio=2.0),
        hift=HiftConfig(base_channels=16, nb_harmonics=2, f0_channels=16),
        default_prompt_tokens=6,
    )  # fmt: skip
    base.update(overrides)
    return Token2WavConfig(**base)


def _count(state: dict[str, torch.Tensor], prefix: str) -> int:
    """How many numbered children `prefix.N.` the state dict holds."""
    numbers = {key[len(prefix) :].split(".", 1)[0] for key in state if key.startswith(prefix)}
    return len([n for n in numbers if n.isdigit()])


def config_from_state(flow: dict[str, torch.Tensor], hift: dict[str, torch.Tensor], **overrides) -> Token2WavConfig:
    """The shapes of a `flow.pt` / `hift.pt` pair (layer counts, widths; heads from the attention's
    per-head parameters). HiFT's upsampling rates and kernels stay the published ones."""
    vocab, width = flow["input_embedding.weight"].shape
    heads = flow["encoder.encoders.0.self_attn.pos_bias_u"].shape[0]
    encoder = EncoderConfig(
        input_size=width, output_size=flow["encoder.after_norm.weight"].shape[0], attention_heads=heads,
        linear_units=flow["encoder.encoders.0.feed_forward.w_1.weight"].shape[0],
        num_blocks=_count(flow, "encoder.encoders."), num_up_blocks=_count(flow, "encoder.up_encoders."),
        pre_lookahead_len=flow["encoder.pre_lookahead_layer.conv1.weight"].shape[2] - 1,
    )  # fmt: skip
    dit = "decoder.estimator."
    hidden = flow[dit + "in_proj.weight"].shape[0]
    head_dim = flow[dit + "blocks.0.attn.q_norm.weight"].shape[0]
    estimator = DiTConfig(
        in_channels=flow[dit + "in_proj.weight"].shape[1],
        out_channels=flow[dit + "final_layer.linear.weight"].shape[0],
        hidden_size=hidden, depth=_count(flow, dit + "blocks."),
        num_heads=flow[dit + "blocks.0.attn.to_q.weight"].shape[0] // head_dim, head_dim=head_dim,
        mlp_ratio=flow[dit + "blocks.0.mlp.fc1.weight"].shape[0] / hidden,
        frequency_embedding_size=flow[dit + "t_embedder.mlp.0.weight"].shape[1],
    )  # fmt: skip
    pre = next(key for key in hift if key.startswith("conv_pre.") and key.endswith(("original1", "weight_v", "weight")))
    vocoder = HiftConfig(
        base_channels=hift[pre].shape[0], nb_harmonics=hift["m_source.l_linear.weight"].shape[1] - 1,
        f0_channels=hift["f0_predictor.classifier.weight"].shape[1],
    )  # fmt: skip
    return Token2WavConfig(
        vocab_size=vocab, spk_embed_dim=flow["spk_embed_affine_layer.weight"].shape[1],
        mel_bins=flow["spk_embed_affine_layer.weight"].shape[0], encoder=encoder, estimator=estimator, hift=vocoder,
        **overrides,
    )  # fmt: skip
