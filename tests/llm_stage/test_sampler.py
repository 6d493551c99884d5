"""Per-request sampling in one mixed batch."""

from __future__ import annotations

import pytest
import torch

from core.messages import SamplingParams
from llm_stage.host_sampler import penalize_repeats
from llm_stage.sampler import (
    RowTable,
    SamplingRow,
    kept_columns,
    penalize_on_device,
    sample,
    sample_on_device,
)
from tests.factories import text_engine, tiny_text_llama


def device_sampler(logits, cand, rows):
    return sample_on_device(logits, cand, rows).tolist()


# `sample` takes numpy for CPU logits; the torch path (accelerators) runs on CPU tensors too
SAMPLERS = pytest.mark.parametrize("sampler", [sample, device_sampler], ids=["host", "torch"])


def draw_rows(params: list[SamplingParams], counter: int, seed: int = 0) -> list[SamplingRow]:
    """One row per params, each its own seed, at draw `counter` (a new draw for every counter)."""
    return [SamplingRow(p, [], seed=seed + b, counter=counter) for b, p in enumerate(params)]


def device_penalty(logits: torch.Tensor, cand: torch.Tensor | None, rows: list[SamplingRow]) -> None:
    penalize_on_device(logits, cand, RowTable.of(rows, logits.shape[1], logits.device), vocab_size=1000)


def host_penalty(logits: torch.Tensor, cand: torch.Tensor | None, rows: list[SamplingRow]) -> None:
    penalize_repeats(logits.numpy(), None if cand is None else cand.numpy(), rows)  # in place through the view


PENALTIES = pytest.mark.parametrize(
    "penalize", [host_penalty, device_penalty], ids=["host", "device"]
)


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


@PENALTIES
def test_repetition_penalty_matches_definition(penalize):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0), history=[0, 1, 1])
    penalize(logits, None, [row])
    assert logits.tolist() == [[1.0, -2.0, 0.5, 3.0]]  # positive / p, negative * p, unseen untouched


@PENALTIES
def test_repetition_penalty_window_and_candidate_columns(penalize):
    logits = torch.tensor([[2.0, -1.0, 4.0]])
    cand = torch.tensor([[100, 101, 102]])
    row = SamplingRow(SamplingParams(repetition_penalty=4.0, repetition_window=2), [102, 7, 101])
    penalize(logits, cand, [row.__class__(row.params, row.history[-2:])])
    assert logits.tolist() == [[2.0, -4.0, 4.0]]  # only 101 is inside the window


def test_both_penalties_agree_on_a_mixed_batch_with_padded_candidates():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen)
    cand = torch.randint(0, 400, (3, 50), generator=gen)
    cand[2, 3], cand[2, 40:] = 350, -1  # padding columns never match an id
    histories = [torch.randint(150, 400, (80,), generator=gen).tolist(), [], [350, 350, 399]]  # ids < 150: unseen
    params = [SamplingParams(repetition_penalty=p) for p in (1.3, 2.0, 1.5)]
    rows = [SamplingRow(p, h) for p, h in zip(params, histories, strict=True)]
    host, device = logits.clone(), logits.clone()
    host_penalty(host, cand, rows)
    device_penalty(device, cand, rows)
    assert not torch.equal(host, logits)
    assert host[2, 3] != logits[2, 3] and torch.equal(host[1], logits[1])
    torch.testing.assert_close(device, host, rtol=0, atol=0)


@SAMPLERS
def test_top_p_and_min_p_restrict_support(sampler):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_p, min_p = SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.0, min_p=0.5)
    seen_p = {sampler(logits, None, draw_rows([top_p], i))[0] for i in range(200)}
    seen_min = {sampler(logits, None, draw_rows([min_p], i))[0] for i in range(200)}
    assert seen_p == {0, 1}  # 0.5 alone < 0.6, so the second token is kept; the rest are cut
    assert seen_min == {0, 1}  # 0.15 < 0.5 * 0.5


@SAMPLERS
def test_candidate_ids_map_back_to_vocab(sampler):
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    cand = torch.tensor([[40, 41, 42], [50, 51, 52]])
    rows = [SamplingRow(SamplingParams(temperature=0.0), []), SamplingRow(SamplingParams(top_k=1), [])]
    assert sampler(logits, cand, rows) == [41, 51]


