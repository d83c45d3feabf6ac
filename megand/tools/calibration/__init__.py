"""Measuring a machine for the layout planner: GEMM rates, memory bandwidth, collectives, framework overheads."""
