"""router/metrics.py: the last finished stream's real-time factor stays exported while the router
idles (Ray drops a gauge not set for two export intervals)."""

from __future__ import annotations

import time

from router import metrics as router_metrics


class RecordingGauge:
    def __init__(self, name: str, description: str = "", *args) -> None:
        self.name, self.values, self.tags = name, [], {}

    def set_default_tags(self, tags: dict[str, str]) -> None:
        self.tags = tags

    def set(self, value: float) -> None:
        self.values.append(value)


def test_the_realtime_factor_is_set_again_while_no_stream_finishes(monkeypatch):
    monkeypatch.setattr(router_metrics, "Gauge", RecordingGauge)
    monkeypatch.setattr(router_metrics, "GAUGE_HOLD_S", 0.01)
    metrics = router_metrics.RouterMetrics("orpheus-tiny")
    assert metrics._realtime.tags == {"model": "orpheus-tiny"}  # every series is per served model
    metrics.start()
    time.sleep(0.1)
    assert metrics._realtime.values == []  # nothing to hold before a stream finished
    metrics.set_realtime(2.5)
    give_up_s = time.monotonic() + 5.0
    while len(metrics._realtime.values) < 4 and time.monotonic() < give_up_s:
        time.sleep(0.01)
    assert len(metrics._realtime.values) >= 4 and set(metrics._realtime.values) == {2.5}
