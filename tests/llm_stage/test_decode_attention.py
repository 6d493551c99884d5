"""The GPU decode step's parts, proven on a CPU: decode attention equals SDPA over each row's own
tokens (mixed lengths, a padding row, GQA) and reads only those tokens (the Triton kernel run in
Triton's interpreter, its loads counted); the step's attention work does not grow with
`max_seq_len`; a decode step reads back from the device once; seeded streams on the device
sampler draw the same tokens alone, in a batch and across a resume."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import llm_stage.attention as attention
import llm_stage.sampler as sampler_module
from core.messages import ResumeState
from llm_stage.attention import decode_attention_sdpa
from llm_stage.decode_graphs import DecodeGraphs
from tests.factories import orpheus_engine
from tests.graph_capture import waits_for_host

ROOT = Path(__file__).resolve().parents[2]


def per_row_reference(q, keys, values, slots, lens, scale):
    """Each row alone: SDPA over exactly its own `len` cached tokens (GQA by repeating KV heads)."""
    out = []
    group = q.shape[1] // keys.shape[1]
    for b in range(q.shape[0]):
        k = keys[slots[b], :, : lens[b]].repeat_interleave(group, dim=0)
        v = values[slots[b], :, : lens[b]].repeat_interleave(group, dim=0)
        out.append(F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale).squeeze(1))
    return torch.stack(out)


def test_torch_decode_attention_equals_each_rows_own_sdpa():
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, heads, dim, max_len = 5, 2, 6, 40, 96
    keys = torch.randn(rows + 1, kv_heads, max_len, dim, generator=gen)
    values = torch.randn(rows + 1, kv_heads, max_len, dim, generator=gen)
    q = torch.randn(rows, heads, dim, generator=gen)
    slots = torch.tensor([3, 0, 4, 1, rows])  # the last: a padding row on the scratch slot
    lens = torch.tensor([96, 1, 37, 64, 1], dtype=torch.int32)
    want = per_row_reference(q, keys, values, slots, lens, 0.3)
    torch.testing.assert_close(decode_attention_sdpa(q, keys, values, slots, lens, 0.3), want)
    whole_rows = decode_attention_sdpa(q, keys, values, slots, lens, 0.3, length=max_len)  # what a capture reads
    torch.testing.assert_close(whole_rows, want)


def test_triton_kernels_in_the_interpreter():
    """The kernels that serve CUDA, in Triton's interpreter. Decode attention: outputs within float32
    rounding of SDPA over each row's tokens (one and several splits, GQA groups of 2 to 4, head dims
    64, 80, 128, a padding row), and its K and V loads are exactly the cached tokens: the same at 256
    and 4096. Rotary + cache write: the torch ops' bits in fp32 and bf16. Residual add + RMSNorm: the
    sums' bits, the norm's bits in bf16 (fp32: rounding). With both fused, an engine's tokens. The
    paged layout: attention through a shuffled block table (blocks of 16 and 5) equals SDPA and
    loads only the cached tokens, the same at 256 and 4096; the rotary write through it, the torch
    write's bits. And the GPU run's parity checks (`attention_parity`, `rope_parity`, slot and paged)
    pass at small fp32 shapes."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.llm_stage.triton_interpreted"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    fused = ("rope_float32", "rope_bfloat16", "rope_engine", "add_norm_float32", "add_norm_bfloat16")
    rope = {name: cases.pop(name) for name in fused}
    gpu_checks = cases.pop("gpu_checks")  # what a GPU run checks before the kernels serve, slot and paged
    assert gpu_checks["attention"]["ok"] and gpu_checks["rope"]["ok"], gpu_checks
    assert {name.startswith("paged/") for name in gpu_checks["attention"]["max_abs_err"]} == {True, False}
    assert gpu_checks["rope"]["paged"] == {"queries_equal": True, "keys_equal": True, "values_equal": True}
    paged, rope_paged = cases.pop("paged"), cases.pop("rope_paged")
    for name, case in paged.items():  # through a shuffled block table: SDPA over the same tokens, only they loaded
        assert case["max_abs_err"] < 1e-5 and case["torch_paged_err"] < 1e-5, (name, case)
        assert case["keys_loaded"] == case["values_loaded"] == case["cached_elements"], name
    assert paged["paged_bs16_short_256"]["keys_loaded"] == paged["paged_bs16_long_4096"]["keys_loaded"]
    assert rope_paged == {"queries_equal": True, "keys_equal": True, "values_equal": True, "keys_written": 14}
    for name, case in cases.items():
        assert case["max_abs_err"] < 1e-5, name
        assert case["keys_loaded"] == case["values_loaded"] == case["cached_elements"], name
    assert cases["short_cache_256"]["keys_loaded"] == cases["long_cache_4096"]["keys_loaded"]
    for dtype in ("rope_float32", "rope_bfloat16"):  # the fused rotation + cache write: the torch ops' bits
        assert rope[dtype]["queries_equal"] and rope[dtype]["keys_equal"] and rope[dtype]["values_equal"], rope
        assert rope[dtype]["keys_written"] == 14
    assert rope["rope_engine"] == {"same_tokens": True, "tokens": 9}  # both fused kernels on, fp32
    assert rope["add_norm_bfloat16"] == {"sums_equal": True, "normed_max_rel": 0.0, "normed_unequal_share": 0.0}
    assert rope["add_norm_float32"]["sums_equal"] and rope["add_norm_float32"]["normed_max_rel"] < 1e-6


