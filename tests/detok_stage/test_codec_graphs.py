"""The stateless transformers codecs (DAC, X-Codec) through the detokenizer's CUDA-graph path, on CPU
tensors: `decode_on_device` (what `ChunkGraphs` captures, and what `decode` runs) gives transformers'
`model.decode` audio and runs no op that waits for the host; `ChunkGraphs.build` decodes eagerly on a
CPU and, where graphs can run, captures them at every window length and batch size; and a stream
decoded through padded graph-shaped batches (a smaller group padded with copies of its first row,
shorter windows at their own lengths) gives eager's audio, DAC's receptive-field context included.
On a CUDA device the captured graphs give eager's audio."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import detok_stage.graphs as graphs_module
from core.config import DetokConfig, ModelConfig
from core.graphs import GraphCache
from detok_stage.codecs.dac_codec import RECEPTIVE_FIELD_FRAMES, DacCodec
from detok_stage.codecs.hf_codec import HFCodec
from detok_stage.codecs.snac_codec import SnacCodec
from detok_stage.codecs.xcodec_codec import XcodecCodec
from detok_stage.graphs import ChunkGraphs
from tests.detok_stage.interleaved import stream_interleaved
from tests.graph_capture import OpNames

HF_CODECS = {"dac": (DacCodec, "dia-tiny"), "xcodec": (XcodecCodec, "parallel-heads-tiny")}
CONTEXT = {"dac": RECEPTIVE_FIELD_FRAMES, "xcodec": 3}  # DAC's windows carry its receptive field each side


@functools.cache
def codec(name: str, device: str = "cpu") -> HFCodec:
    cls, model = HF_CODECS[name]
    return cls.build(ModelConfig(name=model, device=device), device)


def random_frames(adapter, count: int, length: int, seed: int) -> torch.Tensor:
    shape = (count, length, adapter.codes_per_frame)
    return torch.randint(0, adapter.codebook_size, shape, generator=torch.Generator().manual_seed(seed))


def schedule(name: str, **fields) -> DetokConfig:
    context = CONTEXT[name]
    return DetokConfig(first_chunk_frames=2, chunk_frames=4, left_context_frames=context, right_context_frames=context,
                       **fields)  # fmt: skip


@pytest.mark.parametrize("name", HF_CODECS)
@pytest.mark.parametrize(("count", "length"), [(1, 1), (3, 5), (2, 13), (4, 26)])
def test_decode_on_device_is_transformers_decode(name, count, length):
    adapter = codec(name)
    frames = random_frames(adapter, count, length, seed=count * 100 + length)
    with torch.inference_mode():
        want = adapter.model.decode(audio_codes=frames.transpose(1, 2)).audio_values.reshape(count, -1)
    on_device = adapter.decode_on_device(frames)
    assert on_device.shape == (count, length * adapter.samples_per_frame) and on_device.device == frames.device
    assert torch.equal(on_device, want)
    assert torch.equal(adapter.decode(frames), want.float())


@torch.inference_mode()
def test_the_capture_check_flags_reads_and_value_shaped_ops_not_static_ones():
    x, repeats = torch.tensor([0.0, 1.0, 2.0, 0.0]), torch.tensor([1, 2, 0, 1])
    for flagged in (lambda: x.sum().item(), x.nonzero, lambda: x[x > 0], lambda: x.repeat_interleave(repeats)):
        with OpNames() as ops:
            flagged()
        assert ops.host_waiting
    with OpNames() as ops:  # an int stride (SNAC's upsampling), or the output length given: no read-back
        x.repeat_interleave(2, dim=-1), x.repeat_interleave(repeats, output_size=4)
    assert "repeat_interleave" in ops.names and not ops.host_waiting


@pytest.mark.parametrize("name", [*HF_CODECS, "snac"])
def test_what_chunk_graphs_capture_runs_no_op_that_waits_for_the_host(name):
    """The captured function over a padded batch of a full window and of a short one: no scalar read, no
    op whose output shape depends on the codes (either would sync the stream or fail the capture)."""
    adapter = SnacCodec.build(ModelConfig()) if name == "snac" else codec(name)
    graphs = ChunkGraphs(adapter, 10, [4], "cpu")
    assert graphs.graphs.fn == adapter.decode_on_device
    for length in (10, 3):
        padded = graphs.pad(random_frames(adapter, 3, length, seed=length))
        with torch.inference_mode(), OpNames() as ops:
            audio = graphs.graphs.fn(padded)
        assert audio.shape == (4, length * adapter.samples_per_frame)
        assert "conv_transpose1d" in ops.names and not ops.host_waiting


def test_only_stateless_codecs_with_a_device_decode_capture_windows():
    from detok_stage.codecs.base import CodecAdapter

    class HostOnly(CodecAdapter):  # stateless, no `decode_on_device`
        def decode(self, frames):
            return frames

    class Stateful(HostOnly):
        is_stateful = True

        def decode_on_device(self, frames):
            return frames

    assert codec("dac").captures_windows and codec("xcodec").captures_windows
    assert not HostOnly().captures_windows and not Stateful().captures_windows


@pytest.mark.parametrize("name", HF_CODECS)
def test_chunk_graphs_decode_eagerly_on_a_cpu(name, caplog):
    assert ChunkGraphs.build(codec(name), schedule(name)) is None  # by default: no graphs off CUDA
    with caplog.at_level(logging.WARNING):
        assert ChunkGraphs.build(codec(name), schedule(name, cuda_graph_batch_sizes=(1, 2))) is None
    assert "CUDA graphs requested on cpu" in caplog.text


@pytest.mark.parametrize("name", HF_CODECS)
def test_chunk_graphs_capture_every_window_length_where_graphs_run(name, monkeypatch):
    """With graphs available, `build` captures `decode_on_device` at every (window length, batch size)."""
    captured: list[tuple[object, tuple[int, ...]]] = []

    def capture(self, inputs):
        captured.append((self.fn, tuple(inputs[0].shape)))
        return False  # (nothing can be captured on a CPU)

    monkeypatch.setattr(graphs_module, "graphs_available", lambda device: True)
    monkeypatch.setattr(GraphCache, "capture", capture)
    adapter, config = codec(name), schedule(name, cuda_graph_batch_sizes=(1, 2))
    graphs = ChunkGraphs.build(adapter, config)
    window = 2 * CONTEXT[name] + 4
    assert graphs is not None and graphs.window_frames == window
    assert all(fn == adapter.decode_on_device for fn, _ in captured)
    want = {(size, length, adapter.codes_per_frame) for length in range(1, window + 1) for size in (1, 2)}
    assert len(captured) == len(want) and {shape for _, shape in captured} == want


class Replayed:
    """What captured graphs return for a padded batch: the captured function on it (shapes recorded)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, padded: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(padded.shape))
        return self.fn(padded)


