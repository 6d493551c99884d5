"""CFG paired co-scheduling in the pure-Python scheduler, driven with fake tokens."""

from __future__ import annotations

import torch

from core.messages import SamplingParams
from llm_stage.cfg import GuidanceFormula, merge_guidance
from llm_stage.request import FinishReason, Request, RequestStatus
from llm_stage.scheduler import Scheduler
from tests.factories import EOS_FAKE, fake_request, fake_scheduler


def run_step(sched: Scheduler, token: int = 7) -> tuple[list[str], list[Request]]:
    """One step: every sampled (visible) row gets `token`; returns the row ids in order and finished requests."""
    plan = sched.schedule()
    rows = [r.req_id for r in plan.sampling_rows]
    finished = sched.update(plan, [token] * len(plan.sampled_requests))
    return rows, finished


def test_pair_admitted_only_with_two_free_slots_and_counts_both():
    sched = fake_scheduler(num_slots=3, max_batch_size=4)
    sched.add(fake_request("g1", 5, twin_prompt_len=2))
    sched.add(fake_request("g2", 5, twin_prompt_len=2))
    sched.add(fake_request("plain", 4))
    plan = sched.schedule()
    assert sched.slots.num_used == 2  # g1 and its twin; g2 needs 2 slots, only 1 left: nothing partial
    assert [w.req.req_id for w in plan.prefills] == ["g1", "g1#uncond"]
    assert [r.req_id for r in sched.waiting] == ["g2", "plain"]
    assert sched.running["g1"].twin.slot is not None and sched.running["g1"].twin.slot != sched.running["g1"].slot


def test_pair_prefills_in_lockstep_then_decodes_on_adjacent_rows():
    sched = fake_scheduler(num_slots=4, max_batch_size=4, budget=4)
    sched.add(fake_request("solo", 3))
    sched.add(fake_request("g", 9, twin_prompt_len=3))
    seen = [run_step(sched)[0] for _ in range(5)]
    guided = sched.running["g"]
    # both rows' prompts complete in the same step, so the pair enters the batch together
    first_rows = next(rows for rows in seen if "g" in rows)
    assert first_rows[first_rows.index("g") + 1] == "g#uncond"
    rows, _ = run_step(sched)
    assert rows == ["solo", "g", "g#uncond"]
    assert guided.output_ids == guided.twin.output_ids  # the twin is fed the guided stream's tokens
    assert guided.num_cached - guided.prompt_len == guided.twin.num_cached - guided.twin.prompt_len


def test_prefill_budget_of_one_cannot_stall_a_pair():
    sched = fake_scheduler(budget=1)
    sched.add(fake_request("g", 4, twin_prompt_len=6))
    for _ in range(20):
        run_step(sched)
    assert sched.running["g"].status is RequestStatus.DECODING
    assert len(sched.running["g"].output_ids) > 0


def test_finish_and_cancel_release_both_slots():
    sched = fake_scheduler(num_slots=4)
    sched.add(fake_request("g", 3, twin_prompt_len=2))
    sched.add(fake_request("h", 3, twin_prompt_len=2))
    run_step(sched)
    assert sched.slots.num_used == 4
    plan = sched.schedule()
    finished = sched.update(plan, [EOS_FAKE, 7])  # g stops, h continues
    assert [r.req_id for r in finished] == ["g"]
    assert finished[0].twin.status is RequestStatus.FINISHED and finished[0].finish_reason is FinishReason.STOP
    assert sched.slots.num_used == 2
    cancelled = sched.cancel("h")
    assert cancelled.twin.status is RequestStatus.CANCELLED and sched.slots.num_used == 0
    assert not sched.has_work


def test_length_finish_covers_the_pair():
    sched = fake_scheduler()
    sched.add(fake_request("g", 3, max_tokens=4, twin_prompt_len=2))
    steps = 0
    while sched.has_work:
        run_step(sched)
        steps += 1
    assert steps == 4 and sched.slots.num_free == 4


def test_preempted_pair_requeues_and_reprefills_generated_tokens():
    sched = fake_scheduler(num_slots=4, budget=64)
    sched.add(fake_request("g", 3, twin_prompt_len=2))
    for _ in range(4):
        run_step(sched, token=40)
    guided = sched.running["g"]
    assert sched.preempt("g") and sched.slots.num_used == 0
    assert sched.waiting[0] is guided and guided.twin.status is RequestStatus.WAITING
    plan = sched.schedule()
    assert [(w.req.req_id, w.num_tokens) for w in plan.prefills] == [("g", 3 + 4), ("g#uncond", 2 + 4)]
    sched.update(plan, [41])
    assert guided.output_ids[-2:] == [40, 41] and guided.twin.output_ids == guided.output_ids
    rows, _ = run_step(sched)
    assert rows == ["g", "g#uncond"]
    assert guided.num_cached == guided.num_known - 1 and guided.twin.num_cached == guided.twin.num_known - 1
    assert not sched.preempt("nobody")


