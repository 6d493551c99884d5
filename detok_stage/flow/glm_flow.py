"""Token -> mel for GLM-4-Voice: CosyVoice 1's `MaskedDiffWithXvec` as GLM-4-Voice-Decoder retrained it.

[prompt tokens, tokens] -> embedding -> `BlockConformerEncoder` (the S3Gen encoder's rel-pos conformer
layers, attention block-causal over `block_size` tokens) -> `encoder_proj` -> `InterpolateRegulator`
(nearest resampling to int(N / 12.5 * 22050 / 256) frames + a conv stack) -> 10 cosine-scheduled
Euler steps of the non-causal U-Net estimator with CFG, from noise drawn by the caller's generator
(the reference seeds 42 before each call). One sequence per call, as the reference runs it.
Parameter names follow the published `flow.pt`. Called by `glm_model.GLM4Decoder`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.flow.attention import AttnCall
from detok_stage.flow.encoder import ConformerEncoderLayer, LinearEmbed
from detok_stage.flow.estimator import BasicTransformerBlock, StreamCtx, TimestepEmbedding, sinusoidal_embedding
from detok_stage.flow.glm_config import BlockEncoderConfig, GLM4DecoderConfig, UNetConfig


class BlockConformerEncoder(nn.Module):
    def __init__(self, config: BlockEncoderConfig) -> None:
        super().__init__()
        self.config = config
        d = config.output_size
        self.embed = LinearEmbed(config.input_size, d)
        self.encoders = nn.ModuleList(
            [ConformerEncoderLayer(d, config.attention_heads, config.linear_units) for _ in range(config.num_blocks)]
        )
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, input_size] (whole sequences from position 0) -> [B, N, output_size]."""
        x = self.embed(x)
        for layer in self.encoders:
            x = layer(x, AttnCall(), None, self.config.block_size)
        return self.after_norm(x)


class InterpolateRegulator(nn.Module):
    """Nearest resampling in time, then `layers` x (conv 3, GroupNorm(1), Mish) and a 1x1 conv."""

    def __init__(self, channels: int, layers: int) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Conv1d(channels, channels, 3, 1, 1), nn.GroupNorm(1, channels), nn.Mish()]
        mods.append(nn.Conv1d(channels, channels, 1, 1))
        self.model = nn.Sequential(*mods)

    def forward(self, h: torch.Tensor, frames: int) -> torch.Tensor:
        """h [B, N, C] -> [B, C, frames]."""
        return self.model(F.interpolate(h.transpose(1, 2), size=frames, mode="nearest"))


class Block1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, groups: int = 8) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(dim, dim_out, 3, padding=1), nn.GroupNorm(groups, dim_out), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class ResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = Block1D(dim, dim_out)
        self.block2 = Block1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x) + self.mlp(temb).unsqueeze(-1)
        return self.block2(h) + self.res_conv(x)


