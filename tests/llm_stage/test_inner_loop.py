"""A frame's inner loop chained on the device (`llm_stage.inner_loop`), run here on CPU tensors: CSM's
depth decoder and Qwen3-TTS's code predictor on a static KV cache with device draws give the codes of
today's per-codebook host path (DynamicCache / growing cache, numpy draws), greedy and seeded, in mixed
batches, padded to captured sizes or not; and a frame reads the host back once. On a GPU the captured
graphs give eager's codes."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.config import CacheConfig, ModelConfig, SchedulerConfig
from llm_stage.engine import LLMEngine
from llm_stage.inner_loop import InnerTable
from llm_stage.models.base import LMAdapter
from llm_stage.models.csm import CsmAdapter
from llm_stage.models.qwen3_tts import Qwen3TTSAdapter
from llm_stage.step_draws import inner_graph_sizes
from tests.graph_capture import OpNames

MIXED = [  # one batch: greedy and seeded rows with every filter
    {"temperature": 0.0},
    {"temperature": 0.9, "top_k": 20, "seed": 7},
    {"temperature": 1.0, "top_p": 0.8, "seed": 3},
    {"temperature": 0.7, "min_p": 0.05, "seed": 11},
]
GREEDY = [{"temperature": 0.0}] * 3
PENALISED = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5, "repetition_penalty": 1.3}]


def widened(adapter: LMAdapter, seed: int) -> LMAdapter:
    """Weights wider than the default init, so greedy picks are not near-ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return adapter


@functools.cache
def adapter(family: str) -> LMAdapter:
    if family == "csm":
        return widened(CsmAdapter.build(ModelConfig(name="csm-tiny", seed=5)), seed=1)
    return widened(Qwen3TTSAdapter.build(ModelConfig(name="qwen3-tts-tiny", seed=5)), seed=2)


def engine(ad: LMAdapter, on_device: bool, sizes: tuple[int, ...] = (), async_steps: bool = False) -> LLMEngine:
    """`sizes`: the graph sizes (the inner loop pads to them; on CUDA captures them); none: eager."""
    scheduler = SchedulerConfig(
        max_batch_size=4, prefill_token_budget=64, cuda_graphs=bool(sizes), cuda_graph_batch_sizes=sizes,
        async_steps=async_steps,
    )  # fmt: skip
    return LLMEngine(ad, CacheConfig(num_slots=4, max_seq_len=256), scheduler, chain_frames_on_device=on_device)


def codes(ad: LMAdapter, on_device: bool, rows: list[dict], sizes: tuple[int, ...] = (), frames: int = 8, **sched):
    eng = engine(ad, on_device, sizes, **sched)
    try:
        for i, fields in enumerate(rows):
            sampling = {**ad.default_sampling.model_dump(), "max_tokens": frames, **fields}
            eng.add_request(f"r{i}", "say it " * (i + 1), None, sampling)
        return eng.run_to_completion()
    finally:
        eng.close()


@contextmanager
def inner_loop_calls(ad: LMAdapter) -> Iterator[list[int]]:
    """Batch sizes `ad.inner_loop.run` was called with (the static path was taken)."""
    calls: list[int] = []
    original = ad.inner_loop.run

    def run(hidden, first, table, sizes):
        calls.append(hidden.shape[0])
        return original(hidden, first, table, sizes)

    ad.inner_loop.run = run
    try:
        yield calls
    finally:
        del ad.inner_loop.run


@pytest.mark.parametrize("family", ["csm", "qwen3-tts"])
@pytest.mark.parametrize("rows", [GREEDY, MIXED], ids=["greedy", "mixed"])
@pytest.mark.parametrize("sizes", [(), (1, 2, 8)], ids=["unpadded", "padded"])
def test_static_inner_loop_gives_the_host_paths_codes(family, rows, sizes):
    ad = adapter(family)
    want = codes(ad, on_device=False, rows=rows)
    with inner_loop_calls(ad) as calls:
        got = codes(ad, on_device=True, rows=rows, sizes=sizes)
    assert got == want
    assert calls and max(calls) == len(rows)
    assert all(len(tokens) >= 2 * ad.num_codebooks for tokens in want.values())  # frames were drawn


@pytest.mark.parametrize("family", ["csm", "qwen3-tts"])
def test_async_steps_chain_frames_with_the_host_paths_codes(family):
    ad = adapter(family)
    want = codes(ad, on_device=False, rows=MIXED)
    with inner_loop_calls(ad) as calls:
        assert codes(ad, on_device=True, rows=MIXED, sizes=(2, 4), async_steps=True) == want
    assert calls


@pytest.mark.parametrize("family", ["csm", "qwen3-tts"])
def test_penalised_rows_chain_on_the_device_with_the_host_paths_codes(family):
    """CSM penalises its inner codebooks (the chain runs eagerly, each draw penalised); Qwen3-TTS only
    codebook 0, so its inner loop stays the static one."""
    ad = adapter(family)
    want = codes(ad, on_device=False, rows=PENALISED)
    with inner_loop_calls(ad) as calls:
        assert codes(ad, on_device=True, rows=PENALISED) == want
    assert bool(calls) == (family == "qwen3-tts")


