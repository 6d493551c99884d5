"""LLM stage: continuous-batching engine (scheduler, KV slots, runner, sampler, model adapters)."""
