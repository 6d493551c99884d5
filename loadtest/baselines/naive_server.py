"""Naive baseline: one transformers `generate()` per request (no batching across requests) with
per-request SNAC decoding (Orpheus' reference 4-frame window), behind the `voxray.Speech` API.

Runs in the project venv on the exported orpheus-tiny weights; one thread pair per stream.
Usage: python -m loadtest.baselines.naive_server --weights build/loadtest-weights --port 19130
"""

from __future__ import annotations

import argparse
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from loadtest.baselines.common import (
    Job,
    ListingServicer,
    ReferenceDecoder,
    audio_chunk,
    audio_token_ids,
    job_from_request,
    load_snac_dir,
)  # fmt: skip
from protos import voxray_pb2_grpc


class AudioOnly(LogitsProcessor):
    """The same static audio-id mask the vLLM baseline applies (`allowed_token_ids`)."""

    def __init__(self, vocab_size: int) -> None:
        self.bias = torch.full((vocab_size,), float("-inf"))
        self.bias[audio_token_ids()] = 0.0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.bias[: scores.shape[-1]]


class TokenQueue(BaseStreamer):
    """generate() pushes the prompt once, then each new token; None marks the end."""

    def __init__(self) -> None:
        self.tokens: queue.Queue[int | None] = queue.Queue()
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        for token in value.flatten().tolist():
            self.tokens.put(int(token))

    def end(self) -> None:
        self.tokens.put(None)


class NaiveSpeech(ListingServicer):
    description = "baseline: transformers generate() + per-request SNAC (reference 4-frame window)"

    def __init__(self, model: LlamaForCausalLM, snac) -> None:
        self.model = model
        self.snac = snac
        self.mask = LogitsProcessorList([AudioOnly(model.config.vocab_size)])

    def _generate(self, job: Job, streamer: TokenQueue) -> None:
        try:
            with torch.inference_mode():
                self.model.generate(
                    torch.tensor([job.prompt_ids]), do_sample=True, temperature=job.temperature, top_p=job.top_p,
                    repetition_penalty=job.repetition_penalty, max_new_tokens=job.max_tokens,
                    min_new_tokens=job.max_tokens, logits_processor=self.mask, streamer=streamer,
                )  # fmt: skip
        finally:
            streamer.end()

    def Synthesize(self, request, context):  # noqa: N802 (gRPC method name)
        start = time.perf_counter()
        job = job_from_request(request)
        streamer, decoder, seq = TokenQueue(), ReferenceDecoder(self.snac), 0
        threading.Thread(target=self._generate, args=(job, streamer), daemon=True).start()
        while (token := streamer.tokens.get(timeout=600)) is not None:
            pcm = decoder.push(token)
            if pcm is not None:
                yield audio_chunk(job.req_id, seq, pcm, start)
                seq += 1
        yield audio_chunk(job.req_id, seq, b"", start, is_final=True)


def serve(args: argparse.Namespace) -> None:
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model = LlamaForCausalLM.from_pretrained(str(args.weights / "lm"), dtype=torch.float32, local_files_only=True)
    servicer = NaiveSpeech(model.eval(), load_snac_dir(args.weights / "snac"))
    server = grpc.server(ThreadPoolExecutor(max_workers=args.max_streams))
    voxray_pb2_grpc.add_SpeechServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"READY 127.0.0.1:{args.port} naive baseline", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2.0).wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, default=Path("build/loadtest-weights"))
    p.add_argument("--port", type=int, default=19130)
    p.add_argument("--max-streams", type=int, default=32, help="gRPC worker threads (concurrent streams)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    serve(p.parse_args(argv))


if __name__ == "__main__":
    main()
