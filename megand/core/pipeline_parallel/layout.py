"""Which layers each (virtual) pipeline stage holds."""

from collections.abc import Mapping
from dataclasses import dataclass

from megand.core.pipeline_parallel.actions import placement_for
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE


class PipelineLayoutError(ValueError):
    """Layers that cannot be split as asked over the pipeline stages; the message names the values."""


def stage_layers(layout) -> list | None:
    """The layers of each entry of ``parallel.pipeline_layout``: its integers, or the ``layers`` of its
    per-stage entries (``{layers, tp, sp}``: the widths are the parallel layout's,
    megand/core/parallel_layout.py)."""
    if layout is None:
        return None
    return [e["layers"] if isinstance(e, Mapping) else e for e in layout]


def pipeline_layout(num_layers: int, pp: int, vpp: int | None, layout=None) -> list[int]:
    """Layers per virtual stage (pp*vpp entries, in virtual-stage order); ``layout=None``: even. Entries
    may be per-stage descriptions (:func:`stage_layers`)."""
    layout = stage_layers(layout)
    stages = pp * (vpp or 1)
    if layout is None:
        if num_layers % stages:
            raise PipelineLayoutError(
                f"model.num_layers={num_layers} cannot be split evenly over parallel.pp={pp} x "
                f"parallel.vpp={vpp or 1} = {stages} stages; set parallel.pipeline_layout")
        return [num_layers // stages] * stages
    layout = list(layout)
    if len(layout) != stages or sum(layout) != num_layers or min(layout) < 0:
        raise PipelineLayoutError(
            f"parallel.pipeline_layout={layout} must have pp*vpp = {stages} non-negative entries "
            f"summing to model.num_layers={num_layers} (it has {len(layout)} summing to {sum(layout)})")
    return layout


@dataclass(frozen=True)
class ChunkSpec:
    layer_ids: list
    pre_process: bool  # holds the embeddings
    post_process: bool  # holds the final norm, output layer and loss


def chunk_specs(layers_per_stage: list[int], pp_size: int, pp_rank: int,
                schedule: str = DEFAULT_SCHEDULE) -> list[ChunkSpec]:
    """The model chunks of pipeline rank ``pp_rank``. With v = len(layers_per_stage) / pp virtual stages
    per rank, chunk ``c`` of rank ``r`` is the virtual stage the schedule's placement gives it: ``c*pp + r``
    (Megatron's interleaving: consecutive virtual stages on consecutive ranks), or for a V stage r for
    chunk 0 and ``2·pp - 1 - r`` for chunk 1."""
    num_stages = len(layers_per_stage)
    placement = placement_for(pp_size, num_stages // pp_size, schedule)
    starts = [sum(layers_per_stage[:i]) for i in range(num_stages)]
    specs = []
    for chunk in range(placement.vpp):
        stage = placement.stage(pp_rank, chunk)
        ids = list(range(starts[stage], starts[stage] + layers_per_stage[stage]))
        specs.append(ChunkSpec(ids, stage == 0, stage == num_stages - 1))
    return specs


def recomputed_layer_ids(layers_per_stage: list[int], recompute_layers=None) -> frozenset | None:
    """The layer ids that apply the run's recomputation: the first ``recompute_layers[j]`` layers of
    virtual stage ``j`` (``layers_per_stage``'s order: pp entries, pp*vpp when interleaved); None: every
    layer (``recompute_layers=None``). A stage with more free memory recomputes fewer of its layers."""
    if recompute_layers is None:
        return None
    counts = list(recompute_layers)
    if len(counts) != len(layers_per_stage) or any(
            not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= have
            for n, have in zip(counts, layers_per_stage)):
        raise PipelineLayoutError(
            f"train.recompute_layers={counts} must have one entry per (virtual) pipeline stage "
            f"({len(layers_per_stage)}), each between 0 and that stage's layers {list(layers_per_stage)}")
    ids, start = set(), 0
    for n, have in zip(counts, layers_per_stage):
        ids.update(range(start, start + n))
        start += have
    return frozenset(ids)


@dataclass(frozen=True)
class PipelinePlan:
    """The model's split over the pipeline: the layers of each (virtual) stage, in :func:`pipeline_layout`'s
    order, and the ids of the layers that apply the run's recomputation (None: every layer)."""

    layers_per_stage: tuple
    recompute_ids: frozenset | None = None

    def chunks(self, pp_size: int, pp_rank: int, schedule: str = DEFAULT_SCHEDULE) -> list[ChunkSpec]:
        """The model chunks of pipeline rank ``pp_rank`` (see :func:`chunk_specs`)."""
        return chunk_specs(list(self.layers_per_stage), pp_size, pp_rank, schedule)