def decoding_engine(max_seq_len: int, layout: str = "slot", **sched):
    engine = orpheus_engine(num_slots=6, max_seq_len=max_seq_len, cache={"layout": layout, "block_size": 16}, **sched)
    for i, text in enumerate(["one", "a second request", "three three three"]):
        engine.add_request(f"r{i}", text, None, {"max_tokens": 60, "seed": i})
    for _ in range(12):
        engine.step()
    return engine


class GatheredKV(TorchDispatchMode):
    """Bytes of KV the forward gathers out of the cache: `index_select` outputs of 4+ dims (a slot
    row's narrowed positions, or a paged row's blocks; the block table's rows are 2-D)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._opname == "index_select" and out.dim() >= 4:
            self.num_bytes += out.numel() * out.element_size()
        return out


def graph_path_work(engine) -> tuple[int, int, int]:
    """FLOPs of one decode forward on the path the graphs capture (padded batch, static forward),
    counted by torch's FlopCounterMode (SDPA on its math backend, whose matmuls it counts; it has
    no formula for the CPU flash kernel); the KV bytes it gathers; the tokens the rows have cached."""
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner._decode_forward, [4, 8], runner.padding_row, runner.device)
    plan = engine.scheduler.schedule()
    assert len(plan.decodes) == 3 and not plan.prefills
    batch = runner.prepare(plan).decode
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, GatheredKV() as gathered:
        runner.graphs.run_static(batch)
    return counter.get_total_flops(), gathered.num_bytes, sum(r.num_cached for r in plan.decodes)


@pytest.mark.parametrize("layout", ["slot", "paged"])
def test_decode_step_work_follows_the_cached_tokens_not_max_seq_len(layout):
    """FLOPs and gathered KV bytes the same at max_seq_len 256 and 4096 for the same rows (paged:
    blocks of 16, a row's last block read whole), and more with more tokens cached."""
    short, short_bytes, short_tokens = graph_path_work(decoding_engine(256, layout))
    long, long_bytes, long_tokens = graph_path_work(decoding_engine(4096, layout))
    assert short_tokens == long_tokens and short == long and short_bytes == long_bytes > 0
    engine = decoding_engine(256, layout)  # more tokens cached (past a block's end): more work
    for _ in range(17):
        engine.step()
    more, more_bytes, more_tokens = graph_path_work(engine)
    assert more_tokens > short_tokens and more > short and more_bytes > short_bytes


class ReadBacks(TorchDispatchMode):
    """Counts what would make the host wait for an accelerator: values read out of a tensor (item,
    int, bool, float: `_local_scalar_dense`) and ops whose output shape depends on the values (both
    `tests.graph_capture.waits_for_host`), and tolist / numpy (patched, they do not dispatch)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.count = 0
        self.active = False
        self.what: list[str] = []
        for name in ("tolist", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))

    def _counting(self, method, name):
        def wrapper(tensor, *args, **kwargs):
            if self.active:
                self.count += 1
                self.what.append(name)
            return method(tensor, *args, **kwargs)

        return wrapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if waits_for_host(func, args, kwargs):
            self.count += 1
            self.what.append(func._opname)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)


@pytest.fixture
def device_path(monkeypatch):
    """The engine as it runs on an accelerator, on CPU tensors: the torch sampler instead of numpy's,
    and decode attention at the captured graph's static length (the Triton kernel takes its
    lengths on the device; the CPU path would read the longest one back)."""
    monkeypatch.setattr(sampler_module, "_sample_plain", _as_on_a_gpu)
    monkeypatch.setattr(attention, "_capturing", lambda device: True)


def _as_on_a_gpu(logits, cand_ids, rows, vocab_size, table=None):
    """`sampler._sample_plain`'s accelerator branch."""
    return sampler_module.sample_on_device(logits, cand_ids, rows, vocab_size, table).tolist()


