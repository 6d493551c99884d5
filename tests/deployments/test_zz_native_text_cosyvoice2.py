"""CosyVoice 2 native text streaming (bistream) under a real local Ray + Serve: cosyvoice2-tiny, one
incremental WebSocket stream typed word by word is one streaming-text request that waits for its
text groups on the LLM replica, and its audio equals the in-process pipeline's for the same
streaming job with the whole text at once (S3Gen float noise of another batch composition aside)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from ray import serve

from cluster.pipeline import InProcessPipeline
from core.config import AdmissionConfig, EngineConfig, ModelConfig, StageDeploymentConfig
from core.messages import Job
from tests.deployments.conftest import small_config
from tests.deployments.test_native_text_stream import ws_messages

pytestmark = pytest.mark.slow
BISTREAM = small_config(
    app_name="voxray-bistream", route_prefix="/bistream",
    engine=EngineConfig(model=ModelConfig(name="cosyvoice2-tiny")),
    llm=StageDeploymentConfig(num_cpus=0.25), detok=StageDeploymentConfig(num_cpus=0.25),
    router=StageDeploymentConfig(num_cpus=0.25),
    admission=AdmissionConfig(max_streams_per_replica=4, max_queued_per_replica=4, default_ttfa_deadline_s=120.0),
)  # fmt: skip
WORDS = ["Hello ", "there, ", "my ", "good ", "friend."]
# 28 text ids (bytes) read 5 at a time, 15 speech ids per group: a request that may stop before its text
# ends (60 ids = 4 groups) races the last word (sent after it stopped, that word opens a second segment);
# 120 ids outlast the text's 6 groups, so the one request runs until the client's end, whatever the pace
SAMPLING = {"seed": 5, "max_tokens": 120}
MAX_PCM_STEPS = 8  # S3Gen in another batch composition: float noise through the NSF phase, PCM16 rounding


def whole_text_audio() -> bytes:
    pipeline = InProcessPipeline(BISTREAM.engine)
    sampling = pipeline.llm.engine.adapter.default_sampling.model_copy(update=SAMPLING)
    pipeline.add_job(Job("whole", "".join(WORDS), None, sampling, 60.0, text_streaming=True))
    pipeline.llm.engine.push_text("whole", end=True)
    return b"".join(chunk.pcm16 for chunk in pipeline.stream())


def test_a_typed_stream_waits_for_text_groups_and_equals_the_whole_text(cluster):
    from websockets.sync.client import connect

    from cluster.server import deploy_app

    ep = deploy_app(BISTREAM)
    try:
        llm = serve.get_deployment_handle("LLMStage", BISTREAM.app_name)
        url = ep.http_url.replace("http://", "ws://", 1) + BISTREAM.route_prefix + "/v1/audio/speech/stream"
        seen_waiting = 0
        with connect(url, open_timeout=60) as ws:
            ws.send(json.dumps({"sampling": SAMPLING, "request_id": "bistream-1"}))
            assert json.loads(ws.recv(timeout=60))["type"] == "ready"
            for word in WORDS:
                ws.send(json.dumps({"text": word}))
                time.sleep(0.3)
                seen_waiting = max(seen_waiting, llm.stats.remote().result()["waiting_for_text"])
            ws.send(json.dumps({"end": True}))
            got, code = ws_messages(ws)
        metas = [m for m in got if isinstance(m, dict)]
        assert code == 1000 and metas[-1]["type"] == "done", metas[-1]
        assert {m["segment"] for m in metas if m["type"] == "audio"} == {0}  # one request, not segments
        assert seen_waiting == 1  # it read a text group and waited for the next, holding its KV
        audio = np.frombuffer(b"".join(m for m in got if isinstance(m, bytes)), dtype="<i2").astype(np.int32)
        want = np.frombuffer(whole_text_audio(), dtype="<i2").astype(np.int32)
        assert audio.shape == want.shape and audio.size > 0
        assert np.abs(audio - want).max() <= MAX_PCM_STEPS
    finally:
        serve.delete(BISTREAM.app_name)
