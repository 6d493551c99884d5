"""Loading published S3Gen weights, and seeded random weights that depend only on names and shapes.

`seeded_state_dict` fills any module's state dict from (seed, parameter name), so two
implementations with the same parameter names (ours and the published code) get the same random
weights without sharing an init order: that is how the parity goldens are made and checked.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:12], 16)) % (2**62)


def seeded_tensor(seed: int, name: str, like: torch.Tensor) -> torch.Tensor:
    """A random tensor for parameter `name` scaled so activations stay O(1) in deep random stacks."""
    if not like.is_floating_point():
        return torch.zeros_like(like)
    gen = torch.Generator().manual_seed(_name_seed(seed, name))
    noise = torch.randn(like.shape, generator=gen)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "running_var":
        return 1.0 + 0.1 * noise.abs()
    if leaf in ("alpha",):  # Snake
        return 1.0 + 0.1 * noise
    if like.dim() <= 1:
        if leaf == "weight" or leaf.endswith("original0"):  # norm gains, weight-norm magnitudes
            return 1.0 + 0.1 * noise
        return 0.02 * noise  # biases, attention position biases
    if leaf.endswith("original0"):  # weight-norm g: [out, 1, 1]
        return 1.0 + 0.1 * noise
    fan_in = like[0].numel() if "ups." not in name else like.shape[0] * like.shape[2]
    return noise / max(fan_in, 1) ** 0.5


def seeded_state_dict(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    return {name: seeded_tensor(seed, name, t) for name, t in module.state_dict().items()}


def load_seeded(module: nn.Module, seed: int) -> nn.Module:
    module.load_state_dict(seeded_state_dict(module, seed))
    return module


def strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def load_published(flow: nn.Module, hift: nn.Module, checkpoint: Path) -> None:
    """A CosyVoice2 directory (`flow.pt`, `hift.pt`) or chatterbox's `s3gen.pt` / `.safetensors`
    (`flow.*`, `mel2wav.*`, plus tokenizer and speaker-encoder tensors we do not use)."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir() and (checkpoint / "flow.pt").exists():
        flow.load_state_dict(torch.load(checkpoint / "flow.pt", map_location="cpu", weights_only=True))
        hift.load_state_dict(torch.load(checkpoint / "hift.pt", map_location="cpu", weights_only=True))
        return
    files = [checkpoint] if checkpoint.is_file() else sorted(checkpoint.glob("s3gen.*"))
    if not files:
        raise FileNotFoundError(f"{checkpoint}: neither flow.pt + hift.pt nor s3gen.pt / s3gen.safetensors")
    path = files[0]
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    flow.load_state_dict(strip_prefix(state, "flow."), strict=False)
    missing = set(flow.state_dict()) - set(strip_prefix(state, "flow."))
    if missing:
        raise KeyError(f"{path}: flow tensors missing: {sorted(missing)[:5]}")
    hift.load_state_dict(strip_prefix(state, "mel2wav."))


def parity_inputs(seed: int = 7, prompt_tokens: int = 5, tokens: int = 14, vocab: int = 64):
    """The fixed inputs of the parity goldens: (prompt tokens [P], prompt mel [2P, 80], x-vector [192], tokens [N])."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen)
    prompt_mel = torch.randn(2 * prompt_tokens, 80, generator=gen)
    xvector = torch.randn(192, generator=gen)
    toks = torch.randint(0, vocab, (tokens,), generator=gen)
    return prompt, prompt_mel, xvector, toks
