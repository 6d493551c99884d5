"""Mimi detokenizer (transformers `MimiModel`) for the CSM family, streamed chunk by chunk.

Mimi's decoder is causal: RVQ dequantize -> transposed-conv upsample (needs the previous
latent frame) -> sliding-window transformer (KV cache carried across a request's chunks) ->
SEANet convs (fed the last `conv_context_steps` transformer outputs again as left context).
A chunk that finds no state (first chunk, or a replica that never saw the request) warms a
fresh state on its left-context frames: exact from the stream start, approximate mid-stream.
A chunk that comes again (its stream resumed on another LLM replica) decodes from the state kept
from before it (one per recent chunk): exact.
Weights: `kyutai/mimi` (or a dir) as `codec_dir`, else the Mimi inside the CSM checkpoint, else a
seeded random preset (random codebooks too: `with_random_codebooks`); one MimiModel per process,
shared with CSM's LM adapter (`shared_mimi`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, MimiConfig, MimiModel
from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook

from core.checkpoints import (
    ModelRef,
    hf_loader,
    load_or_preset,
    load_prefixed_state,
    read_config,
    resolve_model_ref,
    shared,
)
from core.config import ModelConfig
from core.messages import TokenChunk
from detok_stage.codecs.base import CodecAdapter, keep_snapshot


@dataclass
class MimiStreamState:
    """Per request: where the stream is, and what the next chunk needs from the past."""

    next_frame: int
    cache: DynamicCache
    prev_latent: torch.Tensor | None = None  # [1, C, 1] last dequantized frame (upsample context)
    out_tail: torch.Tensor | None = None  # [1, C, S] last transformer outputs (SEANet context)
    # the states its last chunks started from, by their first frame (SNAPSHOTS_KEPT at most)
    before: dict[int, MimiStreamState] = field(default_factory=dict)

    def snapshot(self) -> MimiStreamState:
        """A copy that later decoding leaves as it is: the cache's layers and this state replace
        their tensors, never write into them (transformers' DynamicLayer / sliding-window layer)."""
        cache = copy.copy(self.cache)
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        return MimiStreamState(self.next_frame, cache, self.prev_latent, self.out_tail)


def tiny_mimi_config(num_quantizers: int) -> dict:
    """A small Mimi (24 kHz) whose codebooks match the tiny CSM's."""
    return {
        "model_type": "mimi", "hidden_size": 32, "num_filters": 8, "num_residual_layers": 1,
        "upsampling_ratios": [8, 4], "codebook_size": 64, "vector_quantization_hidden_dimension": 64,
        "upsample_groups": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "sliding_window": 4, "codebook_dim": 64, "use_cache": True, "num_quantizers": num_quantizers,
        "num_semantic_quantizers": 1,
    }  # fmt: skip


def load_mimi(codec_dir: ModelRef | None, seed: int, preset: dict | None) -> MimiModel:
    model = load_or_preset(
        codec_dir,
        load=hf_loader(MimiModel),
        preset=lambda: with_random_codebooks(MimiModel(MimiConfig(**(preset or {})))),
        seed=seed,
        field="model.codec_dir",
    )
    return model.eval()


def with_random_codebooks(model: MimiModel) -> MimiModel:
    """`model` with random RVQ centroids, drawn from torch's generator (seeded by the preset, like the
    rest of its weights) with the std of its other weights (`initializer_range`: larger ones push the
    random decoder's audio far past full scale): transformers builds them as zeros, so every code
    would decode alike."""
    std = model.config.initializer_range
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MimiEuclideanCodebook):
                module.embed_sum.normal_(0.0, std)  # [codebook_size, codebook_dim]
    return forget_cached_centroids(model)


def forget_cached_centroids(model: MimiModel) -> MimiModel:
    """`model` with its RVQ centroids no longer cached: each codebook caches them on first use
    (embed_sum / cluster_usage) outside its buffers, so `.to(device)` leaves a cache made earlier
    (CSM's encoder on the LM side shares this model) on the old device; recomputed on next use."""
    for module in model.modules():
        if isinstance(module, MimiEuclideanCodebook):
            module._embed = None
    return model


def load_mimi_from_csm(checkpoint: Path) -> MimiModel:
    """The Mimi inside a CSM checkpoint (`codec_config` in its config.json, `codec_model.*` tensors)."""
    model = MimiModel(MimiConfig.from_dict(read_config(checkpoint)["codec_config"]))
    model.load_state_dict(load_prefixed_state(checkpoint, "codec_model."))
    return model.eval()


