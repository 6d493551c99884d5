"""Entry points: the `voxray` CLI, server launcher, gRPC client, batch mode, in-process pipeline
and Serve YAML generation. The top layer: nothing else in VoxRay imports it."""
