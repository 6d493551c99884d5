"""The Router counts a registered voice's prompt in its own estimates (at-once refusal, a gRPC deadline, the
ranking), as the LLM replica does at admission: CosyVoice 2's zero-shot voice prefills its clip's speech tokens
and transcript. The Router looks a voice up once from the VoiceBank (stood in for here; the cluster tests run the
real one) and counts it as the family's adapter does, from the `VoicePrompt` alone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from core.config import EngineConfig, ModelConfig, VoicesConfig
from core.voices import VoicePrompt, voice_id_for
from llm_stage.jobs import build_job
from llm_stage.prompt_work import prompt_work
from llm_stage.registry import check_model_config, get_entry
from llm_stage.wiring import build_llm_side
from router.deadlines import DeadlineUnmeetable
from router.dispatch import PredictedTTFARouter
from router.streams import RouterCore
from router.voices import UNKNOWN_RECHECK_S, VoiceRegistry, voice_request_from_json
from tests.router.test_dispatch import Replica, report
from tests.router.test_served import APP, fields, served
from tests.router.test_voices import Remote, body

MODEL = "cosyvoice2-tiny"
TRANSCRIPT = "Hello there, this is my voice."
SPOKEN = VoicePrompt(voice_id_for(MODEL, b"clip a", 16_000, TRANSCRIPT), TRANSCRIPT, tuple(range(7, 257)))
UNSPOKEN = VoicePrompt(voice_id_for(MODEL, b"clip b", 16_000, ""), "", tuple(range(7, 107)))


class PromptBank:
    """The VoiceBank's `prompt` and `register` calls over a dict of prompts; `lost` makes every call fail as a dead
    actor's would."""

    def __init__(self, prompts: dict[str, VoicePrompt], lost: bool = False) -> None:
        self.asked: list[str] = []

        async def prompt(voice_id: str) -> VoicePrompt | None:
            self.asked.append(voice_id)
            if lost:
                raise RayActorError()
            return prompts.get(voice_id)

        async def register(wave, rate, text):
            from deployments.voices import Registered

            prompts[SPOKEN.voice_id] = SPOKEN
            return Registered(SPOKEN.voice_id, len(SPOKEN.prompt_tokens), wave.numel() / rate, True)

        self.prompt, self.register = Remote(prompt), Remote(register)


def registry_over(bank: PromptBank, model: str = MODEL, clock=None) -> VoiceRegistry:
    async def find_bank() -> PromptBank:
        return bank

    entry = check_model_config(ModelConfig(name=model))
    return VoiceRegistry(entry, VoicesConfig(), find_bank, *(() if clock is None else (clock,)))


def test_the_router_counts_a_registered_voice_as_the_replica_does():
    adapter = build_llm_side(EngineConfig(model=ModelConfig(name=MODEL, torch_threads=1))).engine.adapter
    for prompt in (SPOKEN, UNSPOKEN):
        adapter.add_voice_prompt(prompt)
        assert type(adapter).registered_voice_positions(prompt) == adapter.voice_prompt_positions(prompt.voice_id)
    assert type(adapter).registered_voice_positions(SPOKEN) > len(SPOKEN.prompt_tokens)  # tokens and transcript
    assert type(adapter).registered_voice_positions(UNSPOKEN) == 0  # cross-lingual: the LM gets neither


def test_a_voice_is_looked_up_once_and_an_unknown_one_or_a_lost_bank_counts_nothing():
    bank = PromptBank({SPOKEN.voice_id: SPOKEN})
    voices = registry_over(bank)
    assert voices.prompt_positions(SPOKEN.voice_id) == 0  # not looked up yet
    for _ in range(3):
        asyncio.run(voices.learn(SPOKEN.voice_id))
    assert bank.asked == [SPOKEN.voice_id]
    lm = get_entry(MODEL).family.lm
    assert voices.prompt_positions(SPOKEN.voice_id) == lm.registered_voice_positions(SPOKEN) > 0
    unknown = voice_id_for(MODEL, b"never registered", 16_000, "")
    asyncio.run(voices.learn(unknown))
    assert voices.prompt_positions(unknown) == 0 and voices.prompt_positions(None) == 0
    asyncio.run(voices.learn("tara"))  # a built-in name, not a registered id: not asked
    assert bank.asked == [SPOKEN.voice_id, unknown]
    lost = registry_over(PromptBank({SPOKEN.voice_id: SPOKEN}, lost=True))
    asyncio.run(lost.learn(SPOKEN.voice_id))
    assert lost.prompt_positions(SPOKEN.voice_id) == 0 and lost.bank is None


