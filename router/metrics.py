"""The router's Prometheus series (client-facing stream quality), through Ray Serve's metrics API
(`ray_` prefix added). Created inside the Router replica; the engine stages' series are in
`deployments.metrics`.
"""

from __future__ import annotations

import threading
import time

from ray.serve.metrics import Counter, Gauge, Histogram

LATENCY_BUCKETS_S = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
UNDERRUN_BUCKETS_S = [0.0001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0]
GAUGE_HOLD_S = 0.5  # re-set period of the held gauges: under half Ray's shortest metric export interval (1 s)


MODEL_TAG = "model"  # every router series is per served model (a multi-model app has one RouterMetrics each)


class RouterMetrics:
    """Client-facing stream quality of one served model, measured where the audio leaves the cluster."""

    def __init__(self, model: str = "") -> None:
        tags = (MODEL_TAG,)
        self.ttfa = Histogram(
            "voxray_ttfa_seconds", "Request received -> first audio sent.", LATENCY_BUCKETS_S, tag_keys=tags
        )
        self.ttft = Histogram(
            "voxray_time_to_first_text_seconds", "Speech in: request received -> the answer's first text sent.",
            LATENCY_BUCKETS_S, tag_keys=tags,
        )  # fmt: skip
        self.viable = Counter("voxray_stream_viable", "Finished streams whose every chunk was on time.", tags)
        self.finished = Counter("voxray_streams_finished", "Finished streams (viable or not).", tags)
        self.underrun = Histogram(
            "voxray_chunk_underrun_seconds", "Per chunk: playback gap before it arrived (0 = on time).",
            UNDERRUN_BUCKETS_S, tag_keys=tags,
        )  # fmt: skip
        self.audio = Counter("voxray_audio_seconds", "Seconds of audio sent to clients.", tags)
        self._realtime = Gauge(
            "voxray_realtime_factor", "Audio seconds / wall seconds of the last finished stream.", tags
        )
        self._last_realtime: float | None = None
        self.rejections = Counter("voxray_admission_rejections", "Requests answered RESOURCE_EXHAUSTED / 429.", tags)
        self.moves = Counter("voxray_stream_moves", "Streams handed to another LLM replica with their KV.", tags)
        self.resumes = Counter("voxray_stream_resumes", "Streams moved to another LLM replica after theirs died.", tags)
        for series in (self.ttfa, self.ttft, self.viable, self.finished, self.underrun, self.audio, self._realtime,
                       self.rejections, self.moves, self.resumes):  # fmt: skip
            series.set_default_tags({MODEL_TAG: model})

    def set_realtime(self, factor: float) -> None:
        """The last finished stream's real-time factor, held (re-set by `start`'s thread) until the next."""
        self._last_realtime = factor
        self._realtime.set(factor)

    def start(self) -> None:
        """Re-set the held gauges every GAUGE_HOLD_S: Ray drops a gauge not set for two export
        intervals, so an idle router's last real-time factor would vanish from the scrape."""
        threading.Thread(target=self._hold, name="voxray-router-gauges", daemon=True).start()

    def _hold(self) -> None:
        while True:
            time.sleep(GAUGE_HOLD_S)
            if self._last_realtime is not None:
                self._realtime.set(self._last_realtime)
