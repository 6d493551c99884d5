"""CosyVoice 2 / S3Gen detokenizer: speech tokens (25 Hz) -> flow-matching mel (50 Hz) -> HiFT wave (24 kHz)."""
