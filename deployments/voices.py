"""The app's zero-shot voices: one VoiceBank actor encodes each voice once and keeps it by id.

Where a voice lives: its tensors (prompt speech tokens, prompt mel, x-vector) in the bank's
`TensorEndpoint`; its LM prompt (transcript + speech tokens, a few hundred ints) in the bank, read
by an LLM replica the first time a request names the voice; on each detok replica, a copy of the
tensors in its codec, which arrived over the stage `TensorTransport` (RDT gloo / nccl, or the
object store) from the bank's endpoint to the replica's own endpoint, once per replica. Chunks
carry only the voice's id as a cache handle; a replica that lacks it (new, restarted, evicted)
asks the bank to send it again: the same tensors, so the same audio.

The bank is a synchronous threaded actor (RDT needs one process to create the collective group
and submit every transfer; that process is the bank). A detok endpoint joining rebuilds the
group over the bank's endpoint and every live detok endpoint (Ray allows one group per actor).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from core.checkpoints import resolve_model_ref
from core.config import CHECK_FILES, ServeConfig
from core.errors import InvalidArgumentError
from core.messages import VoiceConditioning
from core.voices import VoicePrompt, voice_id_for
from deployments.transport import TensorEndpoint, TensorTransport, Transfer, TransportKind

NAMESPACE = "voxray-voices"
ENDPOINT_CONCURRENCY = 4  # RDT transfers hang on endpoints that run one call at a time
PING_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Registered:
    voice_id: str
    num_prompt_tokens: int
    duration_s: float
    is_new: bool  # False: the same clip was registered before (same id, same tensors)


@dataclass(frozen=True)
class Refused:
    """A request the bank cannot serve, returned (not raised) so the caller gets the field intact."""

    field: str
    message: str

    def error(self) -> InvalidArgumentError:
        return InvalidArgumentError(self.field, self.message)


def bank_name(config: ServeConfig) -> str:
    """One bank per app and model / encoder setup (a redeploy with another model gets a new bank)."""
    setup = json.dumps([config.engine.model.model_dump(mode="json"), config.voices.model_dump(mode="json")])
    return f"{config.app_name}:{hashlib.sha256(setup.encode()).hexdigest()[:12]}"


def voice_bank(config: ServeConfig):
    """The app's VoiceBank actor, created by whichever replica asks first (detached: it outlives them)."""
    return VoiceBank.options(
        name=bank_name(config), namespace=NAMESPACE, get_if_exists=True, lifetime="detached", max_concurrency=16,
        num_cpus=0,
    ).remote(config.model_dump(mode="json"))  # fmt: skip


def new_endpoint(name: str):
    return TensorEndpoint.options(max_concurrency=ENDPOINT_CONCURRENCY).remote(name)


def _encoder_path(config: ServeConfig) -> Path | None:
    """Where the published encoders are, or None for the seeded tiny ones (a preset model)."""
    if config.voices.encoder_dir is not None:
        return resolve_model_ref(config.voices.encoder_dir, field="voices.encoder_dir")
    if config.engine.model.checkpoint_dir is None:
        return None
    return resolve_model_ref(config.engine.model.checkpoint_dir, field="model.checkpoint_dir")


