"""Start-up warm-up of an LLM engine at its largest shapes, before the first real stream.

A replica's memory steps up the first time a step is bigger than any before it: CPU allocators
keep the high water of a new peak batch (logits of every row over a 157k vocabulary, the prefill
activations of the longest prompt), so in the 60-minute soak of 2026-12-05 a replica's RSS rose
by 5-7% in one step at 18-27 minutes, the first time its batch reached a new peak, then stayed
flat. vLLM sizes its memory by a dummy run at the largest batch for the same reason. Here the
engine runs, before it serves: `max_batch_size` rows of warm-up requests (one with the longest
text the ingress accepts, the rest with short prompts), through their prefill at the full prompt
budget and `FULL_STEPS` decode steps with every row decoding; then they are cancelled.

Nothing a later stream sees changes: the requests carry their own seeds (the engine's seed source
is not drawn from), and the step timer, the prefill pace and the output head's phase state are
restored, so the first real stream meets the prior, as admission expects (`StepTimer.measured_step_s`).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

from core.errors import InvalidArgumentError
from llm_stage.engine import LLMEngine
from llm_stage.prefill_pace import PrefillPace
from llm_stage.request import RequestStatus

logger = logging.getLogger(__name__)

FULL_STEPS = 3  # decode steps with every warm-up row decoding
MAX_STEPS = 1024  # a bound on the whole warm-up (prefill of every prompt included)
MAX_TOKENS = 256  # per warm-up request: enough to be decoding while the last one starts
WARM_UP_SEED = 0x5EED
WORDS = "Warm up the engine at its largest shapes before the first voice stream. "


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up ran (logged at start, in the replica's stats)."""

    requests: int
    rows: int
    prompt_tokens: int
    longest_prompt: int
    steps: int
    full_steps: int
    seconds: float


def _text(max_chars: int) -> str:
    return (WORDS * (max_chars // len(WORDS) + 1))[:max_chars].rstrip()


def _add(engine: LLMEngine, index: int, max_chars: int) -> tuple[int, int] | None:
    """Queue warm-up request `index` with up to `max_chars` of text (halved until its prompt fits
    the context); (rows, prompt tokens), or None when it cannot be added."""
    sampling = {"seed": WARM_UP_SEED + index, "max_tokens": MAX_TOKENS}
    while max_chars >= len(WORDS):
        try:
            req = engine.add_job(engine.job(f"warm-up-{index}", _text(max_chars), sampling=sampling))
        except InvalidArgumentError as err:
            if err.field not in ("text", "sampling.max_tokens"):
                return None
            max_chars //= 2
            continue
        return len(req.unit), max(row.prompt_len for row in req.unit)
    return None


def _all_decoding(engine: LLMEngine) -> bool:
    reqs = [r for r in engine.requests.values() if r.req_id.startswith("warm-up-")]
    return bool(reqs) and all(r.status is RequestStatus.DECODING for r in reqs)


def warm_up(engine: LLMEngine) -> WarmUp:
    """Run the warm-up (see the module docstring) and leave the engine as it was, idle."""
    assert not engine.requests, "warm up an engine before it serves"
    started_s = time.perf_counter()
    kept = copy.deepcopy(vars(engine.timer)), copy.deepcopy(vars(engine.policy.phases))
    kept_pace, engine.prefill_pace = engine.prefill_pace, PrefillPace()  # cold prefills: not the pace
    max_rows = min(engine.scheduler.config.max_batch_size, engine.cache_config.num_slots)
    rows = prompt_tokens = longest = 0
    index = 0
    max_chars = engine.adapter.max_text_chars  # the first request: the longest text
    while rows < max_rows:
        added = _add(engine, index, max_chars)
        if added is None or rows + added[0] > max_rows:
            if added is not None:
                engine.cancel(f"warm-up-{index}")
            break
        rows, prompt_tokens, longest = rows + added[0], prompt_tokens + added[1], max(longest, added[1])
        index += 1
        max_chars = len(WORDS)  # the rest: short prompts
    steps = full_steps = 0
    try:
        while engine.has_work and steps < MAX_STEPS and full_steps < FULL_STEPS:
            engine.step()
            steps += 1
            full_steps += _all_decoding(engine)
    finally:
        for req_id in [r for r in engine.requests if r.startswith("warm-up-")]:
            engine.cancel(req_id)
        engine.scheduler.give_back_kept()  # (their prompts are no conversation's)
        vars(engine.timer).update(kept[0])
        vars(engine.policy.phases).update(kept[1])
        engine.prefill_pace = kept_pace
        engine.last_batch_size = 0
    report = WarmUp(index, rows, prompt_tokens, longest, steps, full_steps, time.perf_counter() - started_s)
    logger.info("LLM warm-up: %s", report)
    return report
