"""Pipeline parallelism: stage construction, p2p communication and schedules."""

from megand.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_schedule
