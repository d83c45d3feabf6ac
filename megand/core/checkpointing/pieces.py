"""Rectangular pieces of full tensors, written and read with torch.distributed.checkpoint (DCP).

A :class:`Piece` is ``tensor`` placed at ``offsets`` inside the full tensor saved under ``key``. A rank
may hold any number of pieces of a tensor, of any shape: DCP records each as a chunk of the full
tensor, keeps one copy of a piece that several ranks hold (same key and offsets), and on load reads the
overlap of whatever chunks any layout wrote with each piece requested. So the checkpoint only ever
holds full-tensor coordinates: it is independent of the layout that wrote it.

The two planners extend DCP's default planners through their public extension points (extra write
and read items, and where each item's data lives); DTensor's even sharding cannot express the pieces
of a distributed-optimizer shard, which start and end anywhere inside a parameter.
:func:`flat_range_boxes` turns such a flat range into at most ``2 x ndim - 1`` boxes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megand.core.sharding import flat_range_boxes  # noqa: F401 - part of this module's interface


@dataclass(frozen=True)
class Piece:
    key: str  # the full tensor's name in the checkpoint
    offsets: tuple[int, ...]  # where ``tensor`` starts inside the full tensor
    full_shape: tuple[int, ...]
    tensor: torch.Tensor  # the data to save, or the destination to load into (a view: loaded in place)


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.shape)


class PieceSavePlanner(DefaultSavePlanner):
    """Writes ``pieces`` (in addition to whatever state dict DCP was given)."""

    def __init__(self, pieces: list[Piece]):
        super().__init__()
        self.pieces = {(p.key, tuple(p.offsets)): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(p.key, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=_chunk(p), properties=TensorProperties.create_from_tensor(
                               p.tensor), size=torch.Size(p.full_shape)))
                 for p in self.pieces.values()]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        piece = self.pieces.get((index.fqn, tuple(index.offset)))
        return piece.tensor if piece is not None else super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """Fills every piece's tensor (in place) from the checkpoint, whatever chunks it was written in.
    Several pieces may read the same key and offsets (e.g. a weight and its fp32 master copy)."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False)  # the state dict given to DCP is empty: nothing to flatten
        self.pieces = list(pieces)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for i, p in enumerate(self.pieces):
            for item in create_read_items_for_chunk_list(p.key, self.metadata.state_dict_metadata[p.key], [_chunk(p)]):
                # each piece is its own destination, named by its position in ``pieces``
                items.append(dataclasses.replace(item, dest_index=MetadataIndex(f"#piece{i}", item.dest_index.offset)))
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn.startswith("#piece"):
            return self.pieces[int(index.fqn[len("#piece"):])].tensor
        return super().lookup_tensor(index)
