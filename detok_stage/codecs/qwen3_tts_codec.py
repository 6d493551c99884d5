"""Qwen3-TTS-Tokenizer-12Hz detokenizer for the qwen3-tts family, streamed chunk by chunk.

The decoder is causal end to end (`qwen3_tts_decoder`), so a request's state (every causal
layer's left context, the transformer's windowed keys/values) is carried from chunk to chunk and
streamed audio equals one whole-utterance forward. A chunk that finds no state (first chunk, or a
replica that never saw the request) warms a fresh state on its left-context frames: exact from
the stream start, approximate mid-stream. Weights: the checkpoint's `speech_tokenizer/` folder,
or `codec_dir` (e.g. Qwen/Qwen3-TTS-Tokenizer-12Hz), or the seeded tiny preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.checkpoints import load_or_preset, load_prefixed_state, read_config, resolve_model_ref
from core.config import ModelConfig
from core.messages import TokenChunk
from detok_stage.codecs.base import CodecAdapter, keep_snapshot
from detok_stage.codecs.qwen3_tts_decoder import DecoderState, Qwen3TTSDecoder, decoder_fields

SPEECH_TOKENIZER_DIR = "speech_tokenizer"  # the codec's folder inside a Qwen3-TTS checkpoint


def tiny_tokenizer_config(num_quantizers: int = 4, codebook_size: int = 64) -> dict[str, Any]:
    """A speech_tokenizer config.json at toy widths with the published 1920x upsampling (24 kHz, 12.5 Hz);
    its codebooks match qwen3-tts-tiny's."""
    decoder = {
        "codebook_size": codebook_size, "codebook_dim": 32, "latent_dim": 32, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 16, "sliding_window": 8, "num_quantizers": num_quantizers, "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2], "decoder_dim": 32,
    }  # fmt: skip
    return {
        "model_type": "qwen3_tts_tokenizer_12hz", "decoder_config": decoder, "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
    }  # fmt: skip


def load_decoder(directory: Path) -> tuple[Qwen3TTSDecoder, int]:
    """A speech tokenizer folder (config.json + model.safetensors): its decoder and output sample rate."""
    config = read_config(directory)
    with torch.device("meta"):
        decoder = Qwen3TTSDecoder(decoder_fields(config.get("decoder_config") or {}))
    decoder.load_state_dict(load_prefixed_state(directory, "decoder."), strict=True, assign=True)
    decoder.pre_transformer.reset_rope()
    return decoder, int(config.get("output_sample_rate", 24000))


def preset_decoder(config: dict[str, Any] | None = None) -> tuple[Qwen3TTSDecoder, int]:
    """Random tiny weights with non-degenerate codebooks (the reference initialises them to zero), the
    output conv scaled so the waveform is audible but rarely clipped."""
    config = config or tiny_tokenizer_config()
    decoder = Qwen3TTSDecoder(decoder_fields(config["decoder_config"]))
    with torch.no_grad():
        for module in decoder.modules():
            if hasattr(module, "embedding_sum"):
                module.embedding_sum.normal_()
        for param in decoder.decoder[-1].parameters():
            param.mul_(0.3)
    return decoder, config["output_sample_rate"]


def codec_directory(config: ModelConfig) -> Path | None:
    """`codec_dir` when given, else the checkpoint's own speech_tokenizer/ folder, else None (preset)."""
    if config.codec_dir is not None:
        return resolve_model_ref(config.codec_dir, field="model.codec_dir")
    if config.checkpoint_dir is not None:
        return resolve_model_ref(config.checkpoint_dir) / SPEECH_TOKENIZER_DIR
    return None


@dataclass
class _StreamState:
    """A request's decoder state after its last chunk, and those from before its last chunks, by
    the frame each chunk began at."""

    next_frame: int
    state: DecoderState
    before: dict[int, DecoderState]


class Qwen3TTSCodec(CodecAdapter):
    is_stateful = True

    def __init__(self, decoder: Qwen3TTSDecoder, sample_rate_hz: int, device: str = "cpu") -> None:
        self.decoder = decoder.to(device).eval()
        self.device = device
        quantizer = decoder.quantizer
        self.codes_per_frame = 1 + len(quantizer.rvq_rest.vq.layers)
        self.codebook_size = quantizer.rvq_first.vq.layers[0]._codebook.cluster_usage.shape[0]
        self.samples_per_frame = decoder.samples_per_frame
        self.sample_rate_hz = sample_rate_hz
        self._streams: dict[str, _StreamState] = {}
        self.num_restored = 0  # chunks decoded again from a kept state (a stream resumed elsewhere)
        self.num_rebuilt = 0  # chunks mid-stream with no state here: rebuilt from their left context

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu") -> Qwen3TTSCodec:
        directory = codec_directory(model_config)
        decoder, rate = load_or_preset(
            directory,
            load=load_decoder,
            preset=lambda: preset_decoder(),
            seed=model_config.seed,
            field="model.codec_dir",
        )
        return cls(decoder, rate, device)

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """Offline: frames [B, n, K] -> audio [B, n * samples_per_frame], one forward from a fresh state."""
        return self.decoder(frames.transpose(1, 2).to(self.device)).float().cpu()

    @torch.inference_mode()
    def decode_stream(self, chunks: list[TokenChunk]) -> list[torch.Tensor]:
        """Audio of each chunk's kept frames, in list order (a request's chunks must come in seq order)."""
        return [self._decode_chunk(chunk) for chunk in chunks]

    def release(self, req_id: str) -> None:
        self._streams.pop(req_id, None)

    def _decode_chunk(self, chunk: TokenChunk) -> torch.Tensor:
        if chunk.keep_end == chunk.keep_start:  # an empty final (the stream ended on a chunk boundary)
            if chunk.is_final:
                self._streams.pop(chunk.req_id, None)
            return torch.zeros(0)
        frames = torch.tensor(chunk.frames, dtype=torch.long, device=self.device).T.unsqueeze(0)  # [1, K, n]
        state, before = self._state_at(chunk, frames)
        keep_snapshot(before, chunk.keep_start, state.snapshot())
        kept_frames = frames[:, :, chunk.keep_start - chunk.window_start : chunk.keep_end - chunk.window_start]
        audio = self.decoder(kept_frames, state)[0]
        if chunk.is_final:
            self._streams.pop(chunk.req_id, None)
        else:
            self._streams[chunk.req_id] = _StreamState(chunk.keep_end, state, before)
        return audio.float().cpu()

    def _state_at(self, chunk: TokenChunk, frames: torch.Tensor) -> tuple[DecoderState, dict[int, DecoderState]]:
        """The request's decoder state at the chunk's first kept frame (and its kept earlier states):
        the one carried from its last chunk; one from before a recent chunk when that chunk comes
        again (its LLM replica was lost before the router got the audio, and the stream resumed:
        the chunks since are cut again); else rebuilt from the chunk's left context (a cold replica:
        approximate, as the context is short)."""
        found = self._streams.get(chunk.req_id)
        if found is not None and found.next_frame == chunk.keep_start:
            return found.state, found.before
        if found is not None and chunk.keep_start in found.before:
            kept = {start: state for start, state in found.before.items() if start < chunk.keep_start}
            self.num_restored += 1
            return found.before[chunk.keep_start].snapshot(), kept
        self.num_rebuilt += chunk.keep_start > 0
        state = DecoderState(position=chunk.window_start)
        offset = chunk.keep_start - chunk.window_start
        if offset:
            self.decoder(frames[:, :, :offset], state)  # warm on the left context
        return state, {}
