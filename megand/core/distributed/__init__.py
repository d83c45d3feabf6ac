"""Data-parallel gradient reduction and the layout's other gradient reductions."""

from megand.core.distributed.grads import all_reduce_data_parallel_grads, all_reduce_layout_grads
