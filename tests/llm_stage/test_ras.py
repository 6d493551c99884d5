"""Repetition-aware sampling (CosyVoice 2's RAS): its nucleus, its redraw, its window threshold,
seeded reproducibility in a mixed batch, and validation that names the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from llm_stage.jobs import check_sampling
from llm_stage.ras import repeat_threshold
from llm_stage.sampler import SamplingRow, sample
from protos import voxray_pb2
from router.jobs import sampling_from_proto
from tests.factories import adapter_engine, cosyvoice2_adapter

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
DRAWS = 4000


def draw_counts(params: SamplingParams, recent: list[int], cand: torch.Tensor | None = None) -> np.ndarray:
    """Counts per column of DRAWS rows drawn from PROBS (one batched call, a seed per row)."""
    logits = PROBS.log().expand(DRAWS, -1).clone()
    rows = [SamplingRow(params, [], seed=b, recent=list(recent)) for b in range(DRAWS)]
    cands = None if cand is None else cand.expand(DRAWS, -1)
    ids = sample(logits, cands, rows)
    if cand is not None:
        ids = [cand.tolist().index(i) for i in ids]
    return np.bincount(ids, minlength=len(PROBS))


def assert_frequencies(counts: np.ndarray, weights: list[float]) -> None:
    want = np.array(weights) / sum(weights)
    assert np.all(counts[want == 0] == 0), counts
    np.testing.assert_allclose(counts / counts.sum(), want, atol=0.03)


def ras(**fields) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "ras_window": 10, "ras_tau": 0.1, **fields})


def test_nucleus_takes_top_p_over_the_whole_distribution():
    """top_k 2, top_p 0.5: CosyVoice keeps rank 1 (0.4 of the whole mass lies above it); top-p over
    the top-2 mass (0.4 / 0.65 > 0.5), as the plain sampler does, would keep rank 0 only."""
    assert_frequencies(draw_counts(ras(top_k=2, top_p=0.5), recent=[]), [0.4, 0.25, 0, 0, 0, 0])
    plain = draw_counts(SamplingParams(temperature=1.0, top_k=2, top_p=0.5), recent=[])
    assert_frequencies(plain, [1, 0, 0, 0, 0, 0])


def test_a_repeated_draw_is_redrawn_from_the_whole_distribution_without_it():
    assert_frequencies(draw_counts(ras(top_k=1), recent=[3, 0, 5]), [0, 0.25, 0.15, 0.1, 0.06, 0.04])
    assert_frequencies(draw_counts(ras(top_k=1), recent=[1, 2, 3, 4, 5]), [1, 0, 0, 0, 0, 0])


def test_candidate_columns_compare_vocab_ids():
    cand = torch.tensor([100, 101, 102, 103, 104, 105])
    assert_frequencies(draw_counts(ras(top_k=1), recent=[100], cand=cand), [0, 0.25, 0.15, 0.1, 0.06, 0.04])
    assert_frequencies(draw_counts(ras(top_k=1), recent=[0], cand=cand), [1, 0, 0, 0, 0, 0])


def test_window_threshold():
    assert_frequencies(draw_counts(ras(top_k=1, ras_tau=0.3), recent=[0, 0]), [1, 0, 0, 0, 0, 0])
    assert_frequencies(draw_counts(ras(top_k=1, ras_tau=0.3), recent=[0, 0, 0]), [0, 0.25, 0.15, 0.1, 0.06, 0.04])
    wire_tau = float(np.float32(0.1))  # 0.10000000149 as a float32 proto field arrives
    assert repeat_threshold(ras(ras_tau=wire_tau)) == 1 and repeat_threshold(ras(ras_tau=0.25)) == 3


def test_greedy_rows_are_not_redrawn():
    assert_frequencies(draw_counts(ras(temperature=0.0), recent=[0] * 10), [1, 0, 0, 0, 0, 0])


def test_seeded_rows_reproduce_in_any_batch_and_plain_rows_are_unchanged():
    adapter = cosyvoice2_adapter()
    seeded = {"seed": 7, "max_tokens": 40}
    plain = {"seed": 8, "max_tokens": 40, "ras_window": 0}

    def run(requests: dict[str, dict]) -> dict[str, list[int]]:
        engine = adapter_engine(adapter, num_slots=4, seed=123)
        for req_id, sampling in requests.items():
            engine.add_request(req_id, "repetition aware", sampling=sampling)
        return engine.run_to_completion()

    mixed = run({"s": seeded, "p": plain, "other": {"max_tokens": 40}, "hot": {"temperature": 1.5, "seed": 1}})
    assert run({"s": seeded})["s"] == mixed["s"]
    assert run({"p": plain})["p"] == mixed["p"]
    assert run({"s": {**seeded, "seed": 99}})["s"] != mixed["s"]
    assert len(mixed["s"]) == 40 and all(0 <= t < 6561 for t in mixed["s"])  # under the 20x-text bound


def test_engine_rows_see_their_own_last_window():
    adapter = cosyvoice2_adapter()
    engine = adapter_engine(adapter, num_slots=2)
    req = engine.add_request("r", "abc", sampling={"ras_window": 3})
    req.output_ids = [5, 6, 7, 8]
    assert engine._sampling_row(req, 0).recent == [6, 7, 8]
    assert engine._sampling_row(engine.add_request("q", "abc", sampling={"ras_window": 0}), 0).recent == []


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"ras_window": -1}, "sampling.ras_window"),
        ({"ras_window": 1001}, "sampling.ras_window"),
        ({"ras_window": 2.5}, "sampling.ras_window"),
        ({"ras_window": True}, "sampling.ras_window"),
        ({"ras_tau": 0}, "sampling.ras_tau"),
        ({"ras_tau": 1.5}, "sampling.ras_tau"),
        ({"ras_tau": "0.1"}, "sampling.ras_tau"),
    ],
)
def test_bad_ras_fields_name_the_field(sampling, field):
    with pytest.raises(InvalidArgumentError) as err:
        check_sampling(sampling, cosyvoice2_adapter().default_sampling)
    assert err.value.field == field


def test_ras_fields_arrive_over_grpc_and_default_per_family():
    options = voxray_pb2.SamplingOptions(ras_window=12, ras_tau=0.25)
    params = check_sampling(sampling_from_proto(options), SamplingParams())
    assert (params.ras_window, params.ras_tau) == (12, 0.25)
    default = cosyvoice2_adapter().default_sampling
    assert (default.top_k, default.top_p, default.ras_window, default.ras_tau) == (25, 0.8, 10, 0.1)
    assert SamplingParams().ras_window == 0  # other families: off
