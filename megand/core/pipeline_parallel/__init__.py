"""Pipeline parallelism: stage construction (layout.py), p2p communication (p2p.py) and schedules (schedules.py)."""

from megand.core.pipeline_parallel.schedules import (
    ScheduleStats,
    forward_backward_fill_drain,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_schedule,
)
