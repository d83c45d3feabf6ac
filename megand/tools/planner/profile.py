"""A device profile: what one device of a cluster group computes and moves per second.

The file format (JSON), written by ``tools/calibrate.py`` and read by ``tools/plan.py --profile F``::

    {"name": "cpu-1core-gloo", "source": "measured by tools/calibrate.py on <date>", "dtype": "fp32",
     "peak_tflops": 0.12,
     "gemm": [{"m": 1024, "n": 1024, "k": 1024, "tflops": 0.11}, ...],
     "memory_gbps": 20.0,
     "overhead_s": {"per_layer_step": 0.0, "per_microbatch": 0.0, "per_step": 0.0},
     "collectives": {"intra_node": {"all_reduce": {"alpha_s": 2e-5, "gbps": 5.0}, "all_gather": {...},
                                    "reduce_scatter": {...}, "p2p": {...}, "all_to_all": {...}},
                     "inter_node": {...}}}

- ``gemm``: measured (m, n, k) -> TFLOP/s points of one ``[m, k] @ [k, n]`` product in ``dtype``;
  :func:`gemm_efficiency` interpolates ``tflops / peak_tflops`` between them.
- ``memory_gbps``: effective bandwidth of memory-bound work (elementwise, norms, softmax, optimizer).
- ``overhead_s``: fixed costs the FLOP and byte counts miss (framework, kernel launches):
  ``per_layer_step`` seconds per transformer layer per micro-batch (its forward and backward together),
  ``per_microbatch`` seconds per micro-batch per pipeline stage, ``per_step`` seconds per optimizer step.
- ``collectives``: alpha-beta per operation and link; ``time = alpha_s + factor(op, n) * bytes / (gbps * 1e9)``
  with nccl-tests' bus-bandwidth factors (:func:`bus_factor`); ``bytes`` is the full (gathered) size.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")
LINKS = ("intra_node", "inter_node")
OVERHEADS = ("per_layer_step", "per_microbatch", "per_step")


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file, key and value."""


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    dtype: str
    peak_tflops: float
    gemm: tuple  # of (m, n, k, tflops)
    memory_gbps: float
    overhead_s: dict = field(default_factory=lambda: dict.fromkeys(OVERHEADS, 0.0))
    collectives: dict = field(default_factory=dict)  # link -> op -> {"alpha_s": .., "gbps": ..}
    peak_fp8_tflops: float | None = None  # the device's dense FP8 peak (train.fp8 GEMMs); None: none

    @classmethod
    def from_dict(cls, d: dict, where: str = "profile") -> "Profile":
        """Check every key and value; ProfileError names the first bad one."""
        if not isinstance(d, dict):
            raise ProfileError(f"{where}: expected a JSON object, got {type(d).__name__}")
        for key in ("name", "peak_tflops", "gemm", "memory_gbps", "collectives"):
            if key not in d:
                raise ProfileError(f"{where}: missing key {key!r}")
        peak = _positive(d["peak_tflops"], f"{where}: peak_tflops")
        points = []
        if not isinstance(d["gemm"], list) or not d["gemm"]:
            raise ProfileError(f"{where}: gemm must be a non-empty list of {{m, n, k, tflops}}")
        for i, p in enumerate(d["gemm"]):
            if not isinstance(p, dict) or set(p) < {"m", "n", "k", "tflops"}:
                raise ProfileError(f"{where}: gemm[{i}]={p!r} needs m, n, k and tflops")
            points.append(tuple(_positive(p[k], f"{where}: gemm[{i}].{k}") for k in ("m", "n", "k", "tflops")))
        overhead = dict.fromkeys(OVERHEADS, 0.0)
        for key, value in (d.get("overhead_s") or {}).items():
            if key not in OVERHEADS:
                raise ProfileError(f"{where}: overhead_s.{key} is not one of {', '.join(OVERHEADS)}")
            if not isinstance(value, (int, float)) or value < 0:
                raise ProfileError(f"{where}: overhead_s.{key}={value!r} must be a number >= 0")
            overhead[key] = float(value)
        colls = {}
        for link in LINKS:
            ops = (d["collectives"] or {}).get(link)
            if not isinstance(ops, dict):
                raise ProfileError(f"{where}: collectives.{link} is missing (needs {', '.join(OPS)})")
            colls[link] = {}
            for op in OPS:
                entry = ops.get(op)
                if not isinstance(entry, dict) or "gbps" not in entry:
                    raise ProfileError(f"{where}: collectives.{link}.{op} needs alpha_s and gbps, got {entry!r}")
                alpha = entry.get("alpha_s", 0.0)
                if not isinstance(alpha, (int, float)) or alpha < 0:
                    raise ProfileError(f"{where}: collectives.{link}.{op}.alpha_s={alpha!r} must be >= 0")
                colls[link][op] = {"alpha_s": float(alpha),
                                   "gbps": _positive(entry["gbps"], f"{where}: collectives.{link}.{op}.gbps")}
        fp8 = d.get("peak_fp8_tflops")
        return cls(name=str(d["name"]), source=str(d.get("source", "")), dtype=str(d.get("dtype", "bf16")),
                   peak_tflops=peak, gemm=tuple(points),
                   memory_gbps=_positive(d["memory_gbps"], f"{where}: memory_gbps"),
                   overhead_s=overhead, collectives=colls,
                   peak_fp8_tflops=None if fp8 is None else _positive(fp8, f"{where}: peak_fp8_tflops"))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gemm"] = [{"m": m, "n": n, "k": k, "tflops": t} for m, n, k, t in self.gemm]
        return d

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ProfileError(f"cannot read profile {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"profile {path} is not valid JSON: {e}") from None
        return cls.from_dict(data, where=f"profile {path}")

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    def with_peak(self, peak_tflops: float) -> "Profile":
        """The same efficiency curve on a device of another peak (the GEMM points scale with it)."""
        scale = peak_tflops / self.peak_tflops
        return _replace(self, peak_tflops=peak_tflops,
                        gemm=tuple((m, n, k, t * scale) for m, n, k, t in self.gemm))

    def with_link_gbps(self, link: str, gbps: float) -> "Profile":
        """Every collective on ``link`` at ``gbps`` bus bandwidth (the alphas are kept)."""
        colls = {ln: {op: dict(v) for op, v in ops.items()} for ln, ops in self.collectives.items()}
        for op in OPS:
            colls[link][op]["gbps"] = float(gbps)
        return _replace(self, collectives=colls)


def _replace(profile: Profile, **changes) -> Profile:
    return Profile(**{**{k: getattr(profile, k) for k in profile.__dataclass_fields__}, **changes})


def _positive(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ProfileError(f"{what}={value!r} must be a positive number")
    return float(value)


def gemm_efficiency(profile: Profile, m: float, n: float, k: float) -> float:
    """Fraction of ``peak_tflops`` one ``[m, k] @ [k, n]`` product reaches.

    Inverse-distance weighting over the measured points in log2(m, n, k) space (the four nearest),
    exact at a measured shape, then kept between the points it dominates and those dominating it (a
    product at least as large in every dimension as a measured one is taken to be at least as
    efficient, and at most as efficient as one larger in every dimension): a shape beyond the measured
    range keeps the nearest measured efficiency instead of extrapolating or averaging toward small ones.
    """
    if min(m, n, k) <= 0:
        return 1.0  # no work: any efficiency gives zero time
    return _efficiency(profile.gemm, profile.peak_tflops, m, n, k)


@lru_cache(maxsize=65536)
def _efficiency(gemm: tuple, peak_tflops: float, m: float, n: float, k: float) -> float:
    """:func:`gemm_efficiency` of the measured points ``gemm``, memoised: the planner asks for the same few
    shapes across thousands of layouts."""
    q = (math.log2(m), math.log2(n), math.log2(k))
    scored, lower, upper = [], 0.0, math.inf
    for pm, pn, pk, tflops in gemm:
        p = (math.log2(pm), math.log2(pn), math.log2(pk))
        d2 = sum((a - b) ** 2 for a, b in zip(q, p))
        if d2 < 1e-12:
            return min(1.0, tflops / peak_tflops)
        if all(a >= b for a, b in zip(q, p)):
            lower = max(lower, tflops)
        if all(a <= b for a, b in zip(q, p)):
            upper = min(upper, tflops)
        scored.append((d2, tflops))
    scored.sort()
    nearest = scored[:4]
    weights = [1.0 / d2 for d2, _ in nearest]
    tflops = sum(w * t for w, (_, t) in zip(weights, nearest)) / sum(weights)
    if lower <= upper:
        tflops = min(max(tflops, lower), upper)
    return min(1.0, tflops / peak_tflops)


def gemm_time(profile: Profile, m: float, n: float, k: float, count: float = 1.0, fp8: bool = False) -> float:
    """Seconds for ``count`` products of shape ``[m, k] @ [k, n]``; ``fp8``: as FP8 GEMMs, at the
    profile's FP8 peak with the same efficiency curve (its bf16 peak where it has none)."""
    flops = 2.0 * m * n * k * count
    if flops <= 0:
        return 0.0
    peak = profile.peak_fp8_tflops if fp8 and profile.peak_fp8_tflops else profile.peak_tflops
    return flops / (peak * 1e12 * gemm_efficiency(profile, m, n, k))


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes each rank moves per byte of the (full) buffer."""
    if op not in OPS:
        raise ValueError(f"collective {op!r} is not one of {', '.join(OPS)}")
    if op == "p2p":
        return 1.0
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def collective_time(profile: Profile, op: str, nbytes: float, n: int, link: str) -> float:
    """Seconds for one collective of ``nbytes`` (the full, gathered size) over ``n`` ranks on ``link``;
    a p2p send of ``nbytes``. Zero for a group of one or an empty buffer."""
    if link not in LINKS:
        raise ValueError(f"link {link!r} is not one of {', '.join(LINKS)}")
    factor = bus_factor(op, n)
    if nbytes <= 0 or factor == 0.0:
        return 0.0
    entry = profile.collectives[link][op]
    return entry["alpha_s"] + factor * nbytes / (entry["gbps"] * 1e9)
