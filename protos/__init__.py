"""gRPC API of VoxRay: `voxray.proto` and its generated stubs (`voxray_pb2*.py`).

Regenerate with `python -m protos.generate`; tests fail if the committed stubs drift.
"""
