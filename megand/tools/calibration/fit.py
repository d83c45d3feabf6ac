"""The fitting math of the calibration: alpha-beta lines for collectives, fixed overheads for training steps.

Pure numpy, so it is unit-tested on synthetic timings.
"""

from __future__ import annotations

import itertools
import statistics

import numpy as np

# NCCL-tests bus-bandwidth factors: the fraction of the buffer each rank sends over its link
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "p2p": lambda n: 1.0,
}


def bus_factor(op: str, n: int) -> float:
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(BUS_FACTORS)}")
    return BUS_FACTORS[op](n)


def nonnegative_lstsq(columns: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Least squares ``columns @ x ~ y`` with every ``x >= 0``: the best of the unconstrained fits over each
    subset of the columns whose solution is nonnegative (exact for the few unknowns fitted here)."""
    columns, y = np.asarray(columns, dtype=float), np.asarray(y, dtype=float)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float)
    a, b = columns * w[:, None], y * w
    best, best_err = np.zeros(columns.shape[1]), float(np.sum(b ** 2))
    for size in range(1, columns.shape[1] + 1):
        for subset in itertools.combinations(range(columns.shape[1]), size):
            sol, *_ = np.linalg.lstsq(a[:, subset], b, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((a[:, subset] @ sol - b) ** 2))
            if err < best_err - 1e-18:
                best, best_err = np.zeros(columns.shape[1]), err
                best[list(subset)] = sol
    return best


def fit_alpha_beta(op: str, n: int, nbytes, seconds) -> dict:
    """``time = alpha_s + bus_factor(op, n) * bytes / (gbps * 1e9)`` fitted to measured (bytes, seconds).

    The fit minimises relative errors (each point weighted by 1/time), so the small messages that fix
    alpha count as much as the large ones that fix the bandwidth; alpha and 1/gbps are kept >= 0."""
    nbytes, seconds = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(nbytes) < 2 or len(set(nbytes.tolist())) < 2:
        raise ValueError(f"{op}: an alpha-beta fit needs at least two message sizes, got {nbytes.tolist()}")
    x = bus_factor(op, n) * nbytes
    alpha, inv_bw = nonnegative_lstsq(np.stack([np.ones_like(x), x], axis=1), seconds, 1.0 / seconds)
    if inv_bw <= 0:  # time did not grow with size (noise): the bandwidth of the largest message
        inv_bw = max(seconds[np.argmax(x)] - alpha, 1e-12) / x.max()
    return {"alpha_s": float(alpha), "gbps": float(1.0 / inv_bw / 1e9)}


OVERHEAD_KEYS = ("per_layer_step", "per_microbatch", "per_step")


def fit_overheads(samples) -> dict:
    """Fixed costs of a training step from runs whose modelled compute is known.

    Each sample is a mapping with ``layers`` (transformer layers on the rank), ``microbatches`` (per
    step), ``measured_s`` (step time) and ``modelled_s`` (what the cost model predicts without
    overheads). The residual is fitted, all terms >= 0, as
    ``per_step + microbatches * (per_microbatch + layers * per_layer_step)``:
    ``per_layer_step`` is the framework cost of one layer's forward and backward on one micro-batch,
    ``per_microbatch`` that of a micro-batch outside the layers (embedding, loss, schedule), ``per_step``
    that of the step outside the micro-batches (optimizer launch, gradient bookkeeping, logging)."""
    samples = list(samples)
    if len({(s["layers"], s["microbatches"]) for s in samples}) < 3:
        raise ValueError("fitting three overheads needs runs of at least three (layers, microbatches) pairs")
    m = np.array([s["microbatches"] for s in samples], dtype=float)
    layers = np.array([s["layers"] for s in samples], dtype=float)
    residual = np.array([s["measured_s"] - s["modelled_s"] for s in samples])
    measured = np.array([s["measured_s"] for s in samples])
    x = nonnegative_lstsq(np.stack([m * layers, m, np.ones_like(m)], axis=1), residual, 1.0 / measured)
    return dict(zip(OVERHEAD_KEYS, map(float, x)))


def predict_overheads(overheads: dict, layers: int, microbatches: int) -> float:
    return overheads["per_step"] + microbatches * (overheads["per_microbatch"] + layers * overheads["per_layer_step"])


def median(values) -> float:
    return float(statistics.median(values))
