"""Which layers each (virtual) pipeline stage holds."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSpec:
    layer_ids: list
    pre_process: bool  # holds the embeddings
    post_process: bool  # holds the final norm, output layer and loss


def chunk_specs(layers_per_stage: list[int], pp_size: int, pp_rank: int) -> list[ChunkSpec]:
    """The model chunks of pipeline rank ``pp_rank``. With v = len(layers_per_stage) / pp virtual stages
    per rank, chunk ``c`` of rank ``r`` is virtual stage ``c*pp + r`` (Megatron's interleaving), so
    consecutive virtual stages live on consecutive ranks."""
    num_stages = len(layers_per_stage)
    starts = [sum(layers_per_stage[:i]) for i in range(num_stages)]
    specs = []
    for stage in range(pp_rank, num_stages, pp_size):
        ids = list(range(starts[stage], starts[stage] + layers_per_stage[stage]))
        specs.append(ChunkSpec(ids, stage == 0, stage == num_stages - 1))
    return specs
