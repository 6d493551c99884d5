"""Shared leaf of every stage: config schemas, stage-to-stage messages, errors, the scheduling
policy and CUDA-graph capture. Imports nothing of VoxRay but `protos`."""
