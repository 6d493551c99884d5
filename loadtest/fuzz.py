"""Fuzz a running VoxRay server over both protocols, then check it is healthy and idle.

    python -m loadtest.fuzz --requests 10000 --rate 20     # against `voxray serve` (default ports)

Sends random requests at a bounded rate: gRPC messages with random fields (unicode, sizes,
enum values, NaN / inf), malformed bytes (garbage, truncated, bit-flipped, unknown fields),
streams abandoned after the first chunk, bidi SynthesizeStream calls (a config, then random
text / flush / end / garbage messages) and ListModels / ListVoices with random bytes; HTTP
bodies of random JSON, wrong types, lone surrogates, deep nesting, oversized bodies, bad or
repeated X-Request-Id headers, wrong content types. Counts answers by protocol and status; a
gRPC UNKNOWN / INTERNAL or an HTTP 5xx or dropped connection is a failure. Afterwards one valid
request per protocol must succeed and (with `--ray-address`) the LLM and detokenizer stages
must hold no request within 5 s.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from protos import voxray_pb2

VALID_SHARE = 0.15  # well-formed requests among the random ones
BAD_GRPC = {"UNKNOWN", "INTERNAL", "DATA_LOSS", "UNIMPLEMENTED"}
WORDS = ["hello", "the", "quick", "voice", "ça", "日本語", "😀", "zero\u200bwidth", "tab\there", "line\nbreak"]
ODD_CHARS = ["\x00", "\r\n", "\x1b", "\ud800", "\udfff", "\u2028", "\ufeff", "€", "\x7f", "\u0085"]
SAMPLING_KEYS = [
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_tokens", "seed", "guidance_scale",
    "ras_window", "ras_tau", "exaggeration",
]  # fmt: skip
HTTP_KEYS = ["model", "voice", "response_format", "stream", "speed", "request_id"]
ODD_NUMBERS = [0, -1, 1, 7, 1e9, -1e9, 2**31, 2**63, 0.5, 1e-30, True, False, None, "1", [1], {"a": 1}]


class Fuzzer:
    """Random request makers for both protocols, from one seeded generator per request."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def text(self, rng: random.Random) -> str:
        pick = rng.random()
        if pick < 0.05:
            return ""
        if pick < 0.1:
            return "x" * rng.choice([3999, 4000, 4001, 20000])
        parts = [rng.choice(WORDS) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.3:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(ODD_CHARS))
        return " ".join(parts)

    def request_id(self, rng: random.Random) -> str:
        return rng.choice(["", f"fz-{rng.getrandbits(32):x}", "r-€-1", "a\r\nb", "sp ace", "x" * 200, "\x00"])

    def number(self, rng: random.Random) -> object:
        return rng.choice(ODD_NUMBERS + [rng.uniform(-2, 2), float("nan"), float("inf")])

    def valid_proto(self, rng: random.Random) -> voxray_pb2.SynthesizeRequest:
        """A well-formed request (short): streams that run, finish or are abandoned mid-way."""
        text = " ".join(rng.choice(WORDS[:7]) for _ in range(rng.randint(1, 8)))
        sampling = voxray_pb2.SamplingOptions(max_tokens=rng.choice([7, 14, 70]), seed=rng.randrange(1000))
        return voxray_pb2.SynthesizeRequest(text=text, voice=rng.choice(["", "tara", "leah"]), sampling=sampling)

    def proto_request(self, rng: random.Random) -> voxray_pb2.SynthesizeRequest:
        sampling = voxray_pb2.SamplingOptions()
        for key in rng.sample(SAMPLING_KEYS, rng.randint(0, 3)):
            kind = voxray_pb2.SamplingOptions.DESCRIPTOR.fields_by_name[key].cpp_type
            value = rng.choice([0, -1, 1, 7, 10**6]) if kind != 6 else rng.choice([0.0, -1.0, 0.5, 1e30, float("nan")])
            setattr(sampling, key, value)
        if rng.random() < 0.8:  # mostly short: a default-length stream costs seconds of a 2-core box
            sampling.max_tokens = rng.choice([7, 14])
        text = self.text(rng).encode("utf-8", "replace").decode("utf-8")  # proto strings are UTF-8
        return voxray_pb2.SynthesizeRequest(
            text=text, model=rng.choice(["", "", "orpheus-tiny", "nope"]), voice=rng.choice(["", "", "tara", "x"]),
            sampling=sampling, format=rng.choice([0, 1, 2, 7, -1]), sample_rate_hz=rng.choice([0, 0, 24000, 8000]),
            ttfa_deadline_s=rng.choice([0.0, 0.0, 2.0, -1.0, float("nan"), float("inf"), 1e9]),
            request_id=self.request_id(rng).encode("utf-8", "replace").decode("utf-8"),
        )  # fmt: skip

    def grpc_payload(self, rng: random.Random) -> bytes:
        if rng.random() < VALID_SHARE:
            return self.valid_proto(rng).SerializeToString()
        raw = self.proto_request(rng).SerializeToString()
        mutation = rng.random()
        if mutation < 0.15:
            return rng.randbytes(rng.randint(0, 64))
        if mutation < 0.25 and raw:
            return raw[: rng.randrange(len(raw))]
        if mutation < 0.35 and raw:
            flipped = bytearray(raw)
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            return bytes(flipped)
        if mutation < 0.4:
            return raw + b"\xa0\x06\x01"  # unknown field 100
        return raw

    def stream_messages(self, rng: random.Random) -> list[bytes]:
        """A bidi SynthesizeStream call's messages: mostly a config first, then pieces."""
        messages: list[bytes] = []
        if rng.random() < 0.85:
            config = self.valid_proto(rng) if rng.random() < 0.5 else self.proto_request(rng)
            messages.append(voxray_pb2.SynthesizeStreamRequest(config=config).SerializeToString())
        for _ in range(rng.randint(0, 4)):
            pick = rng.random()
            if pick < 0.5:
                text = self.text(rng).encode("utf-8", "replace").decode("utf-8")
                piece = voxray_pb2.SynthesizeStreamRequest(text=text)
            elif pick < 0.65:
                piece = voxray_pb2.SynthesizeStreamRequest(flush=True)
            elif pick < 0.8:
                piece = voxray_pb2.SynthesizeStreamRequest(end=True)
            else:
                messages.append(rng.randbytes(rng.randint(0, 32)))
                continue
            messages.append(piece.SerializeToString())
        return messages

    def json_body(self, rng: random.Random) -> dict:
        body: dict = {"input": self.text(rng) if rng.random() < 0.85 else self.number(rng)}
        for key in rng.sample(
            ["model", "voice", "response_format", "stream", "speed", "request_id"], rng.randint(0, 3)
        ):
            body[key] = rng.choice([self.number(rng), "wav", "pcm", "mp3", self.request_id(rng), "tara"])
        keys = rng.sample(SAMPLING_KEYS + ["colour"], rng.randint(0, 3)) if rng.random() < 0.5 else []
        body["sampling"] = {key: self.number(rng) for key in keys}
        if rng.random() < 0.8:
            body["sampling"]["max_tokens"] = rng.choice([7, 14])
        if rng.random() < 0.05:
            body[rng.choice(["colour", "", "\ud800"])] = 1
        return body

    def http_request(self, rng: random.Random) -> tuple[bytes, list[tuple[str, bytes]]]:
        """(body, headers) of one POST /v1/audio/speech."""
        headers = [("content-type", b"application/json")]
        pick = rng.random()
        if pick < VALID_SHARE:
            valid = self.valid_proto(rng)
            body = {"input": valid.text, "response_format": rng.choice(["wav", "pcm"]), "voice": valid.voice or "tara"}
            return json.dumps({**body, "sampling": {"max_tokens": valid.sampling.max_tokens}}).encode(), headers
        if pick < VALID_SHARE + 0.08:
            body = rng.randbytes(rng.randint(0, 200))
        elif pick < VALID_SHARE + 0.12:
            depth = rng.choice([50, 900, 5000])
            body = b'{"input": ' + b"[" * depth + b"]" * depth + b"}"
        elif pick < VALID_SHARE + 0.14:
            body = b'{"input": "' + b"a" * 70_000 + b'"}'
        else:
            body = json.dumps(self.json_body(rng), allow_nan=True).encode("utf-8", "surrogatepass")
        roll = rng.random()
        if roll < 0.05:
            headers = [("content-type", rng.choice([b"text/plain", b"", b"application/json; charset=latin-1"]))]
        elif roll < 0.15:
            headers.append(("x-request-id", rng.choice([b"ok-1", "r-€-1".encode(), b"a b", b"x" * 300])))
        elif roll < 0.2:
            headers += [("x-request-id", b"one"), ("x-request-id", b"two")]
        return body, headers


