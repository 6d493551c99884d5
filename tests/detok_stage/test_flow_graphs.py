"""The S3Gen flow's streamed chunk on the path its CUDA graphs capture: requests padded to a captured
size with scratch rows, keys padded to a power of two, position spans fixed by the shapes. On a CPU
that padded forward runs eagerly; its audio is the unpadded forward's, and nothing in it waits for
the host. On CUDA (`-m gpu`) the replayed graphs give eager's audio."""

from __future__ import annotations

import pytest
import torch

from core.config import DetokConfig
from core.graphs import GraphCache
from detok_stage.codecs.s3gen_codec import S3GenCodec
from detok_stage.flow.config import tiny_s3gen_config
from detok_stage.flow.flow_graphs import MAX_KEY_TOKENS, MIN_KEY_TOKENS, key_bucket
from detok_stage.flow.model import S3Gen
from detok_stage.graphs import ChunkGraphs
from tests.detok_stage.test_s3gen_streaming import chunks_of, tokens
from tests.graph_capture import OpNames

SIZES = (2, 4)


def new_codec(device: str = "cpu", graphs: bool = False, window: tuple[int, int] | None = None) -> S3GenCodec:
    """`window`: (sink, window) frames of a bounded estimator history."""
    codec = S3GenCodec(S3Gen.seeded(tiny_s3gen_config(), 4), device)
    if window is not None:
        codec.bound_flow_history(*window)
    if graphs:
        assert codec.enable_graphs(SIZES)
    return codec


def interleaved(codec: S3GenCodec, streams: dict[str, list]) -> dict[str, torch.Tensor]:
    """Each round hands the codec the next chunk of every stream still going: batches of 3, 2, 1."""
    audio: dict[str, list[torch.Tensor]] = {rid: [] for rid in streams}
    for index in range(max(len(c) for c in streams.values())):
        batch = [chunks[index] for chunks in streams.values() if index < len(chunks)]
        for chunk, wave in zip(batch, codec.decode_stream(batch), strict=True):
            audio[chunk.req_id].append(wave)
    return {rid: torch.cat(waves) for rid, waves in audio.items()}


def streams(prefix: str) -> dict[str, list]:
    return {f"{prefix}{i}": chunks_of(f"{prefix}{i}", tokens(n, 40 + i), 4, 4) for i, n in enumerate((30, 21, 13))}


def test_key_buckets_are_powers_of_two_from_64():
    assert [key_bucket(n) for n in (1, 64, 65, 200, MAX_KEY_TOKENS)] == [64, 64, 128, 256, MAX_KEY_TOKENS]
    assert key_bucket(MAX_KEY_TOKENS + 1) is None


@pytest.mark.parametrize("window", [None, (4, 8)], ids=["whole history", "bounded history"])
def test_the_padded_path_gives_the_eager_audio(window):
    """Three streams of different lengths, batched 3 / 2 / 1 (padded to 4 and 2 with scratch rows),
    keys padded to 64 tokens: the audio of each stream is eager's within float summation order, with
    the estimator reading every earlier frame or a bounded history (its keys one shape at any length)."""
    padded, eager = new_codec(graphs=True, window=window), new_codec(window=window)
    got, want = interleaved(padded, streams("p")), interleaved(eager, streams("p"))
    graphs = padded.model.flow.graphs
    assert graphs is not None and graphs.num_runs > 5  # every whole-chunk round after the first
    for rid, wave in want.items():
        assert got[rid].shape == wave.shape
        torch.testing.assert_close(got[rid], wave, atol=1e-4, rtol=0)


def test_padding_rows_leave_the_requests_slots_alone():
    """A lone stream padded to 2 rows, then a second stream: each equals its eager decode (the scratch
    slot's writes never reach a request's keys or conv inputs)."""
    padded, eager = new_codec(graphs=True), new_codec()
    for prefix in ("a", "b"):
        one = {prefix: chunks_of(prefix, tokens(26, ord(prefix)), 4, 4)}
        torch.testing.assert_close(interleaved(padded, one)[prefix], interleaved(eager, one)[prefix], atol=1e-4, rtol=0)
    assert len(padded.model.flow.slots.open_slots) == 1  # the scratch slot only


def test_the_padded_round_waits_for_nothing_on_the_host():
    codec = new_codec(graphs=True)
    flow = codec.model.flow
    states = [flow.new_state(codec.default_voice, codec.n_timesteps) for _ in range(3)]
    for s in states:
        s.tokens += list(range(20))
        s.slot.hold(4)
    flow.advance(states, 4)  # the first round makes the pools
    graphs = flow.graphs
    for s in states:
        s.slot.hold(s.tokens_done + 4)
    graphs._prepare_scratch(flow, 4)
    inputs, _ = flow.round_inputs(states + [graphs.scratch], 4, key_bucket(8))
    with OpNames() as ops, torch.inference_mode():
        flow.round(*inputs, n_timesteps=codec.n_timesteps)
    assert not ops.host_waiting, ops.host_waiting


def test_the_engine_turns_the_codecs_graphs_on_only_where_graphs_run(monkeypatch):
    codec = new_codec()
    assert ChunkGraphs.build(codec, DetokConfig(cuda_graph_batch_sizes=SIZES)) is None
    assert codec.model.flow.graphs is None  # on a CPU: eager
    monkeypatch.setattr("detok_stage.graphs.graphs_available", lambda device: True)
    assert ChunkGraphs.build(codec, DetokConfig(cuda_graph_batch_sizes=SIZES)) is None
    assert codec.model.flow.graphs is not None and codec.model.flow.graphs.sizes == list(SIZES)


def test_every_size_is_captured_before_serving_on_scratch_rows_only(monkeypatch):
    """Where graphs run, `enable_graphs` makes the pools with one scratch round, then captures every size
    at the smallest key bucket; no request's slot is touched, and a stream decoded after it is exact."""
    shapes: list[tuple[int, int]] = []

    def capture(self, inputs):
        shapes.append((inputs[0].shape[0], inputs[6].shape[1]))  # (rows, token keys) of the round
        return False  # (nothing can be captured on a CPU)

    monkeypatch.setattr("detok_stage.flow.flow_graphs.graphs_available", lambda device: True)
    monkeypatch.setattr(GraphCache, "capture", capture)
    codec = new_codec(graphs=True)
    assert shapes == [(size, MIN_KEY_TOKENS) for size in SIZES]
    flow = codec.model.flow
    assert flow.slots.kv and flow.slots.open_slots == {flow.graphs.scratch.slot.id}
    monkeypatch.undo()
    flow.graphs = None  # eager from here: the stream's audio must not carry the captures' writes
    one = {"s": chunks_of("s", tokens(13, 5), 4, 4)}
    torch.testing.assert_close(interleaved(codec, one)["s"], interleaved(new_codec(), one)["s"], atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_flow_graphs_give_eagers_audio_on_cuda():
    graphed, eager = new_codec("cuda", graphs=True), new_codec("cuda")
    got, want = interleaved(graphed, streams("g")), interleaved(eager, streams("g"))
    assert graphed.model.flow.graphs.graphs.num_captured > 0 and graphed.model.flow.graphs.num_runs > 5
    for rid, wave in want.items():
        torch.testing.assert_close(got[rid], wave, atol=1e-3, rtol=0)
