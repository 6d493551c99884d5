"""Per-request sampling in one mixed batch."""

from __future__ import annotations

import torch

from cluster.types import SamplingParams
from llm_stage.sampler import SamplingRow, apply_repetition_penalty, sample
from tests.factories import text_engine, tiny_text_llama


def run(engine, params: dict[str, SamplingParams], prompt: list[int]) -> dict[str, list[int]]:
    for req_id, p in params.items():
        engine.add_prompt(req_id, prompt, p)
    return engine.run_to_completion()


def test_mixed_batch_topk1_equals_greedy_and_seeded_rows_reproduce():
    model = tiny_text_llama(seed=1)
    prompt = [1, 5, 9, 33, 71]
    mixed = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=20),
        "topk1": SamplingParams(temperature=1.3, top_k=1, max_tokens=20),
        "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20),
        "hot": SamplingParams(temperature=1.5, top_k=50, min_p=0.05, max_tokens=20),
        "penalised": SamplingParams(temperature=0.8, repetition_penalty=1.5, repetition_window=8, max_tokens=20),
    }
    first = run(text_engine(model), mixed, prompt)
    assert first["topk1"] == first["greedy"]
    alone = run(text_engine(model), {"seeded": mixed["seeded"]}, prompt)
    assert alone["seeded"] == first["seeded"]  # same seed, different batch-mates, same tokens
    other_seed = {"seeded": mixed["seeded"].model_copy(update={"seed": 99})}
    assert run(text_engine(model), other_seed, prompt)["seeded"] != first["seeded"]


def test_repetition_penalty_matches_definition():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0), history=[0, 1, 1], generator=None)
    apply_repetition_penalty(logits, None, [row])
    assert logits.tolist() == [[1.0, -2.0, 0.5, 3.0]]  # positive / p, negative * p, unseen untouched


def test_repetition_penalty_window_and_candidate_columns():
    logits = torch.tensor([[2.0, -1.0, 4.0]])
    cand = torch.tensor([[100, 101, 102]])
    row = SamplingRow(SamplingParams(repetition_penalty=4.0, repetition_window=2), [102, 7, 101], None)
    apply_repetition_penalty(logits, cand, [row.__class__(row.params, row.history[-2:], None)])
    assert logits.tolist() == [[2.0, -4.0, 4.0]]  # only 101 is inside the window


def test_top_p_and_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    top_p = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.6), [], None)]
    min_p = [SamplingRow(SamplingParams(temperature=1.0, min_p=0.5), [], None)]
    seen_p = {sample(logits, None, top_p, gen)[0] for _ in range(200)}
    seen_min = {sample(logits, None, min_p, gen)[0] for _ in range(200)}
    assert seen_p == {0, 1}  # 0.5 alone < 0.6, so the second token is kept; the rest are cut
    assert seen_min == {0, 1}  # 0.15 < 0.5 * 0.5


def test_candidate_ids_map_back_to_vocab():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    cand = torch.tensor([[40, 41, 42]])
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], None)]
    assert sample(logits, cand, rows, torch.Generator()) == [41]


def test_draws_follow_the_filtered_distribution_and_never_pick_masked_columns():
    logits = torch.tensor([[0.0, float("-inf"), 1.8, 1.1], [0.0, 0.0, 0.0, 0.0]])
    want = logits.softmax(dim=-1)
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=1.0), [], None) for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, 4)
    for _ in range(4000):
        for b, token in enumerate(sample(logits, None, rows, generator)):
            counts[b, token] += 1
    assert counts[0, 1] == 0
    torch.testing.assert_close(counts / 4000, want, atol=0.03, rtol=0)
