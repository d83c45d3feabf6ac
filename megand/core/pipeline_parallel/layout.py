"""Which layers each (virtual) pipeline stage holds."""

from dataclasses import dataclass

from megand.core.pipeline_parallel.actions import placement_for


class PipelineLayoutError(ValueError):
    """Layers that cannot be split as asked over the pipeline stages; the message names the values."""


def pipeline_layout(num_layers: int, pp: int, vpp: int | None, layout=None) -> list[int]:
    """Layers per virtual stage (pp*vpp entries, in virtual-stage order); ``layout=None``: even."""
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


def chunk_specs(layers_per_stage: list[int], pp_size: int, pp_rank: int, schedule: str = "1f1b") -> list[ChunkSpec]:
    """The model chunks of pipeline rank ``pp_rank``. With v = len(layers_per_stage) / pp virtual stages
    per rank, chunk ``c`` of rank ``r`` is the virtual stage the schedule's placement gives it: ``c*pp + r``
    (Megatron's interleaving: consecutive virtual stages on consecutive ranks), or for a V schedule
    (``zbv``, ``dualpipev``) stage r for chunk 0 and ``2·pp - 1 - r`` for chunk 1."""
    num_stages = len(layers_per_stage)
    placement = placement_for(pp_size, num_stages // pp_size, schedule)
    starts = [sum(layers_per_stage[:i]) for i in range(num_stages)]
    specs = []
    for chunk in range(placement.vpp):
        stage = placement.stage(pp_rank, chunk)
        ids = list(range(starts[stage], starts[stage] + layers_per_stage[stage]))
        specs.append(ChunkSpec(ids, stage == 0, stage == num_stages - 1))
    return specs
