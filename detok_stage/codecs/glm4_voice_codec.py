"""GLM-4-Voice's detokenizer as a stateful codec: 12.5 Hz speech tokens (16384 codes, one per frame)
-> 22.05 kHz audio, streamed per chunk the way the reference demo streams token blocks.

Each chunk's kept tokens are one block of `flow_inference.AudioDecoder.token2wav`: decoded with
every earlier token and every earlier block's mel as the prompt, cross-faded into the mel the block
before held back, HiFT continuing from the carried mel frame and source. So the streamed audio is
the reference's streaming of the same blocks, and depends on where the chunks cut (the final chunk
flushes). A non-final chunk keeping fewer than `MIN_BLOCK_TOKENS` tokens is held and decoded with
the next one (the reference's cross-fade needs that many frames). Speaker: the demo's zero x-vector.

Cache miss (a chunk on a replica without the request's state): rebuilt from the chunk's history,
which must start at token 0; the earlier tokens are decoded as one block, audio dropped, so the
audio after a miss is close to, not equal to, the uninterrupted stream (the earlier cuts are unknown).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.checkpoints import resolve_model_ref
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import TokenChunk
from detok_stage.codecs.base import CodecAdapter, checked_codes, padded_rows
from detok_stage.flow.glm_config import GLM4DecoderConfig, tiny_glm4_decoder_config
from detok_stage.flow.glm_model import BlockStream, GLM4Decoder

CONFIG_FILE, FLOW_FILE, HIFT_FILE = "config.yaml", "flow.pt", "hift.pt"
# web_demo.py's blocks: 25 tokens (2 s) first, then 50, 100, 150, 200, 200, ...; the family's chunk
# schedule decides ours (each chunk's kept tokens are one block)
DEMO_BLOCK_TOKENS = (25, 50, 100, 150, 200)
MIN_BLOCK_TOKENS = 6  # a first block of 6 tokens makes 41 mel frames: more than the 34 it holds back


class CacheMissError(ValueError):
    """A chunk reached a replica without its request's state, and does not carry the history to rebuild it."""


@dataclass
class _Request:
    stream: BlockStream = field(default_factory=BlockStream)
    pending: list[int] = field(default_factory=list)  # kept tokens of held chunks, not decoded yet
    next_keep: int = 0  # the stream token the next chunk keeps from


class GLM4VoiceCodec(CodecAdapter):
    is_stateful = True
    codes_per_frame = 1
    needs_stream_history = True  # a cold replica rebuilds a request's state from the stream's token 0

    def __init__(self, model: GLM4Decoder, device: str = "cpu") -> None:
        self.model = model.to(device).eval()
        self.device = device
        self.config = model.config
        self.codebook_size = model.config.vocab_size
        self.sample_rate_hz = model.config.hift.sampling_rate
        self.samples_per_frame = model.config.samples_per_token  # 1764: 22050 / 12.5
        self._requests: dict[str, _Request] = {}
        self.num_rebuilds = 0

    @classmethod
    def build(cls, model_config: ModelConfig, device: str = "cpu",
              preset: GLM4DecoderConfig | None = None) -> GLM4VoiceCodec:  # fmt: skip
        """The published layout (config.yaml, flow.pt, hift.pt) from `model.codec_dir`, else seeded
        random weights of `preset` (`tiny_glm4_decoder_config` by default) from `model.seed`."""
        if model_config.codec_dir is not None:
            return cls(load_published(resolve_model_ref(model_config.codec_dir, field="model.codec_dir")), device)
        return cls(GLM4Decoder.seeded(preset or tiny_glm4_decoder_config(), model_config.seed), device)

    # ---- offline ----------------------------------------------------------------------------

    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """Offline (the reference's `offline_inference`): frames [B, n, 1] -> audio [B, samples]."""
        rows = [self._checked([int(c) for c in row[:, 0].tolist()], "frames") for row in frames]
        return padded_rows([self.model.offline(row).float().cpu() for row in rows])

    # ---- streamed ---------------------------------------------------------------------------

    def release(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def cache_bytes(self, req_id: str) -> int:
        request = self._requests.get(req_id)
        return 0 if request is None else GLM4Decoder.stream_bytes(request.stream)

    def decode_stream(self, chunks: list[TokenChunk]) -> list[torch.Tensor]:
        """Audio of each chunk, in list order (a request's chunks in seq order)."""
        return [self._decode_chunk(chunk) for chunk in chunks]

    def _decode_chunk(self, chunk: TokenChunk) -> torch.Tensor:
        kept = self._checked([f[0] for f in chunk.kept_frames], "frames")
        request = self._requests.get(chunk.req_id)
        if request is None or request.next_keep != chunk.keep_start:
            request = self._rebuild(chunk)
        request.next_keep = chunk.keep_end
        request.pending += kept
        if not chunk.is_final and len(request.pending) < MIN_BLOCK_TOKENS:
            self._requests[chunk.req_id] = request
            return torch.zeros(0)
        block, request.pending = request.pending, []
        wave = self._block(request, block, chunk.is_final)
        if chunk.is_final:
            self._requests.pop(chunk.req_id, None)
        else:
            self._requests[chunk.req_id] = request
        return wave

    def _block(self, request: _Request, block: list[int], final: bool) -> torch.Tensor:
        if not block and not request.stream.tokens:
            return torch.zeros(0)
        if not block:  # end of stream after a full block: vocode what was held back
            return self._flush(request.stream)
        wave, _ = self.model.token2wav(request.stream, block, final)
        return wave.float().cpu()

    def _flush(self, stream: BlockStream) -> torch.Tensor:
        """A final chunk that keeps no tokens: HiFT over the held-back mel, as a final block would."""
        if stream.mel_overlap is None:
            return torch.zeros(0)
        mel = stream.mel_overlap if stream.cache_mel is None else torch.cat([stream.cache_mel, stream.mel_overlap], 1)
        wave, _ = self.model.vocode(mel, stream.cache_source, self.model._gen())
        return wave.float().cpu()

    def _rebuild(self, chunk: TokenChunk) -> _Request:
        request = _Request()
        if chunk.keep_start == 0:
            return request
        if chunk.window_start != 0:
            raise CacheMissError(
                f"request {chunk.req_id} chunk {chunk.seq}: no cached state on this replica and the chunk's "
                f"history starts at token {chunk.window_start}, not 0"
            )
        self.num_rebuilds += 1
        history = self._checked([f[0] for f in chunk.frames[: chunk.keep_start]], "frames")
        if len(history) < MIN_BLOCK_TOKENS:  # as a held chunk: decoded with this one
            request.pending = history
        else:
            self.model.token2wav(request.stream, history, finalize=False)  # the audio earlier chunks carried
        return request

    def _checked(self, tokens: list[int], field_name: str) -> list[int]:
        return checked_codes(tokens, self.codebook_size, field_name)


def load_published(directory: Path, field_name: str = "model.codec_dir") -> GLM4Decoder:
    """A glm-4-voice-decoder directory: `config.yaml` read as data (no code runs), then the weights."""
    directory = Path(directory)
    missing = [name for name in (CONFIG_FILE, FLOW_FILE, HIFT_FILE) if not (directory / name).is_file()]
    if missing:
        raise InvalidArgumentError(field_name, f"{directory} has no {', '.join(missing)} (not a glm-4-voice-decoder)")
    config = GLM4DecoderConfig.from_yaml(directory / CONFIG_FILE, field_name)
    return GLM4Decoder.from_published(config, directory)
