"""The app's zero-shot voices: one VoiceBank actor encodes each voice once and keeps it by id.

Where a voice lives: its tensors (prompt speech tokens, prompt mel, x-vector) and its LM prompt
(transcript + speech tokens; for chatterbox also T3's speaker embedding and prompt tokens) in the
bank; an LLM replica reads the LM prompt the first time a request names the voice; each detok
replica gets the tensors once, over the stage `TensorTransport` (RDT gloo / nccl, or the object
store) from a source endpoint the bank keeps on its own node to the replica's endpoint, and keeps
them in its codec. Chunks carry only the voice's id as a cache handle; a replica that lacks it (new,
restarted, evicted) asks the bank to send it again: the same tensors, so the same audio.

The bank is a synchronous threaded actor: RDT needs the process that made a collective group to
submit its transfers, and that is the bank. Serve runs it as the DetokStage's deployment actor
(`bank_actors`): it lives as long as the app. torch's gloo gives a process one group for life, so
each detok replica is paired with a source endpoint of its own (a two-member group).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from core.checkpoints import resolve_model_ref
from core.config import CHECK_FILES, ServeConfig
from core.errors import InvalidArgumentError
from core.messages import VoiceConditioning
from core.voices import VoicePrompt, voice_id_for
from deployments.transport import EndpointPair, Transfer, TransportKind, new_endpoint
from llm_stage.registry import families, get_entry

NAMESPACE = "voxray-voices"  # of a bank made outside Serve (`voice_bank`)
BANK_ACTOR = "voice_bank"  # the DetokStage's deployment actor
BANK_CONCURRENCY = 16
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
    """A VoiceBank of its own, outside Serve (`loadtest.voice_bench`; the app's is `bank_actors`'):
    created by whoever asks first, detached (its caller kills it)."""
    return VoiceBank.options(
        name=bank_name(config), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        max_concurrency=BANK_CONCURRENCY, num_cpus=0,
    ).remote(config.model_dump(mode="json"))  # fmt: skip


def bank_actors(config: ServeConfig) -> list:
    """The DetokStage's deployment actors: the app's VoiceBank, for a family that takes registered
    voices. Serve makes it with the stage (before its replicas), recreates it if it dies and
    deletes it with the app; the Router and the LLM replicas get its handle from a detok replica."""
    if not get_entry(config.engine.model.name).family.lm.takes_registered_voices:
        return []
    from ray.serve.config import DeploymentActorConfig

    return [
        DeploymentActorConfig(
            name=BANK_ACTOR, actor_class=VoiceBank, init_kwargs={"config": config.model_dump(mode="json")},
            actor_options={"num_cpus": 0, "max_concurrency": BANK_CONCURRENCY},
        )
    ]  # fmt: skip


def deployed_bank():
    """The app's VoiceBank, from inside a DetokStage replica (Serve's deployment actor)."""
    from ray import serve

    return serve.get_deployment_actor(BANK_ACTOR)


def _encoder_path(config: ServeConfig) -> Path | None:
    """Where the published encoders are, or None for the seeded tiny ones (a preset model)."""
    if config.voices.encoder_dir is not None:
        return resolve_model_ref(config.voices.encoder_dir, field="voices.encoder_dir")
    if config.engine.model.checkpoint_dir is None:
        return None
    return resolve_model_ref(config.engine.model.checkpoint_dir, field="model.checkpoint_dir")


def check_voice_encoders(config: ServeConfig) -> str | None:
    """For a family that takes registered voices: why this server cannot register any (None: it
    can). Encoders named by `voices.encoder_dir` must be there: a wrong path raises, naming it
    (`voxray serve` before Ray starts; a detok replica's constructor on a cluster). Without it,
    a checkpoint directory lacking them (CosyVoice 2's published front end is ONNX) serves
    without zero-shot voices: registrations are refused naming the setting."""
    from detok_stage.voice.encoder import CONVERTED_FILE, encoder_file, speaker_lstm_file

    lm = get_entry(config.engine.model.name).family.lm
    if not lm.takes_registered_voices:
        return None
    path = _encoder_path(config)
    if path is None:
        return None  # a preset model: seeded tiny encoders
    try:
        file = encoder_file(path)
        if lm.voice_lm_speaker and file.name != CONVERTED_FILE:
            speaker_lstm_file(path)  # chatterbox's ve.safetensors, beside s3gen.safetensors
    except FileNotFoundError as err:
        if config.voices.encoder_dir is not None:
            raise InvalidArgumentError("voices.encoder_dir", str(err)) from None
        where = f"chatterbox's s3gen.safetensors / s3gen.pt (+ ve.safetensors) or a directory with {CONVERTED_FILE}"
        return f"{err}; set voices.encoder_dir to {where}"
    return None


DEFAULT_CLIP_VOICE_ID = "default-clip"  # the id a `voices.default_clip` voice carries inside a detok replica


def speaks_default_clip(model: str) -> bool:
    """Whether `voices.default_clip` can be `model`'s default voice (`_detok_alone_takes_voices`)."""
    return _detok_alone_takes_voices(get_entry(model).family.lm)


def _detok_alone_takes_voices(lm) -> bool:
    """A family that takes zero-shot voices and reads them in its detokenizer only (chatterbox's LM takes a
    speaker too, and ships its own in conds.pt)."""
    return lm.takes_registered_voices and not lm.voice_lm_speaker


def check_default_clip(config: ServeConfig, read_clip: bool = False) -> None:
    """A `voices.default_clip` some served model can speak in, on a detokenizer no other model shares (its
    default voice would change theirs), and with `read_clip` (where the clip is served, e.g. `voxray serve`
    before Ray starts) a usable WAV with encoders to encode it: else InvalidArgumentError naming the field."""
    from deployments.model_plan import plan_models

    if config.voices.default_clip is None:
        return
    planned = plan_models(config)
    takers = [served for served in planned if speaks_default_clip(served.name)]
    if not takers:
        names = ", ".join(served.name for served in planned)
        able = ", ".join(f.name for f in families() if _detok_alone_takes_voices(f.lm))
        raise InvalidArgumentError("voices.default_clip", f"{names} cannot speak in it (the families that can: {able})")
    if config.voices.default_clip_text and not any(
        get_entry(served.name).family.lm.reads_voice_transcript for served in takers
    ):
        able = ", ".join(f.name for f in families() if f.lm.reads_voice_transcript)
        raise InvalidArgumentError("voices.default_clip_text", f"no served model's LM reads a voice's transcript "
                                   f"(those that do: {able}); leave it empty")  # fmt: skip
    for served in takers:
        others = [name for name in served.shares_detok_with if not speaks_default_clip(name)]
        if others:
            raise InvalidArgumentError(
                "voices.default_clip",
                f"{served.name} shares its detokenizer with {', '.join(others)}, whose voice it would change",
            )
        if read_clip:
            _default_clip(served.view)


def _default_clip(config: ServeConfig):
    """`voices.default_clip` read and checked as a registration's clip, for a model with encoders to encode it."""
    from detok_stage.voice.clip import decode_clip

    no_encoders = check_voice_encoders(config)
    if no_encoders is not None:
        raise InvalidArgumentError("voices.default_clip", f"cannot be encoded: {no_encoders}")
    try:
        data = Path(config.voices.default_clip).read_bytes()
    except OSError as err:
        raise InvalidArgumentError("voices.default_clip", f"cannot be read: {err}") from None
    return decode_clip(data, "voices.default_clip", config.voices.min_clip_s, config.voices.max_clip_s)


def default_clip_prompt(config: ServeConfig) -> VoicePrompt | None:
    """The LM prompt of `voices.default_clip` with its transcript `voices.default_clip_text`, as the VoiceBank
    makes a registration's (the transcript's whitespace folded as `router.voices.check_prompt_text` folds it),
    for a family whose LM reads a voice's transcript; None: no transcript, or this model's LM reads none."""
    text = " ".join(config.voices.default_clip_text.split())
    if not text or not get_entry(config.engine.model.name).family.lm.reads_voice_transcript:
        return None
    voice = default_clip_voice(config)
    return None if voice is None else VoicePrompt(DEFAULT_CLIP_VOICE_ID, text, tuple(voice.prompt_tokens.tolist()))


def prompt_default_voice(config: ServeConfig, adapter) -> bool:
    """An LLM replica's start: its adapter prompted with `default_clip_prompt` for requests naming no voice;
    whether it was (False: nothing to prompt with)."""
    prompt = default_clip_prompt(config)
    if prompt is not None:
        adapter.set_default_voice_prompt(prompt)
    return prompt is not None


def default_clip_voice(config: ServeConfig) -> VoiceConditioning | None:
    """The voice of `voices.default_clip`, encoded as a registration would be (None: no clip, or this model
    cannot speak in it); a clip that is not a usable WAV, or no encoders to encode it, names the field."""
    from detok_stage.voice.encoder import VoiceEncoder

    if config.voices.default_clip is None or not speaks_default_clip(config.engine.model.name):
        return None
    clip = _default_clip(config)
    encoder = VoiceEncoder.build(_encoder_path(config), config.engine.model.seed)
    return encoder.encode(clip.wave, clip.sample_rate_hz).with_id(DEFAULT_CLIP_VOICE_ID)


@ray.remote
class VoiceBank:
    """Registered voices by id: encodes each clip once, holds its LM prompt and tensors, and sends
    the tensors to the detok replicas that ask for them."""

    def __init__(self, config: dict) -> None:
        self.config = ServeConfig.model_validate(config, context={CHECK_FILES: False})
        self.kind = TransportKind(self.config.voices.transport)
        self.prompts: dict[str, VoicePrompt] = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.pairs: dict[str, EndpointPair] = {}  # detok replica tag -> its pair (a source here, its endpoint)
        self.lock = threading.Lock()  # pairs
        self.encoder_lock = threading.Lock()
        self.encoder = None
        self.num_encoded = self.num_deliveries = self.bytes_delivered = self.num_pairs = 0
        self.deliveries_by: dict[str, int] = {}  # "voice_id@replica" -> transfers (1 unless the replica lost it)
        self.source_counters: dict[str, int] = {"sent": 0, "bytes_sent": 0}  # of sources of closed pairs too

    def _encoder(self):
        from detok_stage.voice.encoder import VoiceEncoder

        if self.encoder is None:
            with_lm_speaker = get_entry(self.config.engine.model.name).family.lm.voice_lm_speaker
            self.encoder = VoiceEncoder.build(
                _encoder_path(self.config), self.config.engine.model.seed, with_lm_speaker
            )
        return self.encoder

    def register(self, wave: torch.Tensor, sample_rate_hz: int, prompt_text: str) -> Registered | Refused:
        """Encode a checked clip (once: the same clip gives the same id, encoded the first time only)."""
        model = self.config.engine.model.name
        no_encoders = check_voice_encoders(self.config)  # (a file lookup: registrations are rare)
        if no_encoders is not None:
            return Refused("model", f"{model} takes no zero-shot voices on this server (no encoders: {no_encoders})")
        voice_id = voice_id_for(model, wave.numpy().tobytes(), sample_rate_hz, prompt_text)
        duration_s = wave.numel() / sample_rate_hz
        with self.encoder_lock:
            known = self.prompts.get(voice_id)
            if known is not None:
                return Registered(voice_id, len(known.prompt_tokens), duration_s, False)
            if len(self.prompts) >= self.config.voices.max_voices:
                return Refused("audio", f"this server holds {len(self.prompts)} voices, its limit")
            tensors = self._encoder().encode(wave, sample_rate_hz)
            self.tensors[voice_id] = tensor_dict(tensors.with_id(voice_id))
            tokens = tuple(tensors.prompt_tokens.tolist())
            self.prompts[voice_id] = VoicePrompt(voice_id, prompt_text, tokens, tensors.lm_speaker)
            self.num_encoded += 1
        return Registered(voice_id, int(tensors.prompt_tokens.numel()), duration_s, True)

    def prompt(self, voice_id: str) -> VoicePrompt | None:
        return self.prompts.get(voice_id)

    def voice_ids(self) -> list[str]:
        return sorted(self.prompts)

    def join(self, replica: str, sink) -> None:
        """Pair a detok replica's endpoint with a new source endpoint here (one group per pair)."""
        with self.lock:
            old = self.pairs.pop(replica, None)
        if old is not None:
            self._close(old)
        source = new_endpoint(f"voice-bank>{replica}", ray.get_runtime_context().get_node_id())
        pair = EndpointPair.open(source, sink, self.kind)
        with self.lock:
            self.pairs[replica] = pair
            self.num_pairs += 1

    def deliver(self, voice_id: str, replica: str) -> int | Refused:
        """Send the voice's tensors to `replica`'s endpoint over its pair's transport; the bytes sent."""
        tensors = self.tensors.get(voice_id)
        if tensors is None:
            return Refused("voice", f"unknown voice {voice_id!r}")
        with self.lock:
            pair = self.pairs.get(replica)
        if pair is None:
            return Refused("voice", f"detok replica {replica} has not joined the voice bank")
        transfer: Transfer = pair.send(voice_id, tensors)  # (same node: the bank's copy to its sender)
        with self.lock:
            self.num_deliveries += 1
            self.bytes_delivered += transfer.num_bytes
            key = f"{voice_id}@{replica}"
            self.deliveries_by[key] = self.deliveries_by.get(key, 0) + 1
        return transfer.num_bytes

    def _close(self, pair: EndpointPair) -> None:
        counters = pair.close(PING_TIMEOUT_S)
        self.source_counters = {key: self.source_counters[key] + counters[key] for key in self.source_counters}

    def stats(self) -> dict:
        """The bank's counters and its source endpoints' own (sent, bytes_sent), open and closed pairs."""
        with self.lock:
            pairs = dict(self.pairs)
        sent = dict(self.source_counters)
        for pair in pairs.values():
            counters = ray.get(pair.source.stats.remote(), timeout=PING_TIMEOUT_S)
            sent = {k: sent[k] + counters[k] for k in sent}
        return {
            "voices": len(self.prompts), "encoded": self.num_encoded, "deliveries": self.num_deliveries,
            "bytes_delivered": self.bytes_delivered, "transport": self.kind.value, "replicas": sorted(pairs),
            "pairs_made": self.num_pairs, "deliveries_by": dict(self.deliveries_by), "source": sent,
        }  # fmt: skip

    def sink_stats(self) -> dict[str, dict]:
        """Each paired detok endpoint's own transfer counters, by replica."""
        with self.lock:
            pairs = dict(self.pairs)
        return {tag: ray.get(pair.sink.stats.remote(), timeout=PING_TIMEOUT_S) for tag, pair in pairs.items()}


def tensor_dict(voice: VoiceConditioning) -> dict[str, torch.Tensor]:
    """A voice's detokenizer tensors as they cross the stage transport (`voice_conditioning` reverses it)."""
    return {"prompt_tokens": voice.prompt_tokens, "prompt_mel": voice.prompt_mel, "xvector": voice.xvector}


def voice_conditioning(voice_id: str, tensors: dict[str, torch.Tensor]) -> VoiceConditioning:
    return VoiceConditioning(voice_id, tensors["prompt_tokens"], tensors["prompt_mel"], tensors["xvector"])


class DetokVoices:
    """A detok replica's side: its endpoint, and fetching the voices its chunks name into its codec."""

    def __init__(self, config: ServeConfig, replica: str, find_bank: Callable[[], object] = deployed_bank) -> None:
        self.config, self.replica, self.find_bank = config, replica, find_bank
        self.endpoint = None  # made when joining the bank (families without voices never join)
        self.bank = None
        self.num_fetched = 0
        self.fetch_lock = None  # an asyncio.Lock, made on the replica's loop
        self.joining: concurrent.futures.Future | None = None

    def join_soon(self) -> None:
        """Pair with the bank in the background now, so the first voice does not wait for the group
        to form (seconds on a loaded CPU box); a failure here is retried at the first voice."""
        self.joining = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="voice-join").submit(self._join)

    def _join(self) -> None:
        bank, endpoint = self.find_bank(), new_endpoint(f"detok:{self.replica}")
        ray.get(bank.join.remote(self.replica, endpoint))
        self.bank, self.endpoint = bank, endpoint

    async def ensure(self, handles: set[str], codec) -> None:
        """Every voice in `handles` is in `codec` (fetched from the bank over the transport if not)."""
        missing = {h for h in handles if not codec.has_voice(h)}
        if not missing:
            return
        self.fetch_lock = self.fetch_lock or asyncio.Lock()
        async with self.fetch_lock:
            for handle in sorted(h for h in missing if not codec.has_voice(h)):
                await self._fetch(handle, codec)

    async def _fetch(self, handle: str, codec) -> None:
        if self.joining is not None:
            try:
                await asyncio.wrap_future(self.joining)
            except Exception:  # joined below instead
                pass
            self.joining = None
        if self.bank is None:
            self.bank, self.endpoint = self.find_bank(), new_endpoint(f"detok:{self.replica}")
            await self.bank.join.remote(self.replica, self.endpoint)
        try:
            sent = await self.bank.deliver.remote(handle, self.replica)
        except ray.exceptions.RayActorError:  # the bank died (Serve recreates it, without its voices)
            self.bank = None
            message = f"unknown voice {handle!r}: the voice bank restarted; register it again"
            raise InvalidArgumentError("voice", message) from None
        except ray.exceptions.RayError:  # the pair broke (its source died): pair again, once
            await self.bank.join.remote(self.replica, self.endpoint)
            sent = await self.bank.deliver.remote(handle, self.replica)
        if isinstance(sent, Refused):
            raise sent.error()
        tensors = await self.endpoint.get.remote(handle)
        codec.add_voice(voice_conditioning(handle, tensors))
        await self.endpoint.drop.remote(handle)  # the codec holds it now
        self.num_fetched += 1

    def bank_handle(self):
        """The app's VoiceBank (for the Router and the LLM replicas, through a detok handle call)."""
        return self.find_bank()

    async def stats(self) -> dict:
        endpoint = None if self.endpoint is None else await self.endpoint.stats.remote()
        return {"voices_fetched": self.num_fetched, "endpoint": endpoint}


class LLMVoices:
    """An LLM replica's side: the LM prompt of each registered voice its requests name, read once."""

    def __init__(self, config: ServeConfig, find_bank: Callable[[], Awaitable]) -> None:
        self.config = config
        self.find_bank = find_bank  # the bank's handle, asked of a detok replica
        self.bank = None
        self.num_fetched = 0

    async def ensure(self, voice_id: str, adapter) -> None:
        """`adapter` knows `voice_id`'s prompt; an unknown id raises InvalidArgumentError('voice')."""
        if voice_id in adapter.voice_prompts:
            return
        self.bank = self.bank or await self.find_bank()
        try:
            prompt = await self.bank.prompt.remote(voice_id)
        except ray.exceptions.RayActorError:  # the bank died (Serve recreates it, without its voices)
            self.bank, prompt = None, None
        if prompt is None:
            raise InvalidArgumentError("voice", f"unknown voice {voice_id!r}; register it first (POST /v1/voices)")
        adapter.add_voice_prompt(prompt)
        self.num_fetched += 1
