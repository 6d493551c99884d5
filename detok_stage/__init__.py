"""Detokenizer stage: batched codec decoding of token chunks from many requests."""
