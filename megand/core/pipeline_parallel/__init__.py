"""Pipeline parallelism: stage construction (layout.py), p2p communication (p2p.py), the schedules as
action lists per rank (actions.py) and their executor (schedules.py)."""

from megand.core.pipeline_parallel.actions import Action, Placement, interleaved_placement, schedule_actions
from megand.core.pipeline_parallel.schedules import (
    ScheduleStats,
    forward_backward_fill_drain,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_schedule,
    run_actions,
)