class Resample1D(nn.Module):
    """Matcha's `Downsample1D` (conv 3, stride 2) / `Upsample1D` (transposed conv 4, stride 2): `conv`."""

    def __init__(self, dim: int, up: bool) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1) if up else nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class ConditionalDecoder(nn.Module):
    """The U-Net: per level (resnet, transformer blocks, down/up sampling or a conv 3 at the last)."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        chans = tuple(config.channels)
        tdim = chans[0] * 4
        self.time_mlp = TimestepEmbedding(config.in_channels, tdim)

        def blocks(dim: int) -> nn.ModuleList:
            return nn.ModuleList(
                [
                    BasicTransformerBlock(dim, config.num_heads, config.attention_head_dim)
                    for _ in range(config.n_blocks)
                ]
            )

        self.down_blocks = nn.ModuleList()
        prev = config.in_channels
        for i, ch in enumerate(chans):
            last = i == len(chans) - 1
            sample = nn.Conv1d(ch, ch, 3, padding=1) if last else Resample1D(ch, up=False)
            self.down_blocks.append(nn.ModuleList([ResnetBlock1D(prev, ch, tdim), blocks(ch), sample]))
            prev = ch
        self.mid_blocks = nn.ModuleList(
            [
                nn.ModuleList([ResnetBlock1D(chans[-1], chans[-1], tdim), blocks(chans[-1])])
                for _ in range(config.num_mid_blocks)
            ]
        )
        ups = chans[::-1] + (chans[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            last = i == len(ups) - 2
            ch = ups[i + 1]
            sample = nn.Conv1d(ch, ch, 3, padding=1) if last else Resample1D(ch, up=True)
            self.up_blocks.append(nn.ModuleList([ResnetBlock1D(2 * ups[i], ch, tdim), blocks(ch), sample]))
        self.final_block = Block1D(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], config.out_channels, 1)

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """x, mu, cond [B, 80, T]; t [B]; spks [B, 80] -> velocity [B, 80, T] (full attention, no padding)."""
        temb = self.time_mlp(sinusoidal_embedding(t, self.config.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)
        ctx = StreamCtx(0, None)

        def transformers(h: torch.Tensor, tblocks: nn.ModuleList) -> torch.Tensor:
            h = h.transpose(1, 2)
            for block in tblocks:
                h = block(h, ctx)
            return h.transpose(1, 2)

        skips = []
        for resnet, tblocks, sample in self.down_blocks:
            h = transformers(resnet(h, temb), tblocks)
            skips.append(h)
            h = sample(h)
        for resnet, tblocks in self.mid_blocks:
            h = transformers(resnet(h, temb), tblocks)
        for resnet, tblocks, sample in self.up_blocks:
            skip = skips.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)
            h = sample(transformers(resnet(h, temb), tblocks))
        return self.final_proj(self.final_block(h))


class ConditionalCFM(nn.Module):
    """Holds the estimator under the published name `decoder.estimator`."""

    def __init__(self, estimator: ConditionalDecoder) -> None:
        super().__init__()
        self.estimator = estimator


class MaskedDiffWithXvec(nn.Module):
    def __init__(self, config: GLM4DecoderConfig) -> None:
        super().__init__()
        self.config = config
        enc = config.encoder
        self.input_embedding = nn.Embedding(config.vocab_size, enc.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.mel_bins)
        self.encoder = BlockConformerEncoder(enc)
        self.encoder_proj = nn.Linear(enc.output_size, config.mel_bins)
        self.length_regulator = InterpolateRegulator(config.mel_bins, config.regulator_layers)
        self.decoder = ConditionalCFM(ConditionalDecoder(config.estimator))

    def mel_frames(self, num_tokens: int) -> int:
        """The reference's feat_len: int(N / frame rate * 22050 / 256), computed in float32 as it does."""
        n = torch.tensor([num_tokens], dtype=torch.int32)
        return int((n / self.config.input_frame_rate_hz * 22050 / 256).int())

    @torch.inference_mode()
    def inference(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                  xvector: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # fmt: skip
        """tokens [N], prompt tokens [P], prompt mel [80, Fp], x-vector [192] -> mel [80, F - Fp], where
        F = mel_frames(P + N); the initial noise [1, 80, F] is the next draw of `gen` (a CPU generator)."""
        device = self.input_embedding.weight.device
        seq = torch.cat([prompt_tokens.reshape(-1), tokens.reshape(-1)]).long().to(device)
        spks = self.spk_embed_affine_layer(F.normalize(xvector.reshape(1, -1).to(device).float(), dim=1))
        h = self.encoder_proj(self.encoder(self.input_embedding(seq.clamp(min=0))[None]))
        frames = self.mel_frames(seq.numel())
        mu = self.length_regulator(h, frames)  # [1, 80, F]
        cond = torch.zeros_like(mu)
        p_frames = prompt_mel.shape[1]
        cond[0, :, :p_frames] = prompt_mel.to(mu)
        z = torch.randn(1, self.config.mel_bins, frames, generator=gen).to(device)
        return self._euler(z, mu, spks, cond)[0, :, p_frames:]

    def _euler(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The reference's solver: t advanced by dt (not read from the schedule), CFG against zeroed
        mu / speaker / cond; the two estimator calls of a step run as one batch of 2 rows."""
        n = self.config.n_timesteps
        rate = self.config.cfg_rate
        t_span = 1 - torch.cos(torch.linspace(0, 1, n + 1, device=x.device) * 0.5 * torch.pi)
        t, dt = t_span[0], t_span[1] - t_span[0]
        mu_in, spks_in, cond_in = (torch.cat([v, torch.zeros_like(v)]) for v in (mu, spks, cond))
        estimator = self.decoder.estimator
        for step in range(1, n + 1):
            v = estimator(x.expand(2, -1, -1), mu_in, t.expand(2), spks_in, cond_in)
            x = x + dt * ((1.0 + rate) * v[:1] - rate * v[1:])
            t = t + dt
            if step < n:
                dt = t_span[step + 1] - t
        return x