@pytest.mark.parametrize("name", HF_CODECS)
def test_streams_through_padded_graph_batches_give_eagers_audio(name):
    """Several streams' chunks (first chunks, steady ones, ends: windows of several lengths) decoded as
    graphs would, padded to captured sizes, give the eager engine's audio within one PCM16 step."""
    adapter, config = codec(name), schedule(name)
    window = 2 * CONTEXT[name] + 4
    graphs = ChunkGraphs(adapter, window, [2, 4], "cpu")
    graphs.graphs = replayed = Replayed(adapter.decode_on_device)
    streams = [random_frames(adapter, 1, length, seed=length)[0] for length in (1, 11, 23, 23, 23)]
    by_req = {f"r{i}": frames for i, frames in enumerate(streams)}
    through_graphs = list(stream_interleaved(adapter, by_req, config, graphs, frames_per_push=3).values())
    eager = list(stream_interleaved(adapter, by_req, config, None, frames_per_push=3).values())
    assert {shape[0] for shape in replayed.shapes} == {2, 4} and len({shape[1] for shape in replayed.shapes}) > 2
    for frames, got, want in zip(streams, through_graphs, eager, strict=True):
        assert got.shape == want.shape == (len(frames) * adapter.samples_per_frame,)
        torch.testing.assert_close(got, want, atol=1.5 / 32767, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", HF_CODECS)
def test_captured_codec_graphs_give_eagers_audio_on_cuda(name):
    adapter = codec(name, "cuda")
    graphs = ChunkGraphs(adapter, 6, [1, 2, 4], "cuda")
    assert graphs.capture_all() == 6 * 3
    for count, length in [(1, 6), (3, 6), (4, 2), (2, 1)]:
        frames = random_frames(adapter, count, length, seed=count + length)
        replayed = graphs.run(frames)
        assert replayed is not None and replayed.shape == (count, length * adapter.samples_per_frame)
        torch.testing.assert_close(replayed, adapter.decode(frames), atol=1e-4, rtol=1e-3)
