"""Codec adapters: the detokenizer side of each model family."""
