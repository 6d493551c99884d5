"""Shapes of GLM-4-Voice's detokenizer (THUDM/glm-4-voice-decoder) and its `config.yaml` read as data.

The decoder is CosyVoice 1's `MaskedDiffWithXvec` retrained on 12.5 Hz tokens: a block-causal
conformer encoder, nearest-neighbour length regulation to 22050/256 Hz mels, a non-causal U-Net
flow-matching estimator, and HiFT at 22.05 kHz. `GLM4DecoderConfig.from_yaml` reads the published
HyperPyYAML without importing or constructing anything; `tiny_glm4_decoder_config` is the test preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.errors import InvalidArgumentError
from core.hyperpyyaml import Tagged, load_data, resolve_ref
from detok_stage.flow.config import HiftConfig


@dataclass(frozen=True)
class BlockEncoderConfig:
    """`BlockConformerEncoder`: linear embed, `num_blocks` rel-pos conformer blocks whose attention
    sees every earlier token and the rest of its own block of `block_size` tokens."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    block_size: int = 10  # assumed (the published config.yaml was not readable here); see docs


@dataclass(frozen=True)
class UNetConfig:
    """CosyVoice 1's `ConditionalDecoder`: a non-causal U-Net (GroupNorm resnets + transformer blocks)."""

    in_channels: int = 320  # x, mu, speaker, prompt-mel condition (80 each)
    out_channels: int = 80
    channels: tuple[int, ...] = (256, 256)
    attention_head_dim: int = 64
    num_heads: int = 8
    n_blocks: int = 4
    num_mid_blocks: int = 12


def glm4_hift_config(**overrides) -> HiftConfig:
    """HiFT at 22.05 kHz: two upsamples (8, 8) x iSTFT hop 4 = 256 samples per mel frame."""
    base: dict[str, Any] = dict(
        sampling_rate=22050,
        upsample_rates=(8, 8),
        upsample_kernel_sizes=(16, 16),
        source_resblock_kernel_sizes=(7, 11),
        source_resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
    )
    base.update(overrides)
    return HiftConfig(**base)


@dataclass(frozen=True)
class GLM4DecoderConfig:
    vocab_size: int = 16384
    input_frame_rate_hz: float = 12.5
    spk_embed_dim: int = 192
    mel_bins: int = 80
    regulator_layers: int = 4  # InterpolateRegulator's sampling_ratios: [1, 1, 1, 1]
    encoder: BlockEncoderConfig = field(default_factory=BlockEncoderConfig)
    estimator: UNetConfig = field(default_factory=UNetConfig)
    hift: HiftConfig = field(default_factory=glm4_hift_config)
    n_timesteps: int = 10  # the reference's flow calls the CFM with 10 Euler steps
    cfg_rate: float = 0.7
    noise_seed: int = 42  # the reference seeds torch's generator with 42 before each flow call
    # the demo's block streaming (flow_inference.AudioDecoder)
    token_overlap_len: int = 5  # tokens whose mel frames cross-fade into the next block
    mel_cache_len: int = 1  # mel frames HiFT re-reads at the next block (their source is carried)

    @property
    def mel_rate_hz(self) -> float:
        return self.hift.sampling_rate / self.hift.hop

    @property
    def mel_overlap_len(self) -> int:
        return int(self.token_overlap_len / self.input_frame_rate_hz * 22050 / 256)

    @property
    def samples_per_token(self) -> int:
        return round(self.hift.sampling_rate / self.input_frame_rate_hz)

    @classmethod
    def from_yaml(cls, path: Path, field_name: str = "model.codec_dir") -> GLM4DecoderConfig:
        return config_from_yaml_text(Path(path).read_text(), str(path), field_name)


def tiny_glm4_decoder_config(**overrides) -> GLM4DecoderConfig:
    """Few layers and channels; the published vocabulary, frame rates and streaming constants stay."""
    base: dict[str, Any] = dict(
        encoder=BlockEncoderConfig(
            input_size=32, output_size=32, attention_heads=2, linear_units=64, num_blocks=2, block_size=4
        ),
        estimator=UNetConfig(channels=(32, 32), attention_head_dim=16, num_heads=2, n_blocks=1, num_mid_blocks=1),
        hift=glm4_hift_config(base_channels=16, nb_harmonics=2, f0_channels=16),
    )
    base.update(overrides)
    return GLM4DecoderConfig(**base)


# ---- config.yaml (HyperPyYAML) as data ---------------------------------------------------------