def test_a_decode_step_reads_back_from_the_device_once(device_path, monkeypatch):
    engine = orpheus_engine(num_slots=8)
    for i in range(5):  # Orpheus' defaults: temperature, top-p, repetition penalty; seeded and not
        engine.add_request(f"r{i}", f"request number {i}", None, {"max_tokens": 80, "seed": i if i % 2 else None})
    while engine.scheduler.waiting or any(r.num_cached < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()
    counter = ReadBacks(monkeypatch)
    for _ in range(10):
        before = counter.count
        with counter:
            outputs = engine.step()
        assert len(outputs) == 5
        assert counter.count - before == 1, counter.what[before:]


def run_engine(requests: dict[str, dict], max_seq_len: int = 1024) -> dict[str, list[int]]:
    engine = orpheus_engine(num_slots=6, max_seq_len=max_seq_len)
    for req_id, fields in requests.items():
        engine.add_request(req_id, fields.pop("text"), None, fields)
    return engine.run_to_completion()


def test_seeded_streams_draw_the_same_tokens_alone_in_a_batch_and_across_a_resume(device_path):
    seeded = {"text": "the seeded one", "max_tokens": 42, "seed": 11}
    alone = run_engine({"s": dict(seeded)})["s"]
    batched = run_engine({"a": {"text": "other words", "max_tokens": 30}, "s": dict(seeded),
                          "b": {"text": "more", "max_tokens": 50, "seed": 3}})["s"]  # fmt: skip
    assert alone == batched and len(alone) == 42
    first = orpheus_engine(num_slots=6)
    first.add_request("s", seeded["text"], None, {k: v for k, v in seeded.items() if k != "text"})
    drawn: list[int] = []
    while len(drawn) < 20:
        for out in first.step():
            drawn.extend(out.new_token_ids)
    second = orpheus_engine(num_slots=4)  # another replica (same weights), another batch
    second.add_request("x", "a stranger in the batch", None, {"max_tokens": 30})
    job = second.job("s", seeded["text"], None, {k: v for k, v in seeded.items() if k != "text"})
    second.add_job(dataclasses.replace(job, resume=ResumeState(tuple(drawn), 0, 0)))
    rest = second.run_to_completion()["s"]
    assert drawn + rest == alone


def staggered_tokens(engine) -> dict[str, list[int]]:
    """Requests arriving while others decode, so steps mix prompt chunks and decode rows."""
    texts = ["first words here", "a second, longer request to prefill", "three", "and a fourth one"]
    tokens: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        sampling = {"max_tokens": 30, "temperature": 0.0} if i % 2 else {"max_tokens": 30, "seed": i}
        engine.add_request(f"r{i}", text, None, sampling)
        for _ in range(3):
            for out in engine.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    for req_id, more in engine.run_to_completion().items():
        tokens.setdefault(req_id, []).extend(more)
    return tokens


def test_prompt_tokens_folded_into_the_decode_forward_give_the_same_tokens():
    """On CUDA a step's prompt tokens run as more one-position rows of the decode forward (one graph
    replay); the tokens equal the separate padded prompt forward's, eager and graph-padded."""
    reference = staggered_tokens(orpheus_engine(num_slots=6, prefill_token_budget=16))
    folded = orpheus_engine(num_slots=6, prefill_token_budget=16)
    folded.runner.fold_prefill = True
    assert staggered_tokens(folded) == reference
    padded = orpheus_engine(num_slots=6, prefill_token_budget=16)
    runner = padded.runner
    runner.fold_prefill = True
    runner.graphs = DecodeGraphs(runner._decode_forward, [4, 8, 16], runner.padding_row, runner.device)
    prepared = []
    original = runner.prepare
    runner.prepare = lambda plan: prepared.append(original(plan)) or prepared[-1]
    assert staggered_tokens(padded) == reference
    folded_steps = [p for p in prepared if p.folded_rows is not None]
    assert folded_steps and all(p.decode.input_ids.shape[0] in (4, 8, 16) for p in folded_steps)
    assert any(p.prefill is not None for p in prepared)  # a step past 16 rows: a separate prompt forward


def test_half_precision_rms_norm_is_transformers_own():
    """bf16 norms take the fused path (normalise in fp32, round, scale): transformers' numbers."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from llm_stage.models.llama import rms_norm

    norm = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    torch.testing.assert_close(rms_norm(norm, x), norm(x), rtol=0, atol=0)


def test_a_row_table_built_during_the_forward_draws_the_same_tokens(device_path, monkeypatch):
    """Async steps on an accelerator build the sampled rows' table while the forward runs (top-k
    filled in once the logits' width is known): the same tokens as tables built after the logits."""
    used: list[bool] = []
    original = sampler_module.sample_on_device

    def recording(logits, cand_ids, rows, vocab_size=None, table=None):
        used.append(table is not None)
        return original(logits, cand_ids, rows, vocab_size, table)

    monkeypatch.setattr(sampler_module, "sample_on_device", recording)
    runs, tables_used = {}, {}
    for prepared in (False, True):
        used.clear()
        engine = orpheus_engine(num_slots=4, async_steps=True)
        engine.prepares_row_tables = prepared
        for i, sampling in enumerate(({"seed": 5}, {"seed": 6, "top_k": 40}, {"temperature": 0.0})):
            engine.add_request(f"r{i}", f"request {i}", None, {"max_tokens": 30, **sampling})
        runs[prepared] = engine.run_to_completion()
        tables_used[prepared] = sum(used) / len(used)
        engine.close()
    assert runs[True] == runs[False]
    assert tables_used[False] == 0 and tables_used[True] == 1.0  # every draw of the async engine used its table
