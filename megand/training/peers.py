"""A peer rank that died, seen from a survivor: the collective it was in fails with the backend's error
(gloo: "Connection closed by peer", NCCL: a DistBackendError). That is no bug of the survivor, and its
traceback says nothing the launcher's report does not: the entry script prints one line instead and
exits ``EXIT_PEER_LOST``, which a launcher restarts like any failure."""

from __future__ import annotations

import torch.distributed as dist

EXIT_PEER_LOST = 1
_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
               "NCCL communicator was aborted", "failed to recv", "failed to send")


def peer_lost(error: BaseException) -> str | None:
    """One line describing a peer's failure seen in ``error``, or None when ``error`` is something else."""
    text = " ".join(str(error).split())
    if isinstance(error, dist.DistError) or any(sign.lower() in text.lower() for sign in _PEER_SIGNS):
        first = text.split(" Exception raised from ")[0]
        return f"a peer rank failed or was killed during a collective ({first[:300]})"
    return None