@ray.remote
class VoiceBank:
    """Registered voices by id: encodes each clip once, holds its LM prompt, and sends its tensors
    to the detok endpoints that ask for them."""

    def __init__(self, config: dict) -> None:
        self.config = ServeConfig.model_validate(config, context={CHECK_FILES: False})
        self.kind = TransportKind(self.config.voices.transport)
        self.source = new_endpoint("voice-bank")
        self.prompts: dict[str, VoicePrompt] = {}
        self.durations_s: dict[str, float] = {}
        self.sinks: dict[str, object] = {}  # detok replica tag -> its TensorEndpoint
        self.transport: TensorTransport | None = None
        self.group: tuple[str, ...] = ()  # replica tags in the current collective group
        self.lock = threading.Lock()  # one transfer / group change at a time
        self.encoder_lock = threading.Lock()
        self.encoder = None
        self.num_encoded = self.num_deliveries = self.bytes_delivered = self.num_group_builds = 0

    def _encoder(self):
        from detok_stage.voice.encoder import VoiceEncoder

        if self.encoder is None:
            self.encoder = VoiceEncoder.build(_encoder_path(self.config), self.config.engine.model.seed)
        return self.encoder

    def register(self, wave: torch.Tensor, sample_rate_hz: int, prompt_text: str) -> Registered | Refused:
        """Encode a checked clip (once: the same clip gives the same id, encoded the first time only)."""
        model = self.config.engine.model.name
        voice_id = voice_id_for(model, wave.numpy().tobytes(), sample_rate_hz, prompt_text)
        duration_s = wave.numel() / sample_rate_hz
        with self.encoder_lock:
            known = self.prompts.get(voice_id)
            if known is not None:
                return Registered(voice_id, len(known.prompt_tokens), duration_s, False)
            if len(self.prompts) >= self.config.voices.max_voices:
                return Refused("audio", f"this server holds {len(self.prompts)} voices, its limit")
            tensors = self._encoder().encode(wave, sample_rate_hz)
            ray.get(self.source.hold.remote(voice_id, tensor_dict(tensors.with_id(voice_id))))
            self.prompts[voice_id] = VoicePrompt(voice_id, prompt_text, tuple(tensors.prompt_tokens.tolist()))
            self.durations_s[voice_id] = duration_s
            self.num_encoded += 1
        return Registered(voice_id, int(tensors.prompt_tokens.numel()), duration_s, True)

    def prompt(self, voice_id: str) -> VoicePrompt | None:
        return self.prompts.get(voice_id)

    def voice_ids(self) -> list[str]:
        return sorted(self.prompts)

    def join(self, replica: str, endpoint) -> None:
        """A detok replica's endpoint; the group is rebuilt at its first delivery."""
        with self.lock:
            self.sinks[replica] = endpoint

    def deliver(self, voice_id: str, replica: str) -> int | Refused:
        """Send the voice's tensors to `replica`'s endpoint over the transport; the bytes sent."""
        if voice_id not in self.prompts:
            return Refused("voice", f"unknown voice {voice_id!r}")
        with self.lock:
            endpoint = self.sinks[replica]
            transfer = self._move(voice_id, replica, endpoint)
            self.num_deliveries += 1
            self.bytes_delivered += transfer.num_bytes
        return transfer.num_bytes

    def _move(self, voice_id: str, replica: str, endpoint) -> Transfer:
        if self.transport is None or replica not in self.group:
            self._rebuild_group()
        try:
            return self.transport.move(voice_id, self.source, endpoint)  # type: ignore[union-attr]
        except ray.exceptions.RayError:  # a member died: regroup the live ones and try once more
            self._rebuild_group()
            return self.transport.move(voice_id, self.source, endpoint)  # type: ignore[union-attr]

    def _rebuild_group(self) -> None:
        if self.transport is not None:
            try:
                self.transport.close()
            except Exception:  # a dead member's part of the group is gone with it
                pass
        live = {}
        for tag, endpoint in self.sinks.items():
            try:
                ray.get(endpoint.stats.remote(), timeout=PING_TIMEOUT_S)
                live[tag] = endpoint
            except ray.exceptions.RayError:
                continue
        self.sinks = live
        self.transport = TensorTransport([self.source, *live.values()], self.kind)
        self.group = tuple(live)
        self.num_group_builds += 1

    def stats(self) -> dict:
        return {
            "voices": len(self.prompts), "encoded": self.num_encoded, "deliveries": self.num_deliveries,
            "bytes_delivered": self.bytes_delivered, "transport": self.kind.value, "group": list(self.group),
            "group_builds": self.num_group_builds, "source": ray.get(self.source.stats.remote()),
        }  # fmt: skip


def tensor_dict(voice: VoiceConditioning) -> dict[str, torch.Tensor]:
    return {"prompt_tokens": voice.prompt_tokens, "prompt_mel": voice.prompt_mel, "xvector": voice.xvector}


class DetokVoices:
    """A detok replica's side: its endpoint, and fetching the voices its chunks name into its codec."""

    def __init__(self, config: ServeConfig, replica: str) -> None:
        self.config, self.replica = config, replica
        self.endpoint = None  # made at the first voice (families without voices never make one)
        self.bank = None
        self.num_fetched = 0
        self.fetch_lock = None  # an asyncio.Lock, made on the replica's loop

    async def ensure(self, handles: set[str], codec) -> None:
        """Every voice in `handles` is in `codec` (fetched from the bank over the transport if not)."""
        import asyncio

        missing = {h for h in handles if not codec.has_voice(h)}
        if not missing:
            return
        self.fetch_lock = self.fetch_lock or asyncio.Lock()
        async with self.fetch_lock:
            for handle in sorted(h for h in missing if not codec.has_voice(h)):
                await self._fetch(handle, codec)

    async def _fetch(self, handle: str, codec) -> None:
        if self.bank is None:
            self.bank, self.endpoint = voice_bank(self.config), new_endpoint(f"detok:{self.replica}")
            await self.bank.join.remote(self.replica, self.endpoint)
        sent = await self.bank.deliver.remote(handle, self.replica)
        if isinstance(sent, Refused):
            raise sent.error()
        tensors = await self.endpoint.get.remote(handle)
        codec.add_voice(VoiceConditioning(handle, tensors["prompt_tokens"], tensors["prompt_mel"], tensors["xvector"]))
        await self.endpoint.drop.remote(handle)  # the codec holds it now
        self.num_fetched += 1

    async def stats(self) -> dict:
        endpoint = None if self.endpoint is None else await self.endpoint.stats.remote()
        return {"voices_fetched": self.num_fetched, "endpoint": endpoint}


class LLMVoices:
    """An LLM replica's side: the LM prompt of each registered voice its requests name, read once."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.bank = None
        self.num_fetched = 0

    async def ensure(self, voice_id: str, adapter) -> None:
        """`adapter` knows `voice_id`'s prompt; an unknown id raises InvalidArgumentError('voice')."""
        if voice_id in adapter.voice_prompts:
            return
        self.bank = self.bank or voice_bank(self.config)
        prompt = await self.bank.prompt.remote(voice_id)
        if prompt is None:
            raise InvalidArgumentError("voice", f"unknown voice {voice_id!r}; register it first (POST /v1/voices)")
        adapter.add_voice_prompt(prompt)
        self.num_fetched += 1
