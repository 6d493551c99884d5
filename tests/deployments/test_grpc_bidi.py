"""The gRPC bidi `SynthesizeStream` through the Router's own gRPC server: text pieces in while
audio streams out, the client's half-close ends it, and bad messages (text before config, config
twice, an oversized piece, an empty message, garbage bytes) answer INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from protos import voxray_pb2, voxray_pb2_grpc


def _config(**fields) -> voxray_pb2.SynthesizeStreamRequest:
    sampling = voxray_pb2.SamplingOptions(seed=4, max_tokens=14)
    return voxray_pb2.SynthesizeStreamRequest(config=voxray_pb2.SynthesizeRequest(sampling=sampling, **fields))


def _text(text: str) -> voxray_pb2.SynthesizeStreamRequest:
    return voxray_pb2.SynthesizeStreamRequest(text=text)


def _call(target: str, messages: list, timeout_s: float = 120.0) -> tuple[list, grpc.RpcError | None]:
    with grpc.insecure_channel(target) as channel:
        chunks = []
        try:
            for chunk in voxray_pb2_grpc.SpeechStub(channel).SynthesizeStream(iter(messages), timeout=timeout_s):
                chunks.append(chunk)
        except grpc.RpcError as err:
            return chunks, err
    return chunks, None


def test_text_streamed_in_gets_audio_out_and_half_close_ends_it(cluster):
    """Pieces arrive while audio is already flowing: the first segment's audio comes before the
    last piece is sent; half-close (no explicit end) finishes the stream with a final chunk."""
    target = cluster["tight"].grpc_target
    pieces: queue.Queue = queue.Queue()
    first_audio = threading.Event()

    def requests():
        yield _config(voice="tara", request_id="bidi-1")
        while (item := pieces.get()) is not None:
            yield item

    def feed():
        pieces.put(_text("Hello there. "))
        first_audio.wait(60)
        pieces.put(_text("How are you"))
        pieces.put(_text(" today?"))
        pieces.put(None)  # half-close

    feeder = threading.Thread(target=feed)
    feeder.start()
    chunks = []
    with grpc.insecure_channel(target) as channel:
        for chunk in voxray_pb2_grpc.SpeechStub(channel).SynthesizeStream(requests(), timeout=120):
            chunks.append(chunk)
            first_audio.set()
    feeder.join(timeout=10)
    assert chunks and chunks[-1].final and all(c.request_id == "bidi-1" for c in chunks)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum(len(c.audio) for c in chunks) > 0


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([_text("no config yet")], "config"),
        ([_config(), _config()], "config"),
        ([_config(), _text("x" * 5000)], "text"),  # over incremental.max_piece_chars (1000)
        ([_config(), voxray_pb2.SynthesizeStreamRequest()], "input"),
        ([], "config"),
    ],
    ids=["text-before-config", "config-twice", "oversized-piece", "empty-message", "no-messages"],
)
def test_bad_messages_are_invalid_argument_naming_the_field(cluster, messages, field):
    start = time.monotonic()
    _, err = _call(cluster["tight"].grpc_target, messages)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(f"{field}:"), err.details()
    assert time.monotonic() - start < 30


def test_garbage_bytes_are_invalid_argument_naming_request(cluster):
    with grpc.insecure_channel(cluster["tight"].grpc_target) as channel:
        call = channel.stream_stream("/voxray.Speech/SynthesizeStream")
        with pytest.raises(grpc.RpcError) as raised:
            list(call(iter([b"\xff\xfe garbage"]), timeout=60))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and raised.value.details().startswith("request:")
