"""The models one Router serves: a `RouterCore` per model (its LLM deployment, load board, admission
and metrics), picked by the request's `model` field; the listings `ListModels` / `/v1/models` give.

A single-model app has one core and answers as before. In a multi-model app an empty `model` picks the
first listed one; a name it does not serve is INVALID_ARGUMENT / 400 naming `model` and listing the
served ones. The Router replica's drain watch is shared by its cores (it publishes the replica's open
streams, all models together). Built by `router.ingress.Router`; `ServedModels.from_cores` takes
cores made elsewhere (tests).
"""

from __future__ import annotations

from collections.abc import Callable

from core.config import ServeConfig
from core.errors import InvalidArgumentError
from llm_stage.jobs import printable_name
from llm_stage.registry import ModelEntry
from protos import voxray_pb2
from router.drain import DrainWatch
from router.streams import RouterCore


class ServedModels:
    """Model name -> its `RouterCore`, in the config's order (the first is the default)."""

    def __init__(
        self, cores: dict[str, RouterCore], drain: DrainWatch, bank_owners: dict[str, str] | None = None
    ) -> None:
        """`bank_owners`: model -> the model whose VoiceBank (its DetokStage's) encodes its voices: the
        first listed model of a shared detokenizer (itself when not shared)."""
        if not cores:
            raise ValueError("a Router serves at least one model")
        self.cores, self.drain = cores, drain
        self.bank_owners = bank_owners or {name: name for name in cores}

    @classmethod
    def build(
        cls, config: ServeConfig, llm_handles: dict, detok_handles: dict, replica: str
    ) -> ServedModels:
        """One core per served model, each on its model's view of `config` and its deployments' handles."""
        cores: dict[str, RouterCore] = {}
        drain = DrainWatch(config.app_name, replica, lambda: sum(core.open_streams for core in cores.values()))
        owners: dict[str, str] = {}  # detok deployment -> its first model (whose config built its VoiceBank)
        for served in config.served_models():
            name = served.engine.model.name
            view = config.for_model(served).model_dump(mode="json")
            cores[name] = RouterCore(view, llm_handles[name], detok_handles[name], drain=drain)
            owners.setdefault(getattr(detok_handles[name], "deployment_name", name), name)
        bank_owners = {name: owners[getattr(detok_handles[name], "deployment_name", name)] for name in cores}
        return cls(cores, drain, bank_owners)

    @property
    def default(self) -> RouterCore:
        return next(iter(self.cores.values()))

    @property
    def names(self) -> list[str]:
        return list(self.cores)

    @property
    def open_streams(self) -> int:
        return sum(core.open_streams for core in self.cores.values())

    def core_for(self, model: str, field: str = "model") -> RouterCore:
        """The core serving `model` ("" = the default); an unknown name is refused, naming `field`."""
        if not model:
            return self.default
        core = self.cores.get(model)
        if core is None:
            served = ", ".join(self.names)
            raise InvalidArgumentError(field, f"unknown model {printable_name(model)!r}; this server serves {served}")
        return core

    def voices_core(self, model: str) -> RouterCore:
        """Where a voice registration goes: the named model, else the first that takes registered voices
        (else the default, which refuses it naming `model`)."""
        if model:
            self._check_bank_encodes_for(model)
            return self.core_for(model)
        takes_voices: Callable[[RouterCore], bool] = lambda core: core.entry.family.lm.takes_registered_voices  # noqa: E731
        return next((core for core in self.cores.values() if takes_voices(core)), self.default)

    def _check_bank_encodes_for(self, model: str) -> None:
        """A model sharing its detokenizer registers voices in the bank of the group's first model, which
        encodes them for that model's LM: refused when the two LMs take different voice prompts
        (chatterbox's T3 needs a speaker embedding CosyVoice 2's prompt lacks), naming `model`."""
        owner = self.bank_owners.get(model, model)
        if owner == model or model not in self.cores:
            return
        lm, owner_lm = self.cores[model].entry.family.lm, self.cores[owner].entry.family.lm
        if lm.voice_lm_speaker != owner_lm.voice_lm_speaker:
            raise InvalidArgumentError(
                "model", f"{model} shares its detokenizer with {owner}, whose voice bank encodes voices for {owner}; "
                f"list {model} first in the config to register voices for it"
            )  # fmt: skip

    def entries(self) -> list[ModelEntry]:
        return [core.entry for core in self.cores.values()]

    def start(self) -> None:
        """The shared drain watch, and each model's metrics holder and rebalancer."""
        self.drain.start()
        for core in self.cores.values():
            core.metrics.start()
            core.rebalancer.start()

    async def stop(self) -> None:
        for core in self.cores.values():
            await core.rebalancer.stop()


def models_response(entries: list[ModelEntry] | ModelEntry) -> voxray_pb2.ListModelsResponse:
    """gRPC `ListModels`: every served model, the default first."""
    listed = [entries] if isinstance(entries, ModelEntry) else entries
    return voxray_pb2.ListModelsResponse(
        models=[
            voxray_pb2.ModelInfo(name=entry.name, description=entry.description, sample_rate_hz=entry.sample_rate_hz)
            for entry in listed
        ]
    )


def models_json(entries: list[ModelEntry]) -> dict:
    """HTTP `/v1/models` (OpenAI's list shape), with each model's sample rate."""
    data = [{"id": e.name, "object": "model", "owned_by": "voxray", "sample_rate_hz": e.sample_rate_hz}
            for e in entries]  # fmt: skip
    return {"object": "list", "data": data}