def shared_mimi(model_config: ModelConfig, preset: dict | None = None, loaded: MimiModel | None = None) -> MimiModel:
    """This process's one Mimi for `model_config`, shared by its encoder user (CSM's `codec_model`) and
    the detokenizer: from `codec_dir` (e.g. kyutai/mimi) when given, else from the CSM checkpoint's own
    codec weights (`loaded` when the caller already holds them), else the seeded preset."""
    if model_config.codec_dir is not None:
        path = resolve_model_ref(model_config.codec_dir, field="model.codec_dir")
        return shared(("mimi", str(path)), lambda: load_mimi(path, model_config.seed, preset))
    if model_config.checkpoint_dir is not None:
        path = resolve_model_ref(model_config.checkpoint_dir)
        return shared(("mimi", str(path), "codec_model"), lambda: loaded or load_mimi_from_csm(path))
    key = ("mimi-preset", model_config.seed, json.dumps(preset, sort_keys=True))
    return shared(key, lambda: load_mimi(None, model_config.seed, preset))


class MimiCodec(CodecAdapter):
    is_stateful = True

    def __init__(self, model: MimiModel, device: str = "cpu", conv_context_steps: int = 8) -> None:
        self.model = forget_cached_centroids(model.to(device))
        self.device = device
        self.decoder = model.decoder
        cfg = model.config
        self.codes_per_frame = cfg.num_quantizers
        self.codebook_size = cfg.codebook_size
        self.sample_rate_hz = cfg.sampling_rate
        self.steps_per_frame = self.decoder.upsample.conv.stride[0] if self.decoder.upsample is not None else 1
        self.samples_per_step = int(torch.tensor(cfg.upsampling_ratios).prod())
        self.samples_per_frame = self.steps_per_frame * self.samples_per_step
        self.conv_context_steps = conv_context_steps
        self._states: dict[str, MimiStreamState] = {}

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu", preset: dict | None = None) -> MimiCodec:
        return cls(shared_mimi(model_config, preset or tiny_mimi_config(8)), device)

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """Offline: frames [B, n, K] -> audio [B, n * samples_per_frame]."""
        audio = self.model.decode(frames.transpose(1, 2).to(self.device)).audio_values
        return audio[:, 0, : frames.shape[1] * self.samples_per_frame].float().cpu()

    @torch.inference_mode()
    def decode_stream(self, chunks: list[TokenChunk]) -> list[torch.Tensor]:
        """Audio of each chunk's kept frames, in list order (a request's chunks must come in seq order)."""
        return [self._decode_chunk(chunk) for chunk in chunks]

    def release(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def _decode_chunk(self, chunk: TokenChunk) -> torch.Tensor:
        frames = torch.tensor(chunk.frames, dtype=torch.long, device=self.device)  # [n, K]
        keep = frames[chunk.keep_start - chunk.window_start : chunk.keep_end - chunk.window_start]
        state = self._state_at(chunk, frames)
        keep_snapshot(state.before, chunk.keep_start, state.snapshot())
        audio = self._advance(state, keep)
        if chunk.is_final:
            self._states.pop(chunk.req_id, None)
        else:
            self._states[chunk.req_id] = state
        return audio.float().cpu()

    def _state_at(self, chunk: TokenChunk, frames: torch.Tensor) -> MimiStreamState:
        """The request's state at the chunk's first kept frame: carried from its last chunk; from
        before a recent chunk when that chunk comes again (its LLM replica was lost before the
        router got the audio, and the stream resumed: the chunks since are cut again); else warmed
        on the chunk's left context (a cold replica: approximate mid-stream)."""
        state = self._states.get(chunk.req_id)
        if state is not None and state.next_frame == chunk.keep_start:
            return state
        if state is not None and chunk.keep_start in state.before:
            restored = state.before[chunk.keep_start].snapshot()
            restored.before = {start: kept for start, kept in state.before.items() if start < chunk.keep_start}
            return restored
        state = MimiStreamState(chunk.window_start, DynamicCache(config=self.decoder.config))
        self._advance(state, frames[: chunk.keep_start - chunk.window_start])  # warm on the left context
        return state

    def _advance(self, state: MimiStreamState, frames: torch.Tensor) -> torch.Tensor:
        """Push frames [n, K] through the decoder; returns their n * samples_per_frame samples."""
        if frames.shape[0] == 0:
            return torch.zeros(0)
        latents = self.model.quantizer.decode(frames.T.unsqueeze(0))  # [1, C, n]
        with_prev = latents if state.prev_latent is None else torch.cat([state.prev_latent, latents], dim=2)
        steps = self.decoder.upsample(with_prev) if self.decoder.upsample is not None else with_prev
        steps = steps[:, :, steps.shape[2] - frames.shape[0] * self.steps_per_frame :]  # drop the context frame
        out = self.decoder.decoder_transformer(steps.transpose(1, 2), cache=state.cache, use_cache=True)
        hidden = out.last_hidden_state.transpose(1, 2)  # [1, C, n * steps_per_frame]
        tail = state.out_tail if state.out_tail is not None else hidden[:, :, :0]
        audio = self.decoder.decoder_seanet(torch.cat([tail, hidden], dim=2))[0, 0]
        state.prev_latent = latents[:, :, -1:]
        joined = torch.cat([tail, hidden], dim=2)
        state.out_tail = joined[:, :, joined.shape[2] - min(self.conv_context_steps, joined.shape[2]) :]
        state.next_frame += frames.shape[0]
        return audio[tail.shape[2] * self.samples_per_step :]
