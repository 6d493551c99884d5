"""`voxray plan`: how many replicas of each stage, and GPUs, for N concurrent streams at a TTFA SLO.

`calibration` reads measured stage costs (JSON under `calibrations/`), `workload` makes Poisson streams and
their chunks, `simulate` steps the LLM replicas, `predict` adds the detokenizer and scores playback,
`search` sizes a cluster and sweeps load. Pure numpy: no Ray, no torch tensors.
"""