def grpc_once(
    channel: grpc.Channel, app: str, payload: bytes, rng: random.Random, key: str | None, cancel_share: float = 0.3
) -> str:
    call = channel.unary_stream(
        "/voxray.Speech/Synthesize", request_serializer=None, response_deserializer=voxray_pb2.AudioChunk.FromString
    )
    meta = [("application", app)] + ([("authorization", f"Bearer {key}")] if key else [])
    stream = call(payload, metadata=meta, timeout=60)
    try:
        for _ in stream:
            if rng.random() < cancel_share:  # a client that goes away after a chunk
                stream.cancel()
                return "OK(cancelled)"
        return "OK"
    except grpc.RpcError as err:
        return "OK(cancelled)" if err.code() == grpc.StatusCode.CANCELLED else err.code().name


def grpc_stream_once(channel: grpc.Channel, app: str, messages: list[bytes], key: str | None) -> str:
    """A bidi SynthesizeStream call sending `messages`, then half-closing."""
    call = channel.stream_stream(
        "/voxray.Speech/SynthesizeStream", request_serializer=None,
        response_deserializer=voxray_pb2.AudioChunk.FromString,
    )  # fmt: skip
    meta = [("application", app)] + ([("authorization", f"Bearer {key}")] if key else [])
    try:
        for _ in call(iter(messages), metadata=meta, timeout=60):
            pass
        return "OK"
    except grpc.RpcError as err:
        return err.code().name


