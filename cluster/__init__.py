"""Cluster runtime: config schema, model registry, in-process pipeline and the `voxray` CLI."""
