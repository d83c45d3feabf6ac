"""Host copies of a rank's checkpoint pieces, for torch.distributed.checkpoint to write.

A copy from a CUDA tensor into pageable host memory blocks the host once per tensor (the driver
bounces it through a pinned buffer of its own): hundreds of stalls per save. Here every device piece
is copied without blocking into page-locked host memory and the host waits once, for the stream that
ran the copies. The page-locked buffers are kept from one save to the next (allocating and pinning
them is slower than the copy): they hold the rank's saved state on the host, the bytes an
asynchronous save needs anyway. A buffer is reused only after the save that wrote it has finished
(a save first waits for the previous one).

Pieces already on the CPU are cloned for an asynchronous save (training goes on mutating them) and
written as they are otherwise.
"""

from __future__ import annotations

import torch

from megand.core.checkpointing.pieces import Piece
from megand.core.checkpointing.sharded import exact_storage


class HostStaging:
    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}  # (key, offsets) -> page-locked host tensor

    def stage(self, pieces: list[Piece], copy: bool) -> list[Piece]:
        """``pieces`` with host tensors: copies of the device ones, finished when this returns."""
        staged, device = [], None
        for piece in pieces:
            t = piece.tensor
            if t.device.type == "cpu":
                host = t.clone() if copy else exact_storage(t)
            else:
                host = self._buffer(piece, t)
                host.copy_(t, non_blocking=True)
                device = t.device
            staged.append(Piece(piece.key, piece.offsets, piece.full_shape, host))
        if device is not None and device.type == "cuda":  # one wait, for the last of the queued copies
            torch.cuda.current_stream(device).synchronize()
        return staged

    def _buffer(self, piece: Piece, t: torch.Tensor) -> torch.Tensor:
        key = (piece.key, piece.offsets)
        host = self._buffers.get(key)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            # only CUDA copies read pinned memory without blocking; other devices get plain host memory
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            self._buffers[key] = host
        return host
