"""Shared parts of the peer-baseline servers: Orpheus prompt framing, the reference SNAC decoder
(Orpheus' own 4-frame window), and a gRPC `voxray.Speech` servicer over any token stream.

Imports only stdlib, torch, snac, grpc and the generated stubs, so it also runs in .venv-vllm.
`tests/loadtest/test_baselines_common.py` pins the framing and layout to llm_stage's adapter.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from snac import SNAC
from torch.nn.utils import parametrize

from protos import voxray_pb2, voxray_pb2_grpc

AUDIO_TOKEN_BASE = 128266
CODES_PER_SLOT = 4096
TOKENS_PER_FRAME = 7
END_OF_SPEECH = 128258
PROMPT_PREFIX = [128259]  # start of human
PROMPT_SUFFIX = [128009, 128260, 128261, 128257]  # end of text, end of human, start of AI, start of speech
BYTE_OFFSET, BOS_ID = 1000, 128000  # the random-weight preset's byte tokenizer
SAMPLES_PER_FRAME, SAMPLE_RATE_HZ = 2048, 24000
WINDOW_FRAMES = 4
DEFAULT_SAMPLING = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3, "max_tokens": 1200}
MODEL_NAME, VOICES = "orpheus-tiny", ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")


def format_prompt(text: str, voice: str | None) -> list[int]:
    """Orpheus framing with the preset's byte tokenizer (same ids as OrpheusAdapter.format_prompt)."""
    body = [BOS_ID, *(BYTE_OFFSET + b for b in (f"{voice}: {text}" if voice else text).encode("utf-8"))]
    return [*PROMPT_PREFIX, *body, *PROMPT_SUFFIX]


def audio_token_ids() -> list[int]:
    """Every audio token id (7 slots x 4096 codes): the static mask a stock server can apply."""
    return list(range(AUDIO_TOKEN_BASE, AUDIO_TOKEN_BASE + TOKENS_PER_FRAME * CODES_PER_SLOT))


def token_to_code(token_id: int) -> int:
    """Orpheus' id -> code for its own slot. A random-weight model may emit another slot's id;
    wrapping it into 0..4095 keeps the window decodable at the same cost (the real model never does)."""
    return (token_id - AUDIO_TOKEN_BASE) % CODES_PER_SLOT


def load_snac_dir(codec_dir: Path, device: str = "cpu") -> SNAC:
    """SNAC from config.json + pytorch_model.bin, weight norm folded (as detok_stage does)."""
    model = SNAC(**json.loads((Path(codec_dir) / "config.json").read_text()))
    model.load_state_dict(torch.load(Path(codec_dir) / "pytorch_model.bin", map_location="cpu", weights_only=True))
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    return model.eval().to(device)


class ReferenceDecoder:
    """Orpheus' streaming decoder: after every frame from the 4th on, decode the last 4 frames and
    keep the second frame's 2048 samples (orpheus_tts.decoder.tokens_decoder semantics)."""

    def __init__(self, snac: SNAC) -> None:
        self.snac = snac
        self.codes: list[int] = []

    def push(self, token_id: int) -> bytes | None:
        self.codes.append(token_to_code(token_id))
        count = len(self.codes)
        if count % TOKENS_PER_FRAME or count < WINDOW_FRAMES * TOKENS_PER_FRAME:
            return None
        return self.decode_window(self.codes[-WINDOW_FRAMES * TOKENS_PER_FRAME :])

    @torch.inference_mode()
    def decode_window(self, codes: list[int]) -> bytes:
        frames = torch.tensor(codes, dtype=torch.long).view(1, WINDOW_FRAMES, TOKENS_PER_FRAME)  # [1, 4, 7]
        levels = [frames[:, :, 0], frames[:, :, [1, 4]].reshape(1, -1), frames[:, :, [2, 3, 5, 6]].reshape(1, -1)]
        audio = self.snac.decode(levels)[0, 0, SAMPLES_PER_FRAME : 2 * SAMPLES_PER_FRAME]  # [2048]
        return (audio.clamp(-1, 1) * 32767).to(torch.int16).numpy().tobytes()


@dataclass(frozen=True)
class Job:
    """One synthesis request as a baseline engine sees it."""

    req_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    repetition_penalty: float
    seed: int | None


def job_from_request(request: voxray_pb2.SynthesizeRequest) -> Job:
    s = request.sampling
    return Job(
        req_id=request.request_id or uuid.uuid4().hex[:12],
        prompt_ids=format_prompt(request.text, request.voice or "tara"),
        max_tokens=s.max_tokens if s.HasField("max_tokens") else DEFAULT_SAMPLING["max_tokens"],
        temperature=s.temperature if s.HasField("temperature") else DEFAULT_SAMPLING["temperature"],
        top_p=s.top_p if s.HasField("top_p") else DEFAULT_SAMPLING["top_p"],
        repetition_penalty=(
            s.repetition_penalty if s.HasField("repetition_penalty") else DEFAULT_SAMPLING["repetition_penalty"]
        ),
        seed=s.seed if s.HasField("seed") else None,
    )


def audio_chunk(req_id: str, seq: int, pcm16: bytes, start_s: float, is_final: bool = False) -> voxray_pb2.AudioChunk:
    elapsed = time.perf_counter() - start_s
    timings = voxray_pb2.ServerTimings(elapsed_s=elapsed, ttfa_s=elapsed if seq == 0 else 0.0)
    return voxray_pb2.AudioChunk(
        request_id=req_id, seq=seq, audio=pcm16, sample_rate_hz=SAMPLE_RATE_HZ,
        duration_s=len(pcm16) / 2 / SAMPLE_RATE_HZ, final=is_final, timings=timings,
    )  # fmt: skip


class ListingServicer(voxray_pb2_grpc.SpeechServicer):
    """ListModels / ListVoices for a baseline serving orpheus-tiny."""

    description = "baseline"

    def ListModels(self, request, context):  # noqa: N802 (gRPC method name)
        info = voxray_pb2.ModelInfo(name=MODEL_NAME, description=self.description, sample_rate_hz=SAMPLE_RATE_HZ)
        return voxray_pb2.ListModelsResponse(models=[info])

    def ListVoices(self, request, context):  # noqa: N802
        return voxray_pb2.ListVoicesResponse(voices=list(VOICES), default_voice="tara")
