"""The layout planner: a cost model of megand's step (compute, communication, the pipeline schedule,
memory) and a search over layouts for a homogeneous or heterogeneous cluster.

profile.py   device profiles (GEMM efficiency curve, bandwidths, collectives, overheads) and their file format
defaults.py  the shipped profiles of common GPUs, with their sources
cluster.py   the cluster file (groups of identical nodes)
simulate.py  the pipeline schedules replayed on per-stage forward/backward times
cost.py      the predicted step time and memory of one layout
layout.py    a candidate layout, its config overrides, and which link each of its process groups spans
search.py    the layouts worth running, homogeneous and heterogeneous; ``predict_config(cfg, cluster,
             world_size)`` predicts one given run (a composed training config)
hetero.py    the heterogeneous search: stages per group, dp, the schedule, the per-stage layer split
shares.py    replicas of different speeds: each data-parallel replica on one group, its micro-batches
             per step (``parallel.dp_microbatches``) water-filled by predicted speed
published.py published large-scale runs against the cost model (the table in docs/layout.md)
"""
