"""Data-parallel engine (bucketed fp32 main-grad buffers, overlapped reduction) and the layout's other
gradient reductions. The schedule protocol is documented in data_parallel.py."""

from megand.core.distributed.config import DataParallelConfig
from megand.core.distributed.data_parallel import DataParallel, deferring_weight_grads, last_backward
from megand.core.distributed.grads import all_reduce_layout_grads, grad_of