def grpc_unary_once(channel: grpc.Channel, app: str, method: str, payload: bytes, key: str | None) -> str:
    call = channel.unary_unary(f"/voxray.Speech/{method}", request_serializer=None, response_deserializer=None)
    meta = [("application", app)] + ([("authorization", f"Bearer {key}")] if key else [])
    try:
        call(payload, metadata=meta, timeout=30)
        return "OK"
    except grpc.RpcError as err:
        return err.code().name


def http_once(host: str, port: int, body: bytes, headers: list[tuple[str, bytes]], key: str | None) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/audio/speech")
        for name, value in [*headers, ("content-length", str(len(body)).encode())]:
            conn.putheader(name, value)
        if key:
            conn.putheader("authorization", f"Bearer {key}")
        conn.endheaders(body)
        reply = conn.getresponse()
        reply.read()
        return str(reply.status)
    except (OSError, http.client.HTTPException) as err:
        return f"conn:{type(err).__name__}"
    finally:
        conn.close()


def is_failure(protocol: str, status: str) -> bool:
    if protocol.startswith("grpc"):
        return status in BAD_GRPC
    return not status.isdigit() or int(status) >= 500


def run(args: argparse.Namespace) -> dict:
    fuzzer = Fuzzer(args.seed)
    host, port = args.http.rsplit(":", 1)
    counts: Counter = Counter()
    lock = threading.Lock()
    channel = grpc.insecure_channel(args.grpc)

    def one(i: int) -> None:
        rng = random.Random(args.seed * 1_000_003 + i)
        pick = rng.random()
        if pick < 0.4:
            status = grpc_once(channel, args.app, fuzzer.grpc_payload(rng), rng, args.key)
            protocol = "grpc"
        elif pick < 0.47:
            status, protocol = grpc_stream_once(channel, args.app, fuzzer.stream_messages(rng), args.key), "grpc-bidi"
        elif pick < 0.5:
            method, payload = rng.choice(["ListModels", "ListVoices"]), rng.randbytes(rng.randint(0, 16))
            status, protocol = grpc_unary_once(channel, args.app, method, payload, args.key), "grpc-list"
        else:
            body, headers = fuzzer.http_request(rng)
            status, protocol = http_once(host, int(port), body, headers, args.key), "http"
        with lock:
            counts[(protocol, status)] += 1

    start = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for i in range(args.requests):
            delay = start + i / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i)
            if args.time_limit_s and time.monotonic() - start > args.time_limit_s:
                break
    sent_s = time.monotonic() - start
    channel.close()
    return {"counts": counts, "sent": sum(counts.values()), "wall_s": sent_s}


