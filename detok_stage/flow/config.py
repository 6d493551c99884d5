"""Shapes of the S3Gen / CosyVoice 2 detokenizer (token -> mel flow, mel -> wave HiFT).

`full_s3gen_config()` is the published CosyVoice2-0.5B `flow.pt` / `hift.pt` (and chatterbox's
`s3gen.pt`) layout; `tiny_s3gen_config()` keeps every published quirk that fixes a shape
(the encoder's 512 channels, 80 mel bins, 24 kHz, hop 480) but few layers and channels, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncoderConfig:
    """`UpsampleConformerEncoder`: linear embed -> pre-lookahead conv -> `num_blocks` rel-pos conformer
    blocks at 25 Hz -> x2 upsample conv -> `num_up_blocks` blocks at 50 Hz (chunk-causal attention)."""

    input_size: int = 512
    output_size: int = 512  # the published code hard-codes 512 for the pre-lookahead and upsample convs
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    up_stride: int = 2  # token_mel_ratio


@dataclass(frozen=True)
class EstimatorConfig:
    """`CausalConditionalDecoder`: a 1-level causal U-Net of resnet + transformer blocks over mel frames."""

    in_channels: int = 320  # x, mu, speaker, prompt-mel condition (80 each)
    out_channels: int = 80
    channels: int = 256
    attention_head_dim: int = 64
    num_heads: int = 8
    n_blocks: int = 4
    num_mid_blocks: int = 12


@dataclass(frozen=True)
class HiftConfig:
    """`HiFTGenerator` (NSF source + iSTFT) with its `ConvRNNF0Predictor`."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_channels: int = 512

    @property
    def hop(self) -> int:
        """Samples per mel frame (480 at 24 kHz: 50 Hz mel)."""
        n = self.istft_hop
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class S3GenConfig:
    vocab_size: int = 6561
    spk_embed_dim: int = 192
    mel_bins: int = 80
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    hift: HiftConfig = field(default_factory=HiftConfig)
    # Chunk-causal attention: a token attends to every token before the end of its chunk of
    # `chunk_tokens` (the encoder's `static_chunk_size`; the 50 Hz layers and the estimator use
    # 2x that in mel frames). 0 = full attention (chatterbox's offline default; not streamable).
    chunk_tokens: int = 25
    n_timesteps: int = 10  # Euler steps
    cfg_rate: float = 0.7  # (1 + rate) * cond - rate * uncond
    noise_seed: int = 0  # the fixed flow noise: randn(1, 80, noise_frames) from this seed, sliced by position
    noise_frames: int = 15000
    nsf_seed: int = 0  # the NSF source's harmonic phases and noise, keyed by sample position
    default_prompt_tokens: int = 0  # the preset's default voice (see `default_conditioning`)

    @property
    def token_mel_ratio(self) -> int:
        return self.encoder.up_stride

    @property
    def pre_lookahead_len(self) -> int:
        return self.encoder.pre_lookahead_len


def full_s3gen_config(**overrides) -> S3GenConfig:
    """CosyVoice2-0.5B / chatterbox S3Gen shapes (about 100M flow + 20M HiFT parameters)."""
    return S3GenConfig(**overrides)


def tiny_s3gen_config(**overrides) -> S3GenConfig:
    """Few layers and channels; the shapes the published code fixes stay (512-wide encoder, 80 mels, hop 480)."""
    base = dict(
        vocab_size=64,
        encoder=EncoderConfig(input_size=512, output_size=512, attention_heads=2, linear_units=64, num_blocks=1),
        estimator=EstimatorConfig(channels=32, attention_head_dim=16, num_heads=2, n_blocks=1, num_mid_blocks=1),
        hift=HiftConfig(base_channels=16, nb_harmonics=2, f0_channels=16),
        chunk_tokens=4,
        n_timesteps=10,
    )
    base.update(overrides)
    return S3GenConfig(**base)