def config_from_yaml_text(text: str, source: str, field_name: str) -> GLM4DecoderConfig:
    """The `flow:` and `hift:` sections -> shapes; a section of another class is an error naming the field."""
    top = load_data(text)
    if not isinstance(top, dict):
        raise InvalidArgumentError(field_name, f"{source}: not a mapping")

    def section(node: Any, cls_name: str, where: str) -> dict[str, Any]:
        if not isinstance(node, Tagged) or not node.tag.endswith("." + cls_name) or not isinstance(node.value, dict):
            raise InvalidArgumentError(field_name, f"{source}: `{where}` is not a {cls_name}")
        return {k: resolve_ref(top, v) for k, v in node.value.items()}

    flow = section(top.get("flow"), "MaskedDiffWithXvec", "flow")
    enc = section(flow.get("encoder"), "BlockConformerEncoder", "flow.encoder")
    cfm = section(flow.get("decoder"), "ConditionalCFM", "flow.decoder")
    unet = section(cfm.get("estimator"), "ConditionalDecoder", "flow.decoder.estimator")
    reg = section(flow.get("length_regulator"), "InterpolateRegulator", "flow.length_regulator")
    hift = section(top.get("hift"), "HiFTGenerator", "hift")
    f0 = section(hift.get("f0_predictor"), "ConvRNNF0Predictor", "hift.f0_predictor")
    params = cfm.get("cfm_params")
    params = resolve_ref(top, params.value.get("content", {})) if isinstance(params, Tagged) else params or {}
    istft = hift.get("istft_params", {"n_fft": 16, "hop_len": 4})
    defaults = GLM4DecoderConfig()
    return replace(
        defaults,
        vocab_size=int(flow.get("vocab_size", 4096)),
        input_frame_rate_hz=float(flow.get("input_frame_rate", 50)),
        spk_embed_dim=int(flow.get("spk_embed_dim", 192)),
        mel_bins=int(flow.get("output_size", 80)),
        regulator_layers=len(reg.get("sampling_ratios", ())),
        encoder=BlockEncoderConfig(
            input_size=int(enc.get("input_size", flow.get("input_size", 512))),
            output_size=int(enc.get("output_size", 256)),
            attention_heads=int(enc.get("attention_heads", 4)),
            linear_units=int(enc.get("linear_units", 2048)),
            num_blocks=int(enc.get("num_blocks", 6)),
            block_size=int(enc.get("block_size", 25)),
        ),
        estimator=UNetConfig(
            in_channels=int(unet["in_channels"]),
            out_channels=int(unet["out_channels"]),
            channels=tuple(int(c) for c in unet.get("channels", (256, 256))),
            attention_head_dim=int(unet.get("attention_head_dim", 64)),
            num_heads=int(unet.get("num_heads", 4)),
            n_blocks=int(unet.get("n_blocks", 1)),
            num_mid_blocks=int(unet.get("num_mid_blocks", 2)),
        ),
        cfg_rate=float(params.get("inference_cfg_rate", defaults.cfg_rate)),
        hift=glm4_hift_config(
            in_channels=int(hift.get("in_channels", 80)),
            base_channels=int(hift.get("base_channels", 512)),
            nb_harmonics=int(hift.get("nb_harmonics", 8)),
            sampling_rate=int(hift.get("sampling_rate", 22050)),
            nsf_alpha=float(hift.get("nsf_alpha", 0.1)),
            nsf_sigma=float(hift.get("nsf_sigma", 0.003)),
            nsf_voiced_threshold=float(hift.get("nsf_voiced_threshold", 10)),
            upsample_rates=tuple(hift.get("upsample_rates", (8, 8))),
            upsample_kernel_sizes=tuple(hift.get("upsample_kernel_sizes", (16, 16))),
            istft_n_fft=int(istft["n_fft"]),
            istft_hop=int(istft["hop_len"]),
            resblock_kernel_sizes=tuple(hift.get("resblock_kernel_sizes", (3, 7, 11))),
            resblock_dilation_sizes=tuple(tuple(d) for d in hift.get("resblock_dilation_sizes", ((1, 3, 5),) * 3)),
            source_resblock_kernel_sizes=tuple(hift.get("source_resblock_kernel_sizes", (7, 11))),
            source_resblock_dilation_sizes=tuple(
                tuple(d) for d in hift.get("source_resblock_dilation_sizes", ((1, 3, 5),) * 2)
            ),
            lrelu_slope=float(hift.get("lrelu_slope", 0.1)),
            audio_limit=float(hift.get("audio_limit", 0.99)),
            f0_channels=int(f0.get("cond_channels", 512)),
        ),
    )
