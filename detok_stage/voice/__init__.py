"""Zero-shot voice encoders: S3 speech tokenizer v2, CAM++ x-vector, and their audio front ends."""
