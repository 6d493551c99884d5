"""The Serve cluster on the GPU machine: the wheels it lacks (`wheelhouse.py`, `make gpu-wheelhouse`) and
the runner that installs them there and starts `voxray serve` on one GPU (`cluster_run.sh`)."""