def test_a_voice_registered_through_this_router_counts_at_once():
    voices = registry_over(PromptBank({}))
    out = asyncio.run(voices.register(**voice_request_from_json(body(prompt_text=TRANSCRIPT))))
    assert out["voice_id"] == SPOKEN.voice_id
    assert voices.prompt_positions(SPOKEN.voice_id) == get_entry(MODEL).family.lm.registered_voice_positions(SPOKEN)


def test_an_unknown_id_is_asked_about_again_only_after_a_while_and_at_once_once_registered_here():
    """A client retrying a mistyped id costs no bank call each time; the bank is asked again after
    UNKNOWN_RECHECK_S (another Router may have registered it); a registration through this Router counts at once
    even for an id it was told was unknown."""
    now = [100.0]
    bank = PromptBank({})
    voices = registry_over(bank, clock=lambda: now[0])
    for _ in range(3):
        asyncio.run(voices.learn(SPOKEN.voice_id))
    assert bank.asked == [SPOKEN.voice_id] and voices.prompt_positions(SPOKEN.voice_id) == 0
    now[0] += UNKNOWN_RECHECK_S
    asyncio.run(voices.learn(SPOKEN.voice_id))
    assert bank.asked == [SPOKEN.voice_id] * 2
    out = asyncio.run(voices.register(**voice_request_from_json(body(prompt_text=TRANSCRIPT))))
    assert out["voice_id"] == SPOKEN.voice_id and bank.asked == [SPOKEN.voice_id] * 3
    assert voices.prompt_positions(SPOKEN.voice_id) == get_entry(MODEL).family.lm.registered_voice_positions(SPOKEN)
    assert not voices.unknown


def test_the_unknown_ids_kept_are_bounded_oldest_first():
    voices = registry_over(PromptBank({}))
    voices.config = VoicesConfig(max_voices=2)
    ids = [voice_id_for(MODEL, bytes([n]), 16_000, "") for n in range(3)]
    for voice in ids:
        asyncio.run(voices.learn(voice))
    assert list(voices.unknown) == ids[1:]


def test_a_chatterbox_voice_is_not_looked_up_its_replicas_default_voice_counts():
    bank = PromptBank({})
    voices = registry_over(bank, model="chatterbox-tiny")
    asyncio.run(voices.learn(voice_id_for("chatterbox-tiny", b"clip", 16_000, "")))
    assert bank.asked == []


def test_the_routers_prompt_work_carries_the_voices_positions():
    core = object.__new__(RouterCore)  # its estimate alone: no handles, no Serve
    core.entry, core.voices = get_entry(MODEL), None
    job = build_job(core.entry.family.lm, text="Good morning, and welcome aboard.", voice=SPOKEN.voice_id)
    plain = core.prompt_work(job)
    assert plain == prompt_work(core.entry.family.lm, job)  # no registry: the text alone
    core.use_voices(registry_over(PromptBank({SPOKEN.voice_id: SPOKEN})))
    asyncio.run(core.learn_voice(job))
    added = core.entry.family.lm.registered_voice_positions(SPOKEN)
    assert core.prompt_work(job).num_positions == plain.num_positions + added


def test_a_grpc_deadline_counts_a_registered_voice_looked_up_first():
    """The gRPC call's deadline is fitted before the stream runs: the voice is looked up there, so a deadline the
    text alone would make but the voice's prompt would not is refused at once."""

    async def run() -> None:
        deployment = DeploymentID(name=f"LLMStage-{MODEL}", app_name=APP)
        board = PredictedTTFARouter(deployment, DeploymentHandleSource.UNKNOWN, get_curr_time_s=lambda: 1000.0)
        board.initialize_state()
        board.update_replicas([Replica(ReplicaID(unique_id="cv-r1", deployment_id=deployment),
                                       {**report(2, 1000.0), "prefill_tokens_per_s": 400.0})])  # fmt: skip
        core = served((MODEL,)).core_for(MODEL)
        job = core.job(**fields(model=MODEL, voice=SPOKEN.voice_id, ttfa_deadline_s=5.0))
        client = SimpleNamespace(time_remaining=lambda: 0.5)  # predicted 0.12 s for the text, 0.76 with the voice
        assert (await core.fit_client_deadline(job, client)).voice == SPOKEN.voice_id  # the text alone: in time
        core.use_voices(registry_over(PromptBank({SPOKEN.voice_id: SPOKEN})))
        with pytest.raises(DeadlineUnmeetable):  # + ~258 positions at 400 a second
            await core.fit_client_deadline(job, client)

    asyncio.run(run())