def health(args: argparse.Namespace) -> dict:
    """One valid request per protocol, and (with a Ray address) both stages idle within 5 s."""
    host, port = args.http.rsplit(":", 1)
    body = json.dumps({"input": "still healthy", "response_format": "pcm", "sampling": {"max_tokens": 14}}).encode()
    http_status = http_once(host, int(port), body, [("content-type", b"application/json")], args.key)
    with grpc.insecure_channel(args.grpc) as channel:
        request = voxray_pb2.SynthesizeRequest(text="still healthy", sampling=voxray_pb2.SamplingOptions(max_tokens=14))
        grpc_status = grpc_once(channel, args.app, request.SerializeToString(), random.Random(1), args.key, 0.0)
    report = {"http": http_status, "grpc": grpc_status}
    if args.ray_address:
        report["idle"] = stages_idle(args.ray_address, args.app)
    return report


def stages_idle(address: str, app: str, wait_s: float = 5.0) -> dict:
    import ray
    from ray import serve

    from cluster.ray_loopback import loopback_init_kwargs

    host = address.rsplit(":", 1)[0]
    # an embedded loopback-only Ray (`voxray serve`): join it on 127.0.0.1, as Ray would rewrite the address
    extra = loopback_init_kwargs() if host in ("127.0.0.1", "localhost") else {}
    ray.init(address=address, logging_level="ERROR", log_to_driver=False, **extra)
    llm, detok = serve.get_deployment_handle("LLMStage", app), serve.get_deployment_handle("DetokStage", app)
    deadline = time.monotonic() + wait_s
    while True:
        llm_stats, detok_stats = llm.stats.remote().result(), detok.stats.remote().result()
        state = {
            "kv_slots_used": llm_stats["kv_slots_used"],
            "engine_requests": llm_stats["engine_requests"],
            "detok_queued_chunks": detok_stats["queued_chunks"],
        }
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc", default="127.0.0.1:9000")
    parser.add_argument("--http", default="127.0.0.1:8000", help="host:port of the HTTP proxy")
    parser.add_argument("--app", default="voxray")
    parser.add_argument("--key", default=None, help="API key to send (servers with auth.api_keys_file)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=20.0, help="requests started per second (bounded rate)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    parser.add_argument("--time-limit-s", type=float, default=0.0, help="stop sending after this long (0 = none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-address", default=None, help="e.g. 'auto': also check both stages are idle after")
    args = parser.parse_args(argv)
    result = run(args)
    failures = {f"{p}:{s}": n for (p, s), n in result["counts"].items() if is_failure(p, s)}
    print(f"sent {result['sent']} requests in {result['wall_s']:.0f} s")
    for (protocol, status), n in sorted(result["counts"].items()):
        print(f"  {protocol:9s} {status:22s} {n}")
    print(f"failures: {failures or 'none'}", flush=True)  # before the health check, which may hang
    report = health(args)
    print(f"after: {report}")
    idle = report.get("idle")
    healthy = report["http"] == "200" and report["grpc"] == "OK" and not (idle and any(idle.values()))
    return 0 if healthy and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
