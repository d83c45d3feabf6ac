"""Pipeline parallelism: stage construction (layout.py), p2p communication (p2p.py), the schedules as
records (record.py; one file per schedule under orders/, looked up in registry.py), their action lists
per rank (actions.py) and the executor (schedules.py)."""

from megand.core.pipeline_parallel.actions import Action, Placement, interleaved_placement, schedule_actions
from megand.core.pipeline_parallel.schedules import (
    ScheduleStats,
    forward_backward_fill_drain,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_schedule,
    pipelined,
    run_actions,
)
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE, schedule_names, schedule_record
