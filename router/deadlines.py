"""The gRPC client's deadline, applied to a job before it is dispatched.

A client that gives up after `remaining_s` gains nothing from first audio later than that, so the
job's TTFA deadline is cut to it (the LLM replica then queues it only when it can still start in
time), and a request whose deadline is shorter than the best replica's predicted time to first
audio is rejected at once with DEADLINE_EXCEEDED instead of being admitted to miss it.
"""

from __future__ import annotations

from dataclasses import replace

from core.messages import Job
from llm_stage.prompt_work import PromptWork
from router.admission import ReplicaLoad, credible_ttfa_s


class DeadlineUnmeetable(Exception):
    """The client's deadline ends before the first audio can reach it."""


def client_deadline_s(grpc_context) -> float | None:
    """Seconds left of the call's deadline (None: the client set none, or no gRPC call)."""
    if grpc_context is None or not hasattr(grpc_context, "time_remaining"):
        return None
    return grpc_context.time_remaining()


def best_predicted_ttfa_s(loads: list[ReplicaLoad], work: PromptWork | None = None) -> float | None:
    """The lowest predicted time to first output over the known LLM replicas for a request bringing
    `work` (its own prompt work, `router.admission.prefill_s`) (None: none known yet, or some replica's
    prediction is not credible, `router.admission.is_credible`: it may start sooner)."""
    predictions = [credible_ttfa_s(load, work) for load in loads]
    known = [predicted_s for predicted_s in predictions if predicted_s is not None]
    return min(known, default=None) if len(known) == len(predictions) else None


def fit_to_client_deadline(job: Job, remaining_s: float | None, predicted_ttfa_s: float | None) -> Job:
    """`job` with its TTFA deadline cut to the client's; raises DeadlineUnmeetable when even the best
    replica's predicted first audio comes after the client gives up."""
    if remaining_s is None:
        return job
    if remaining_s <= 0 or (predicted_ttfa_s is not None and predicted_ttfa_s > remaining_s):
        predicted = f"{predicted_ttfa_s * 1000:.0f} ms" if predicted_ttfa_s is not None else "unknown"
        raise DeadlineUnmeetable(
            f"cannot start in time: the call's deadline leaves {max(remaining_s, 0) * 1000:.0f} ms, "
            f"predicted time to first audio {predicted}"
        )
    return replace(job, ttfa_deadline_s=min(job.ttfa_deadline_s, remaining_s))
