"""A detokenizer engine on its own thread, so decoding overlaps the LLM step in one process.

The in-process pipeline hands chunks in with `submit` and collects audio with `collect`;
the worker thread alone touches the DetokEngine. Torch releases the GIL inside ops, so on
two cores the LLM and the codec run at the same time (the cluster gets this from separate
replicas). `num_in_flight` counts chunks whose audio has not been collected yet.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from core.messages import AudioChunk, TokenChunk
from detok_stage.engine import DetokEngine


class DetokWorker:
    def __init__(self, engine: DetokEngine, on_decoded: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.on_decoded = on_decoded  # receives each step's decode time (feeds the policy's estimate)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="detok-worker", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def submit(self, chunk: TokenChunk) -> None:
        self.engine.validate(chunk)  # bad frames raise here, in the caller, never on the worker
        with self._lock:
            self._in_flight += 1
        self._inbox.put(("chunk", chunk))

    def release(self, req_id: str) -> None:
        self._inbox.put(("release", req_id))

    def collect(self, wait_s: float = 0.0) -> list[AudioChunk]:
        """Audio decoded since the last call; waits up to `wait_s` for the first one."""
        out = []
        try:
            out.append(self._outbox.get(timeout=wait_s) if wait_s > 0 else self._outbox.get_nowait())
            while True:
                out.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        with self._lock:
            self._in_flight -= len(out)
        return out

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain(block=not self.engine.has_work)  # never spin while waiting
            if self.engine.has_work:
                start = time.perf_counter()
                decoded = self.engine.step()
                if decoded and self.on_decoded is not None:
                    self.on_decoded(time.perf_counter() - start)
                for audio in decoded:
                    self._outbox.put(audio)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            while True:
                self._apply(*item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _apply(self, kind: str, payload) -> None:
        if kind == "chunk":
            self.engine.submit(payload)
        elif kind == "release":
            dropped = self.engine.release(payload)
            with self._lock:
                self._in_flight -= dropped
