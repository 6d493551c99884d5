"""router/served.py: a multi-model Router picks each request's model, names an unknown one, lists what
it serves, and admits per model (each model's LLM deployment has a load board of its own). No Ray
cluster: the handles are stand-ins naming their deployment, the boards real `PredictedTTFARouter`s
fed the stats Serve hands them (as in tests/router/test_dispatch.py)."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from core.config import ServeConfig
from core.errors import InvalidArgumentError
from router.dispatch import PredictedTTFARouter, board_scope, handle_scope
from router.served import ServedModels, models_json, models_response
from router.streams import AdmissionRejected
from tests.router.test_dispatch import Replica, report

APP = "served-test"
MODELS = ("orpheus-tiny", "csm-tiny")


class DeploymentStandIn:
    """What the Router reads of a Serve handle before calling it: its deployment's name."""

    def __init__(self, deployment_name: str) -> None:
        self.deployment_name = deployment_name

    def options(self, **_) -> DeploymentStandIn:
        return self


def multi_config(names: tuple[str, ...] = MODELS) -> ServeConfig:
    return ServeConfig(app_name=APP, models=[{"engine": {"model": {"name": name}}} for name in names])


def served(names: tuple[str, ...] = MODELS, shared_detok: bool = False) -> ServedModels:
    llm = {name: DeploymentStandIn(f"LLMStage-{name}") for name in names}
    detok = {name: DeploymentStandIn("DetokStage-shared" if shared_detok else f"DetokStage-{name}") for name in names}
    return ServedModels.build(multi_config(names), llm, detok, replica="router-1")


def fields(**overrides) -> dict:
    base = {"text": "Hello there.", "model": "", "voice": "", "sampling": {}, "output_format": "pcm16",
            "sample_rate_hz": 0, "ttfa_deadline_s": 0.0, "req_id": "r"}  # fmt: skip
    return {**base, **overrides}


def test_each_request_goes_to_its_models_core_and_an_empty_model_to_the_first():
    models = served()
    assert models.names == list(MODELS)
    assert models.core_for("").entry.name == "orpheus-tiny"
    for name in MODELS:
        core = models.core_for(name)
        assert core.entry.name == name and core.config.engine.model.name == name
        assert core.llm_scope == f"{APP}:LLMStage-{name}"  # its own load board
    # a job is checked against the chosen model's family: CSM's speakers are "0".."9", Orpheus' are names
    assert models.core_for("csm-tiny").job(**fields(model="csm-tiny", voice="3")).voice == "3"
    with pytest.raises(InvalidArgumentError) as err:
        models.core_for("orpheus-tiny").job(**fields(model="orpheus-tiny", voice="3"))
    assert err.value.field == "voice"


@pytest.mark.parametrize("model", ["dia-tiny", "orpheus", "nope\x00"])
def test_an_unknown_model_is_invalid_naming_the_field_and_listing_the_served_ones(model):
    with pytest.raises(InvalidArgumentError) as err:
        served().core_for(model)
    assert err.value.field == "model"
    assert "this server serves orpheus-tiny, csm-tiny" in str(err.value)
    assert "\x00" not in str(err.value)


def test_listings_name_every_served_model_default_first():
    entries = served().entries()
    listed = models_response(entries).models
    assert [(m.name, m.sample_rate_hz) for m in listed] == [(e.name, e.sample_rate_hz) for e in entries]
    assert [m.name for m in listed] == list(MODELS) and all(m.description for m in listed)
    assert [item["id"] for item in models_json(entries)["data"]] == list(MODELS)


def test_a_single_model_router_keeps_its_app_wide_board_and_refuses_other_models():
    handles = {"orpheus-tiny": DeploymentStandIn("LLMStage")}
    models = ServedModels.build(ServeConfig(app_name=APP), handles, handles, replica="router-1")
    assert models.names == ["orpheus-tiny"] and models.default.llm_scope == APP
    with pytest.raises(InvalidArgumentError, match="this server serves orpheus-tiny$"):
        models.core_for("csm-tiny")


def test_voice_registrations_go_to_a_model_that_takes_them():
    models = served(("orpheus-tiny", "cosyvoice2-tiny"))
    assert models.voices_core("").entry.name == "cosyvoice2-tiny"
    assert models.voices_core("orpheus-tiny").entry.name == "orpheus-tiny"  # it refuses, naming `model`
    assert models.bank_owners == {"orpheus-tiny": "orpheus-tiny", "cosyvoice2-tiny": "cosyvoice2-tiny"}


