"""The pipeline schedules megand runs, one file each (its order and its :class:`PipelineSchedule`
record). A new schedule is a new file here and one entry in :data:`SCHEDULES`, in the order the docs
and the messages list them."""

from megand.core.pipeline_parallel.orders import dualpipev, one_f_one_b, zb1p, zbv

SCHEDULES = (one_f_one_b.SCHEDULE, zb1p.SCHEDULE, zbv.SCHEDULE, dualpipev.SCHEDULE)