@SAMPLERS
def test_draws_follow_the_filtered_distribution_and_never_pick_masked_columns(sampler):
    logits = torch.tensor([[0.0, float("-inf"), 1.8, 1.1], [0.0, 0.0, 0.0, 0.0]])
    want = logits.softmax(dim=-1)
    params = [SamplingParams(temperature=1.0, top_p=1.0)] * 2
    counts = torch.zeros(2, 4)
    for i in range(4000):
        for b, token in enumerate(sampler(logits, None, draw_rows(params, i))):
            counts[b, token] += 1
    assert counts[0, 1] == 0
    torch.testing.assert_close(counts / 4000, want, atol=0.03, rtol=0)


def reference_kept_probs(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered distribution by definition, on the fully sorted row."""
    sorted_logits, order = scaled.sort(descending=True)
    probs = sorted_logits.softmax(-1)
    if params.top_k:
        probs[params.top_k :] = 0
        probs = probs / probs.sum()
    keep = (probs.cumsum(-1) - probs) <= params.top_p
    probs = torch.where(keep, probs, 0)
    probs = torch.where(probs >= params.min_p * probs[0], probs, 0)
    out = torch.zeros_like(probs)
    out[order] = probs / probs.sum()
    return out


@SAMPLERS
def test_draws_follow_the_filtered_distribution_for_every_filter(sampler):
    """Narrow and wide nuclei, top-k, top-k with top-p, min-p and no filter at all: each row's draws
    (one per counter) match the filtered distribution and never pick a filtered-out column."""
    torch.manual_seed(0)
    width, draws = 400, 3000
    peaked = torch.randn(width) * 4
    flat = torch.randn(width) * 0.3
    cases = [
        (peaked, SamplingParams(temperature=1.0, top_p=0.8)),
        (flat, SamplingParams(temperature=1.0, top_p=0.5)),
        (flat, SamplingParams(temperature=1.0, top_k=100)),
        (peaked, SamplingParams(temperature=1.0, top_k=20, top_p=0.9)),
        (peaked, SamplingParams(temperature=1.0, min_p=0.2)),
        (peaked, SamplingParams(temperature=1.0)),
    ]
    logits = torch.stack([row for row, _ in cases])
    params = [p for _, p in cases]
    kept = kept_columns(logits, RowTable.of(draw_rows(params, 0), width, logits.device))
    counts = torch.zeros(len(cases), width)
    for i in range(draws):
        for b, token in enumerate(sampler(logits, None, draw_rows(params, i))):
            counts[b, token] += 1
    for b, (row_logits, p) in enumerate(cases):
        want = reference_kept_probs(row_logits, p)
        assert torch.equal(kept[b], want > 0), f"case {b}: kept columns"
        assert counts[b][want == 0].sum() == 0, f"case {b} drew a filtered-out column"
        torch.testing.assert_close(counts[b] / draws, want, atol=0.035, rtol=0, msg=f"case {b}")


def test_host_and_device_samplers_draw_the_same_tokens_from_the_same_seeds():
    """Both samplers race on the same counter-based uniforms: a seeded stream draws the same tokens
    on a CPU replica and on an accelerator (but where float noise ties two columns' races)."""
    logits = torch.randn(300, 4097, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.6, top_p=0.8), SamplingParams(temperature=1.0, top_k=50, min_p=0.02)]
    rows = [SamplingRow(params[b % 2], [], seed=1000 + b, counter=7 * b) for b in range(300)]
    assert sample(logits, None, rows) == device_sampler(logits, None, rows)


@SAMPLERS
def test_float_noise_in_the_logits_does_not_move_seeded_draws(sampler):
    """A stream resumed by re-prefill on another replica sees its logits through other kernels
    (~5e-7 apart). Over a near-flat row (what random weights give: top-p keeps thousands of
    columns) an inverse-CDF search flipped about one draw in a thousand on such noise, which
    changed a resumed seeded stream from there on (issue 23); the race draws must not."""
    params = SamplingParams(temperature=0.6, top_p=0.8)
    noise = torch.Generator().manual_seed(1)
    logits = torch.randn(3000, 4097, generator=torch.Generator().manual_seed(0)) * 0.05
    nudged = logits + (torch.rand(logits.shape, generator=noise) - 0.5) * 1e-6

    def draws(values: torch.Tensor) -> list[int]:
        rows = [SamplingRow(params, [], seed=b) for b in range(values.shape[0])]
        return sampler(values.clone(), None, rows)

    same = sum(a == b for a, b in zip(draws(logits), draws(nudged), strict=True))
    assert same == logits.shape[0]