def test_repetition_aware_rows_take_the_host_path():
    ad = adapter("csm")
    rows = [{"temperature": 0.8, "seed": 2, "ras_window": 10, "ras_tau": 0.2}]
    want = codes(ad, on_device=False, rows=rows, frames=4)
    with inner_loop_calls(ad) as calls:
        assert codes(ad, on_device=True, rows=rows, frames=4) == want
    assert not calls


class ScalarReads(TorchDispatchMode):
    """Counts tensor -> Python scalar reads (`.item()`, `int(t)`, `bool(t)`: a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads_per_frame(ad: LMAdapter) -> Iterator[list[int]]:
    """Per `sample_tokens` call (one frame per row): tensor reads into host values (`tolist`, `numpy`,
    `cpu`, scalar reads)."""
    per_frame: list[int] = []
    counter = {"reads": 0}
    with pytest.MonkeyPatch.context() as patch:
        for name in ("tolist", "numpy", "cpu"):
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _original=original, **kwargs):
                counter["reads"] += 1
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        sample_tokens = ad.sample_tokens

        def counted_sample(*args, **kwargs):
            counter["reads"] = 0
            with ScalarReads() as scalars:
                out = sample_tokens(*args, **kwargs)
            per_frame.append(counter["reads"] + scalars.count)
            return out

        patch.setattr(ad, "sample_tokens", counted_sample)
        yield per_frame


@pytest.mark.parametrize("family", ["csm", "qwen3-tts"])
def test_a_frame_reads_the_host_back_once_on_the_device_path(family):
    ad = adapter(family)
    with host_reads_per_frame(ad) as device_reads:
        codes(ad, on_device=True, rows=MIXED, frames=3)
    with host_reads_per_frame(ad) as host_reads:
        codes(ad, on_device=False, rows=MIXED, frames=3)
    print(f"{family} host reads per frame: device path {sorted(set(device_reads))}, host {sorted(set(host_reads))}")
    assert device_reads and max(device_reads) == 1
    assert min(host_reads) >= ad.num_codebooks  # today's path: a read per codebook


@torch.inference_mode()  # as the engine samples
def test_inner_loop_pads_to_its_sizes_and_captures_nothing_off_cuda():
    ad = adapter("qwen3-tts")
    hidden = torch.randn(3, ad.backbone.hidden_size)
    first = torch.tensor([5, 9, 1])
    table = InnerTable.padding(3, ad.num_codebooks - 1, hidden.device)  # greedy rows
    unpadded = ad.inner_loop.run(hidden, first, table, ())
    assert unpadded.shape == (3, ad.num_codebooks - 1)
    assert torch.equal(ad.inner_loop.run(hidden, first, table, (1, 8)), unpadded)
    assert ad.inner_loop.capture_all((1, 8), hidden) == 0


@pytest.mark.parametrize("family", ["csm", "qwen3-tts"])
@torch.inference_mode()
def test_what_a_graph_captures_runs_no_op_that_waits_for_the_host(family):
    """The captured function (padding rows, mixed greedy / filtered rows) runs no op with a data-dependent
    shape or a scalar read: the ops that would sync a CUDA stream, or fail its capture."""
    ad = adapter(family)
    hidden = torch.randn(2, ad.backbone.hidden_size)
    table = InnerTable.padding(2, ad.num_codebooks - 1, hidden.device)
    table = InnerTable(table.temperature, table.top_k + 5, table.top_p * 0.9, table.top_p * 0.01,
                       torch.tensor([True, False]), table.keys + 17)  # fmt: skip
    with OpNames() as ops:
        codes = ad.inner_loop.run(hidden, torch.tensor([3, 4]), table, (4,))
    assert codes.shape == (2, ad.num_codebooks - 1)
    assert "sort" in ops.names and not ops.host_waiting


def test_inner_graph_sizes_stop_at_the_first_that_holds_the_batch():
    assert inner_graph_sizes((1, 2, 4, 8, 16, 24), 5) == (1, 2, 4, 8)
    assert inner_graph_sizes((1, 2), 5) == (1, 2)
    assert inner_graph_sizes((), 5) == ()


def cuda_adapter(family: str) -> LMAdapter:
    name = {"csm": "csm-tiny", "qwen3-tts": "qwen3-tts-tiny"}[family]
    cls = CsmAdapter if family == "csm" else Qwen3TTSAdapter
    return widened(cls.build(ModelConfig(name=name, seed=5, device="cuda")), seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["csm", "qwen3-tts"])
@pytest.mark.parametrize("rows", [GREEDY, MIXED], ids=["greedy", "mixed"])
def test_inner_loop_graphs_give_eagers_codes_on_cuda(family, rows):
    ad = cuda_adapter(family)
    eager = codes(ad, on_device=True, rows=rows)
    graphs = codes(ad, on_device=True, rows=rows, sizes=(1, 2, 4))
    assert ad.inner_loop.num_captured == 3
    assert graphs == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["csm", "qwen3-tts"])
def test_inner_loop_graphs_give_the_per_codebook_paths_codes_on_cuda(family):
    ad = cuda_adapter(family)
    assert codes(ad, on_device=True, rows=MIXED, sizes=(1, 2, 4)) == codes(ad, on_device=False, rows=MIXED)