def test_a_model_whose_shared_voice_bank_encodes_for_another_lm_refuses_registrations():
    """cosyvoice2-tiny listed first builds the shared S3Gen deployment's VoiceBank, which encodes
    voices without the speaker embedding chatterbox's T3 needs."""
    models = served(("cosyvoice2-tiny", "chatterbox-tiny"), shared_detok=True)  # one detok deployment for both
    assert models.bank_owners == {"cosyvoice2-tiny": "cosyvoice2-tiny", "chatterbox-tiny": "cosyvoice2-tiny"}
    assert models.voices_core("cosyvoice2-tiny").entry.name == "cosyvoice2-tiny"
    with pytest.raises(InvalidArgumentError) as err:
        models.voices_core("chatterbox-tiny")
    assert err.value.field == "model" and "list chatterbox-tiny first" in str(err.value)


def test_board_scopes_keep_single_model_names_and_separate_per_model_deployments():
    assert board_scope(APP, "LLMStage") == APP and board_scope(APP, "DetokStage") == APP
    assert board_scope(APP, "LLMStage-csm-tiny") == f"{APP}:LLMStage-csm-tiny"
    assert handle_scope(DeploymentStandIn("DetokStage-s3gen"), APP) == f"{APP}:DetokStage-s3gen"
    assert handle_scope(object(), APP) == APP  # a stand-in without a deployment: the app's board


def _board(model: str, num_active: int) -> PredictedTTFARouter:
    """The load board of `model`'s LLM deployment in this process, one replica reporting `num_active`
    of its 4 streams (no queue)."""
    deployment = DeploymentID(name=f"LLMStage-{model}", app_name=APP)
    board = PredictedTTFARouter(deployment, DeploymentHandleSource.UNKNOWN, get_curr_time_s=lambda: 1000.0)
    board.initialize_state()  # registers it under the deployment's scope
    replica = Replica(ReplicaID(unique_id=f"{model}-r1", deployment_id=deployment), report(num_active, 1000.0))
    board.update_replicas([replica])
    return board


def test_admission_is_per_model_a_full_model_refuses_while_the_other_admits():
    async def run() -> tuple[int, int]:
        boards = [_board("orpheus-tiny", num_active=4), _board("csm-tiny", num_active=0)]
        models = served()
        orpheus, csm = models.core_for("orpheus-tiny"), models.core_for("csm-tiny")
        counted = {core.entry.name: 0 for core in (orpheus, csm)}
        for core in (orpheus, csm):
            core.metrics.rejections.inc = lambda name=core.entry.name: counted.__setitem__(name, counted[name] + 1)
        with pytest.raises(AdmissionRejected):
            orpheus.check_capacity(orpheus.job(**fields(model="orpheus-tiny", ttfa_deadline_s=60.0)))
        csm.check_capacity(csm.job(**fields(model="csm-tiny", ttfa_deadline_s=60.0)))  # admitted: its board is idle
        assert len(boards) == 2
        return counted["orpheus-tiny"], counted["csm-tiny"]

    assert asyncio.run(run()) == (1, 0)  # the refusal counts in the full model's series only


def test_the_router_charges_a_speech_in_requests_clip_at_the_replicas_measured_pace():
    """A long clip on a busy step-audio2 replica is refused at once (and its gRPC deadline judged) on
    the prediction that counts its prefill; a short clip with the same deadline is let through."""
    import dataclasses
    from types import SimpleNamespace

    from core.messages import AudioClip
    from router.deadlines import DeadlineUnmeetable

    name = "step-audio2-tiny"

    async def run() -> None:
        deployment = DeploymentID(name=f"LLMStage-{name}", app_name=APP)
        board = PredictedTTFARouter(deployment, DeploymentHandleSource.UNKNOWN, get_curr_time_s=lambda: 1000.0)
        board.initialize_state()
        paced = {**report(2, 1000.0), "prefill_tokens_per_s": 400.0, "encoder_s_per_audio_s": 0.1}
        board.update_replicas([Replica(ReplicaID(unique_id="sa-r1", deployment_id=deployment), paced)])
        core = served((name,)).core_for(name)
        template = core.job(**fields(model=name, ttfa_deadline_s=2.0))

        def with_clip(duration_s: float):
            return dataclasses.replace(template, audio=AudioClip(b"\x00\x01" * round(duration_s * 16_000), 16_000))

        core.check_capacity(with_clip(1.0))  # ~0.3 s of prefill and encode: in time
        with pytest.raises(AdmissionRejected):
            core.check_capacity(with_clip(40.0))  # ~505 positions at 400 a second and a 4 s encode: not
        client = SimpleNamespace(time_remaining=lambda: 3.0)
        assert (await core.fit_client_deadline(with_clip(1.0), client)).ttfa_deadline_s == 2.0
        with pytest.raises(DeadlineUnmeetable):
            await core.fit_client_deadline(with_clip(40.0), client)

    asyncio.run(run())
