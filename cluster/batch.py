"""`voxray batch`: synthesize a JSONL file of texts to WAVs in throughput mode, in-process.

Each line is {"text": ..., "voice": ..., "id": ...} (voice and id optional). Every line is
validated before any work starts; errors name the line and field. Reports x-real-time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cluster.pipeline import InProcessPipeline
from core.config import EngineConfig
from core.errors import InvalidArgumentError
from router.audio_format import write_wav


@dataclass(frozen=True)
class BatchItem:
    item_id: str
    text: str
    voice: str | None


@dataclass(frozen=True)
class BatchReport:
    num_items: int
    audio_s: float
    wall_s: float

    @property
    def x_real_time(self) -> float:
        return self.audio_s / max(self.wall_s, 1e-9)


def read_items(path: Path) -> list[BatchItem]:
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidArgumentError(f"{path}:{number}", f"not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InvalidArgumentError(f"{path}:{number}.text", "each line needs a string field 'text'")
        item_id = str(record.get("id", number))
        if "/" in item_id or item_id.startswith("."):
            raise InvalidArgumentError(f"{path}:{number}.id", "must be a plain file name")
        items.append(BatchItem(item_id, record["text"], record.get("voice")))
    if not items:
        raise InvalidArgumentError(str(path), "holds no prompts")
    return items


def run_batch(config: EngineConfig, items: list[BatchItem], out_dir: Path, sampling: dict | None = None) -> BatchReport:
    """Synthesize every item (all queued at once; the engine batches them) and write `<id>.wav`."""
    pipeline = InProcessPipeline(
        config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"policy": "throughput"})})
    )
    try:
        for item in items:  # validates text / voice before any compute
            pipeline.submit(item.item_id, item.text, item.voice, sampling)
        out_dir.mkdir(parents=True, exist_ok=True)
        pcm: dict[str, list[bytes]] = {item.item_id: [] for item in items}
        rate = pipeline.detok.codec.sample_rate_hz
        start = time.perf_counter()
        with tqdm(total=len(items), unit="wav", desc="synthesizing") as progress:
            for chunk in pipeline.stream():
                pcm[chunk.req_id].append(chunk.pcm16)
                if chunk.is_final:
                    write_wav(out_dir / f"{chunk.req_id}.wav", b"".join(pcm.pop(chunk.req_id)), rate)
                    progress.update(1)
    finally:
        pipeline.close()
    wall_s = time.perf_counter() - start
    audio_s = sum(p.stat().st_size - 44 for p in (out_dir / f"{i.item_id}.wav" for i in items)) / 2 / rate
    return BatchReport(len(items), audio_s, wall_s)