def test_pair_counts_two_rows_against_max_batch_size():
    sched = fake_scheduler(num_slots=6, max_batch_size=3)
    sched.add(fake_request("g1", 2, twin_prompt_len=2))
    sched.add(fake_request("g2", 2, twin_prompt_len=2))
    sched.add(fake_request("p", 2))
    for _ in range(3):
        rows, _ = run_step(sched)
        assert len(rows) <= 3
    assert rows == ["g1", "g1#uncond"]  # g2 (2 rows) does not fit beside g1; p waits behind it (FCFS)
    assert [r.req_id for r in sched.waiting] == ["g2", "p"]
    sched.cancel("g1")
    run_step(sched)
    assert run_step(sched)[0] == ["g2", "g2#uncond", "p"]


def guided_rows(scale: float, top_k: int = 0) -> list[Request]:
    params = SamplingParams(guidance_scale=scale, top_k=top_k)
    guided = Request("g", [1], params)
    guided.twin = Request("g#uncond", [1], params, is_twin=True)
    return [guided, guided.twin, Request("p", [1], SamplingParams())]


def test_guidance_formulas_merge_adjacent_rows_and_drop_twins():
    logits = torch.tensor([[2.0, 0.0, 1.0], [1.0, 1.0, 1.0], [5.0, 6.0, 7.0]])
    rows = guided_rows(2.0)
    linear, _ = merge_guidance(logits, None, rows, GuidanceFormula.LINEAR)
    dia, _ = merge_guidance(logits, None, rows, GuidanceFormula.DIA)
    assert linear.tolist() == [[3.0, -1.0, 1.0], [5.0, 6.0, 7.0]]  # uncond + g (cond - uncond)
    assert dia.tolist() == [[4.0, -2.0, 1.0], [5.0, 6.0, 7.0]]  # cond + g (cond - uncond)
    dia_top1, _ = merge_guidance(logits, None, guided_rows(2.0, top_k=2), GuidanceFormula.DIA)
    assert dia_top1[0].tolist() == [2.0, float("-inf"), 1.0]  # cond logits on the guided top-2


def test_multi_codebook_logits_merge_per_codebook():
    cond, uncond = torch.randn(4, 5), torch.randn(4, 5)
    logits = torch.stack([cond, uncond, torch.zeros(4, 5)])  # [N=3, K=4, C=5]
    merged, _ = merge_guidance(logits, None, guided_rows(3.0), GuidanceFormula.LINEAR)
    torch.testing.assert_close(merged[0], uncond + 3.0 * (cond - uncond))
    assert merged.shape == (2, 4, 5)


def per_row_dia_top_k(cond: torch.Tensor, guided: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """The merge as it was, one row at a time: cond kept on each row's guided top-k (k 0: guided as is)."""
    out = guided.clone()
    for b, k in enumerate(top_ks):
        if k:
            top = guided[b].topk(min(k, guided.shape[-1]), dim=-1).indices
            out[b] = torch.full_like(cond[b], float("-inf")).scatter(-1, top, cond[b].gather(-1, top))
    return out


def test_dia_merge_in_one_batch_equals_the_merge_row_by_row():
    """The device-side merge (one top-k at the largest k, ranks masked per row) gives the per-row merge's
    logits for mixed top_k (0, small, above the vocab) on [G, K, V] and [G, V] logits."""
    generator = torch.Generator().manual_seed(4)
    top_ks = [0, 3, 45, 7, 200]
    for shape in ((5, 9, 64), (5, 64)):
        cond, uncond = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        rows = []
        for k in top_ks:
            params = SamplingParams(guidance_scale=3.0, top_k=k)
            guided = Request(f"g{k}", [1], params)
            guided.twin = Request(f"g{k}#uncond", [1], params, is_twin=True)
            rows += [guided, guided.twin]
        logits = torch.stack([t for pair in zip(cond, uncond, strict=True) for t in pair])
        merged, _ = merge_guidance(logits, None, rows, GuidanceFormula.DIA)
        expected = per_row_dia_top_k(cond, cond + 3.0 * (cond - uncond), top_ks)
        assert torch.equal(merged, expected)
