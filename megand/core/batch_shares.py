"""Per-replica batch shares: data-parallel replicas that take different numbers of micro-batches per step.

``parallel.dp_microbatches = [k_0, ..., k_{dp-1}]`` gives data-parallel replica ``r`` ``k_r`` micro-batches
of the step (a fast replica more, a slow one fewer), instead of ``global micro-batches / dp`` each. The
global batch is unchanged: replica ``r`` reads the contiguous slice of ``k_r`` micro-batches' samples that
starts after the slices of replicas ``0..r-1``. Every micro-batch's loss is already its share of the mean
over the global batch's loss tokens, and the data-parallel engine sums gradients: the step is the
one-process step of the whole global batch, whatever the shares.

What changes is which collectives may run per micro-batch. A replica runs its own number of forwards and
backwards, so a group whose ranks belong to replicas of different shares may only meet once per step
(the gradient reduction, the loss, the parameter all-gather of ZeRO-1), or per micro-batch in an order
that a replica with fewer micro-batches can join without computing. Per micro-batch, only ranks of one
replica may meet: tensor, context and pipeline parallelism, expert dispatch with the ep ranks inside a
replica, and the MoE balancing losses, which are then over each replica's micro-batch (the one-process
run with the same micro-batches) instead of over every replica's micro-batch of that index.

ZeRO-2/3 shard groups (``dp_shard``, and ``expert_dp`` under expert parallelism) may span replicas of
different shares at pp=1: shards stay equal-sized, only the work differs. A replica with fewer
micro-batches than the largest share joins each missing micro-batch's collectives as a phantom micro-batch
(``DataParallel.join_microbatch``: ZeRO-3's parameter all-gathers of forward and backward, the gradient
reduce-scatters of ZeRO-2/3 contributing zeros), in the order a real micro-batch issues them, without
running the model. It keeps ZeRO-2/3's memory, not the shares' speed: every micro-batch is a meeting of the
whole shard group, so each waits for the slowest replica still computing one (why the planner offers
shares with ZeRO-0/1 only: megand/tools/planner/shares.py). With pp>1 each
stage's collectives follow its pipeline schedule's order of forwards and backwards, which phantoms do not
replay: there the shard groups must stay inside replicas of equal shares (HSDP), as ep groups must
everywhere. :func:`group_error` says which group breaks this.
"""

from __future__ import annotations


def shares_error(dp: int, shares) -> str | None:
    """Why ``shares`` (``parallel.dp_microbatches``) cannot be the shares of ``dp`` replicas; None if it can."""
    if shares is None:
        return None
    values = list(shares)
    if len(values) != dp or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in values):
        return (f"parallel.dp_microbatches={values} must list one positive number of micro-batches per data-parallel "
                f"replica (dp={dp})")
    return None


def is_uneven(shares) -> bool:
    """Replicas take different numbers of micro-batches (equal shares are the ordinary layout)."""
    return shares is not None and len(set(shares)) > 1


def replica_rows(shares, dp: int, dp_rank: int, global_batch_size: int) -> tuple[int, int]:
    """``(first, count)``: the samples of the step's global batch that data-parallel replica ``dp_rank``
    reads, as an offset into the batch and a number of samples. Equal shares (``shares`` None): the
    ``dp_rank``-th of ``dp`` equal slices; else ``shares[dp_rank]`` micro-batches of
    ``global_batch_size / sum(shares)`` samples after the slices of the replicas before it."""
    if shares is None:
        per = global_batch_size // dp
        return dp_rank * per, per
    unit = global_batch_size // sum(shares)
    return unit * sum(shares[:dp_rank]), unit * shares[dp_rank]


def microbatch_count_error(shares, global_batch_size: int, micro_batch_size: int) -> str | None:
    """Why the shares do not split ``global_batch_size`` into micro-batches of ``micro_batch_size``."""
    total = sum(shares)
    if global_batch_size != total * micro_batch_size:
        return (f"parallel.dp_microbatches={list(shares)} takes {total} micro-batches per step, but "
                f"train.global_batch_size={global_batch_size} / train.micro_batch_size={micro_batch_size} is "
                f"{global_batch_size / micro_batch_size:g}")
    return None


# the groups that meet once per micro-batch (besides tp, cp and pp, which are inside a replica), and when
GROUPS_PER_MICROBATCH = {
    "ep": "the expert dispatch of every micro-batch",
    "dp_shard": "the ZeRO-2/3 gradient reduce-scatters and parameter all-gathers of every micro-batch in its "
                "pipeline schedule's order",
    "expert_dp": "the ZeRO-2/3 reduce-scatters and all-gathers of the expert shards of every micro-batch in its "
                 "pipeline schedule's order",
}


def group_error(shares, dp_of, groups: dict, kinds, notes=None) -> str | None:
    """Why a group of ``kinds`` (names in :data:`GROUPS_PER_MICROBATCH`) would mix replicas of different
    shares. ``groups``: rank lists by kind (``rank_groups``); ``dp_of(rank)``: the rank's data-parallel
    coordinate; ``notes``: words to end the message with, by kind (the settings that make it so)."""
    if not is_uneven(shares):
        return None
    for kind in kinds:
        for ranks in groups.get(kind, []):
            counts = {shares[dp_of(r)] for r in ranks}
            if len(counts) > 1:
                return (f"parallel.dp_microbatches={list(shares)}: the {kind} group {ranks} spans replicas with "
                        f"{sorted(counts)} micro-batches, but runs {GROUPS_PER_MICROBATCH[kind]}; keep it inside "
                        f"replicas of equal shares" + (f" ({notes[kind]})" if notes and kind in notes else ""))
    return None


def lockstep_microbatches(shares, local: int) -> int:
    """The micro-batches every rank of a shard group runs this step: the largest share under uneven
    shares (a replica with ``local`` fewer joins the rest as phantoms, DataParallel.join_microbatch),
    else ``local``."""
    return max(shares) if is_uneven(shares) else local


def step_microbatches(shares, local: int) -> int:
    """The micro-batches over which a step averages per-micro-batch terms (the MoE balancing losses): the
    ``local`` count at equal shares (each is every replica's micro-batch of that index), every replica's
    own under uneven shares."""
    return sum(shares) if is_uneven(shares) else local
