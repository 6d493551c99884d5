"""CAM++ ("campplus"), the speaker encoder CosyVoice 2 and Chatterbox condition S3Gen on: 16 kHz
speech -> a 192-dim x-vector.

Kaldi fbank (80 bins, mean-normalised over time) -> a 2-D residual front end (FCM) -> a TDNN ->
three densely connected blocks of context-aware-masking TDNN layers, each followed by a halving
transit layer -> mean + std pooling -> a dense layer with a non-affine batch norm. Parameter
names follow the published torch definition (3D-Speaker / CosyVoice / chatterbox's
`speaker_encoder.*` keys in s3gen.safetensors), so published weights load as is.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detok_stage.voice.features import kaldi_fbank

SEGMENT_FRAMES = 100  # CAM's segment pooling length


@dataclass(frozen=True)
class CAMPPlusConfig:
    feat_dim: int = 80
    embedding_size: int = 192
    growth_rate: int = 32
    bn_size: int = 4
    init_channels: int = 128
    fcm_channels: int = 32
    block_layers: tuple[int, int, int] = (12, 24, 16)
    block_dilations: tuple[int, int, int] = (1, 2, 2)


def tiny_campplus_config() -> CAMPPlusConfig:
    """Narrow layers; the published depth (12 / 24 / 16) and front end, so the published code builds it too."""
    return CAMPPlusConfig(growth_rate=8, bn_size=2, init_channels=32)


def bn_relu(channels: int) -> nn.Sequential:
    return nn.Sequential(OrderedDict(batchnorm=nn.BatchNorm1d(channels), relu=nn.ReLU()))


class ResBlock2d(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=(stride, 1), bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class FCM(nn.Module):
    """2-D front end over (frequency, time): the frequency axis shrinks 8x."""

    def __init__(self, channels: int, feat_dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(ResBlock2d(channels, channels, 2), ResBlock2d(channels, channels, 1))
        self.layer2 = nn.Sequential(ResBlock2d(channels, channels, 2), ResBlock2d(channels, channels, 1))
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.out_channels = channels * (feat_dim // 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x.unsqueeze(1))))
        out = F.relu(self.bn2(self.conv2(self.layer2(self.layer1(out)))))
        return out.flatten(1, 2)


class TDNNLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, kernel, stride=stride, padding=(kernel - 1) // 2, bias=False)
        self.nonlinear = bn_relu(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x))


class CAMLayer(nn.Module):
    """A local conv gated by a context mask from the utterance mean plus 100-frame segment means."""

    def __init__(self, channels: int, out_channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        padding = (kernel - 1) // 2 * dilation
        self.linear_local = nn.Conv1d(channels, out_channels, kernel, padding=padding, dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(channels, channels // 2, 1)
        self.linear2 = nn.Conv1d(channels // 2, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear_local(x)
        context = x.mean(-1, keepdim=True) + segment_means(x)
        return local * torch.sigmoid(self.linear2(F.relu(self.linear1(context))))


def segment_means(x: torch.Tensor) -> torch.Tensor:
    """Each frame's 100-frame segment mean (the last segment averages what it has)."""
    seg = F.avg_pool1d(x, SEGMENT_FRAMES, SEGMENT_FRAMES, ceil_mode=True)
    return seg.repeat_interleave(SEGMENT_FRAMES, dim=-1)[..., : x.shape[-1]]


class CAMDenseLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, bn_channels: int, dilation: int) -> None:
        super().__init__()
        self.nonlinear1 = bn_relu(in_channels)
        self.linear1 = nn.Conv1d(in_channels, bn_channels, 1, bias=False)
        self.nonlinear2 = bn_relu(bn_channels)
        self.cam_layer = CAMLayer(bn_channels, out_channels, 3, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))


class CAMDenseBlock(nn.ModuleDict):
    def __init__(self, layers: int, in_channels: int, growth: int, bn_channels: int, dilation: int) -> None:
        super().__init__(
            {
                f"tdnnd{i + 1}": CAMDenseLayer(in_channels + i * growth, growth, bn_channels, dilation)
                for i in range(layers)
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.values():
            x = torch.cat([x, layer(x)], dim=1)
        return x


class TransitLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.nonlinear = bn_relu(in_channels)
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.nonlinear(x))


class StatsPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)


class DenseLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)
        self.nonlinear = nn.Sequential(OrderedDict(batchnorm=nn.BatchNorm1d(out_channels, affine=False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x.unsqueeze(-1)).squeeze(-1))


class CAMPPlus(nn.Module):
    def __init__(self, config: CAMPPlusConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or CAMPPlusConfig()
        self.head = FCM(config.fcm_channels, config.feat_dim)
        layers: OrderedDict[str, nn.Module] = OrderedDict(
            tdnn=TDNNLayer(self.head.out_channels, config.init_channels, 5, stride=2)
        )
        channels = config.init_channels
        for i, (depth, dilation) in enumerate(zip(config.block_layers, config.block_dilations, strict=True)):
            layers[f"block{i + 1}"] = CAMDenseBlock(
                depth, channels, config.growth_rate, config.bn_size * config.growth_rate, dilation
            )
            channels += depth * config.growth_rate
            layers[f"transit{i + 1}"] = TransitLayer(channels, channels // 2)
            channels //= 2
        layers["out_nonlinear"] = bn_relu(channels)
        layers["stats"] = StatsPool()
        layers["dense"] = DenseLayer(2 * channels, config.embedding_size)
        self.xvector = nn.Sequential(layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, feat_dim] -> x-vectors [B, embedding_size]."""
        return self.xvector(self.head(features.transpose(1, 2)))

    @torch.inference_mode()
    def embed(self, wave_16k: torch.Tensor) -> torch.Tensor:
        """One clip [N] at 16 kHz -> its x-vector [embedding_size]."""
        features = kaldi_fbank(wave_16k.float(), self.config.feat_dim)
        features = features - features.mean(dim=0, keepdim=True)
        return self(features[None])[0]
