"""A tiny GLM-4-Voice decoder written in THUDM/glm-4-voice-decoder's layout: `config.yaml` (HyperPyYAML
with `!new:` tags, the structure the reference's `flow_inference.AudioDecoder` loads), `flow.pt`
and `hift.pt` (state dicts under the published names; HiFT with weight_g / weight_v).

The published config.yaml was not readable here; its structure is rebuilt from the reference code
(cosyvoice/flow/flow.py, transformer/encoder.py, flow/decoder.py, hifigan/generator.py), CosyVoice
1's published cosyvoice.yaml and the defaults public re-implementations use. Assumed values: encoder
block_size 10, 6 blocks of 512 / 8 heads / 2048; estimator channels [256, 256], 4 blocks, 12 mid
blocks, 8 heads of 64; HiFT 512 base channels, 8 harmonics, upsampling [8, 8] / [16, 16].
"""

from __future__ import annotations

from pathlib import Path

import torch

from detok_stage.flow.glm_config import GLM4DecoderConfig
from detok_stage.flow.glm_model import GLM4Decoder


def _list(values) -> str:
    return "[" + ", ".join(_list(v) if isinstance(v, tuple | list) else str(v) for v in values) + "]"


def config_yaml(c: GLM4DecoderConfig) -> str:
    """The published config.yaml's `flow` and `hift` sections for shapes `c`."""
    e, u, h = c.encoder, c.estimator, c.hift
    return f"""# GLM-4-Voice decoder (tiny test layout of THUDM/glm-4-voice-decoder's config.yaml)
sample_rate: {h.sampling_rate}
spk_embed_dim: {c.spk_embed_dim}

flow: !new:cosyvoice.flow.flow.MaskedDiffWithXvec
    input_size: {e.input_size}
    output_size: {c.mel_bins}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {c.vocab_size}
    input_frame_rate: {c.input_frame_rate_hz}
    only_mask_loss: True
    encoder: !new:cosyvoice.transformer.encoder.BlockConformerEncoder
        output_size: {e.output_size}
        attention_heads: {e.attention_heads}
        linear_units: {e.linear_units}
        num_blocks: {e.num_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'block_rel_selfattn'
        input_size: {e.input_size}
        use_cnn_module: False
        macaron_style: False
        block_size: {e.block_size}
    length_regulator: !new:cosyvoice.flow.length_regulator.InterpolateRegulator
        channels: {c.mel_bins}
        sampling_ratios: {_list([1] * c.regulator_layers)}
    decoder: !new:cosyvoice.flow.flow_matching.ConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {c.mel_bins}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: {c.cfg_rate}
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.ConditionalDecoder
            in_channels: {u.in_channels}
            out_channels: {u.out_channels}
            channels: {_list(u.channels)}
            dropout: 0.0
            attention_head_dim: {u.attention_head_dim}
            n_blocks: {u.n_blocks}
            num_mid_blocks: {u.num_mid_blocks}
            num_heads: {u.num_heads}
            act_fn: 'gelu'

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: {h.in_channels}
    base_channels: {h.base_channels}
    nb_harmonics: {h.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {h.nsf_alpha}
    nsf_sigma: {h.nsf_sigma}
    nsf_voiced_threshold: {h.nsf_voiced_threshold}
    upsample_rates: {_list(h.upsample_rates)}
    upsample_kernel_sizes: {_list(h.upsample_kernel_sizes)}
    istft_params:
        n_fft: {h.istft_n_fft}
        hop_len: {h.istft_hop}
    resblock_kernel_sizes: {_list(h.resblock_kernel_sizes)}
    resblock_dilation_sizes: {_list(h.resblock_dilation_sizes)}
    source_resblock_kernel_sizes: {_list(h.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {_list(h.source_resblock_dilation_sizes)}
    lrelu_slope: {h.lrelu_slope}
    audio_limit: {h.audio_limit}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: {h.in_channels}
        cond_channels: {h.f0_channels}
"""


def write_glm4_voice_decoder(directory: Path, model: GLM4Decoder) -> Path:
    """Write `model` as a glm-4-voice-decoder directory; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(config_yaml(model.config))
    flow, hift = model.published_state()
    torch.save(flow, directory / "flow.pt")
    torch.save(hift, directory / "hift.pt")
    return directory
