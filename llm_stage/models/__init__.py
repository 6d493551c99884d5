"""LM adapters: one per model family (prompt framing, backbone, logits head, stop ids)."""
