"""Pipeline p2p under NCCL's rules: every schedule's posted sends and receives complete, and each message
reaches the action that expects it.

NCCL ignores tags and, per communicator, runs each rank's point-to-point batches in the order they are
queued; a batch (one ``batch_isend_irecv``) completes only when every operation in it meets its matching
operation at the peer (same communicator, same sender and receiver, same position in their order) in a
batch that is itself running; waiting for a batch holds the rank (its compute stream) until it is
complete, and a batch posted afterwards runs after that compute. A send may not complete before its
receive is posted (small messages may, into NCCL's buffers; large ones cannot: the simulator takes the
strict case, so what completes here completes with either). Communicators of different groups run
independently (their own streams), unless the device serialises its kernels (``CUDA_DEVICE_MAX_CONNECTIONS=1``:
one queue per rank, where a batch holds every batch posted after it): :func:`simulate` models both, and
the executor completes under both (before its global posting order, each stage posted a step's send and
receive in its own order: with serialised kernels 27 of the 32 cases deadlocked, every schedule once a
stage has a steady state).

:func:`simulate` runs those rules over what each rank posts and waits for, recorded from the executor
itself (megand/core/pipeline_parallel/schedules.py and p2p.py, run in this process with the compute and
torch.distributed's calls stood in for: the backend answers "nccl", so the executor takes its NCCL path,
posting every receive with the call that waits for it). The earlier executor (one communicator for
every message, a receive taking the peer's earlier messages of the other kind first, every batch waited
for at once, sends included) is rebuilt from the same recorded exchanges, and deadlocks on the V
schedules (and on interleaved 1F1B) where the current one completes.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megand.core.parallel_layout import ParallelLayout
from megand.core.pipeline_parallel import schedules
from megand.core.pipeline_parallel.hand_off import StageHandOff
from megand.core.pipeline_parallel.actions import FORWARD, placement_for, schedule_actions
from megand.core.pipeline_parallel.p2p import ACTIVATION, GRADIENT, PipelineP2P

SHAPE = (2, 1, 4)
_EXCHANGE = PipelineP2P.exchange
# (name, vpp, pp_schedule, micro-batch counts at pp=2 and at pp=4)
SCHEDULES = [
    ("1f1b", None, "1f1b", {2: [1, 3, 8], 4: [2, 4, 9]}),
    ("interleaved", 2, "1f1b", {2: [2, 4, 8], 4: [4, 8]}),
    ("zb1p", None, "zb1p", {2: [1, 3, 8], 4: [2, 4, 9]}),
    ("zbv", 2, "zbv", {2: [1, 3, 4, 8], 4: [2, 7, 8, 12]}),
    ("dualpipev", 2, "dualpipev", {2: [4, 5, 8], 4: [8, 9, 12]}),
]
SCHEDULES_BY_NAME = {name: counts for name, _, _, counts in SCHEDULES}
CASES = [(name, vpp, schedule, pp, m) for name, vpp, schedule, ms in SCHEDULES for pp, counts in ms.items()
         for m in counts]


# -- NCCL's point-to-point rules -------------------------------------------------------------------------

def simulate(programs, serialised=False):
    """Run every rank's program under NCCL's rules. ``programs[r]``: rank r's events in order,
    ``("post", batch, group, [(op, peer), ...])`` (op "send" or "recv", peer a pipeline rank) or
    ``("wait", batch)``. ``serialised``: the device runs one kernel at a time in the order they are
    queued (``CUDA_DEVICE_MAX_CONNECTIONS=1``), so a rank's batches run one after the other whatever
    their communicators: a batch holds every batch posted after it on that rank until it is complete.
    Returns ``(True, None)`` when every rank reaches its end, else ``(False, where)``
    with each stuck rank's position and the operations it waits on."""
    ops, group_of = {}, {}  # (rank, batch) -> [(op, key)], key = (group, sender, receiver, position)
    for rank, program in enumerate(programs):
        counts = {}
        for event in program:
            if event[0] != "post":
                continue
            _, batch, group, batch_ops = event
            keyed = []
            for op, peer in batch_ops:
                sender, receiver = (rank, peer) if op == "send" else (peer, rank)
                position = counts.get((op, group, sender, receiver), 0)
                counts[(op, group, sender, receiver)] = position + 1
                keyed.append((op, (group, sender, receiver, position)))
            ops[(rank, batch)], group_of[(rank, batch)] = keyed, group
    sends = sorted(key for (rank, _), keyed in ops.items() for op, key in keyed if op == "send")
    receives = sorted(key for (rank, _), keyed in ops.items() for op, key in keyed if op == "recv")
    assert sends == receives, "a send without its receive (or the reverse)"

    pc = [0] * len(programs)
    posted = [[] for _ in programs]  # batches posted, in order
    done = set()  # (rank, op, key)

    def complete(rank, batch):
        return all((rank, op, key) in done for op, key in ops[(rank, batch)])

    def running(rank):
        """The batches of ``rank`` that run now: per group (serialised: on the rank), the first one posted
        and not complete."""
        busy, now = set(), []
        for batch in posted[rank]:
            if serialised and not complete(rank, batch):
                return [batch]
            if group_of[(rank, batch)] not in busy and not complete(rank, batch):
                busy.add(group_of[(rank, batch)])
                now.append(batch)
        return now

    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            while pc[rank] < len(program):  # post, or pass a wait whose batch is complete
                event = program[pc[rank]]
                if event[0] == "post":
                    posted[rank].append(event[1])
                elif not complete(rank, event[1]):
                    break
                pc[rank] += 1
                progress = True
        for rank in range(len(programs)):
            for batch in running(rank):
                for op, key in ops[(rank, batch)]:
                    if (rank, op, key) in done:
                        continue
                    peer, other = (key[2], "recv") if op == "send" else (key[1], "send")
                    if any((other, key) in ops[(peer, b)] for b in running(peer)):
                        done.update({(rank, op, key), (peer, other, key)})
                        progress = True
    if all(pc[r] == len(p) for r, p in enumerate(programs)):
        return True, None
    stuck = {r: (pc[r], [ops[(r, b)] for b in running(r)]) for r, p in enumerate(programs) if pc[r] < len(p)}
    return False, stuck


def test_simulator_finds_the_classic_deadlock_and_passes_a_matched_exchange():
    # both ranks send first, in a batch of its own that they wait for, then receive: neither send completes
    blocking = [[("post", 0, "g", [("send", 1)]), ("wait", 0), ("post", 1, "g", [("recv", 1)]), ("wait", 1)],
                [("post", 0, "g", [("send", 0)]), ("wait", 0), ("post", 1, "g", [("recv", 0)]), ("wait", 1)]]
    assert not simulate(blocking)[0]
    # the same messages, each rank's send and receive in one batch: both complete
    batched = [[("post", 0, "g", [("send", 1), ("recv", 1)]), ("wait", 0)],
               [("post", 0, "g", [("send", 0), ("recv", 0)]), ("wait", 0)]]
    assert simulate(batched) == (True, None)
    # a receive queued behind an unmatched send on one communicator waits even when the send is not waited for
    queued = [[("post", 0, "g", [("send", 1)]), ("post", 1, "g", [("recv", 1)]), ("wait", 1), ("wait", 0)],
              [("post", 0, "g", [("send", 0)]), ("post", 1, "g", [("recv", 0)]), ("wait", 1), ("wait", 0)]]
    assert not simulate(queued)[0]
    # ... and passes once each rank's send and receive are on communicators of their own
    split = [[("post", 0, "out", [("send", 1)]), ("post", 1, "in", [("recv", 1)]), ("wait", 1), ("wait", 0)],
             [("post", 0, "in", [("send", 0)]), ("post", 1, "out", [("recv", 0)]), ("wait", 1), ("wait", 0)]]
    assert simulate(split) == (True, None)
    # ... unless the device serialises its kernels: each rank's send then holds its receive (posted after it)
    assert not simulate(split, serialised=True)[0]
    # posting the two communicators' batches in the same order at both peers completes there too
    same_order = [[("post", 0, "out", [("send", 1)]), ("post", 1, "in", [("recv", 1)]), ("wait", 1), ("wait", 0)],
                  [("post", 0, "out", [("recv", 0)]), ("post", 1, "in", [("send", 0)]), ("wait", 0), ("wait", 1)]]
    assert simulate(same_order, serialised=True) == (True, None)


# -- what the executor posts (recorded in this process) ------------------------------------------------

class _Work:
    def __init__(self, record, batch):
        self.record, self.batch = record, batch

    def wait(self, timeout=None):
        self.record.append(("wait", self.batch))
        return True

    def is_completed(self):
        return False  # only a wait completes a batch here (the executor may not rely on more)


def _record(monkeypatch, pp, vpp, m, schedule, rank, forward_only=False, topo=None):
    """Rank ``rank``'s p2p as the executor posts it on NCCL: its events (for :func:`simulate`) and the
    items of each of its exchange calls. ``topo``: the rank's stand-in topology (default: pipeline rank
    ``rank`` of a one-width pipeline whose global ranks are the pipeline ranks)."""
    events, exchanges, groups = [], [], ("act_down", "act_up", "grad_down", "grad_up")

    def batch_isend_irecv(ops):
        batch = len([e for e in events if e[0] == "post"])
        events.append(("post", batch, ops[0].group,
                       [("send" if op.op is dist.isend else "recv", op.peer) for op in ops]))
        assert all(op.group is ops[0].group for op in ops)  # torch requires one group per batch
        return [_Work(events, batch)]

    def exchange(self, items):
        exchanges.append([(item[0], item[-2], item[-1]) for item in items])
        return _EXCHANGE(self, items)

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group, tag=0: SimpleNamespace(op=op, tensor=tensor, peer=peer,
                                                                                         group=group))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, tensor, group=None: None)  # a hand-off's gather
    monkeypatch.setattr(PipelineP2P, "exchange", exchange)
    tensor = lambda: torch.zeros(SHAPE)  # noqa: E731
    monkeypatch.setattr(schedules._Steps, "forward", lambda self, chunk, mb, x: tensor())
    monkeypatch.setattr(schedules._Steps, "backward", lambda self, x, out, grad, chunk=0: None if x is None else tensor())
    monkeypatch.setattr(schedules._Steps, "input_grad", lambda self, x, out, grad: (None if x is None else tensor(), None))
    monkeypatch.setattr(schedules._Steps, "weight_grad", lambda self, deferred: None)
    v = vpp or 1
    placement = placement_for(pp, v, schedule)
    stages = range(pp * v)
    chunks = [SimpleNamespace(cfg=SimpleNamespace(sequence_parallel=False, hidden_size=SHAPE[2], pipeline_width=SHAPE[2],
                                              params_dtype=torch.float32),
                              pre_process=placement.stage(rank, c) == 0, post_process=placement.stage(rank, c) == stages[-1])
              for c in range(v)]
    topo = topo or SimpleNamespace(pp_size=pp, pp_rank=rank, vpp=vpp, device=torch.device("cpu"),
                                   ranks={"pp": list(range(pp))}, pp_group="pp", pp_channel_groups=groups,
                                   pp_prev_rank=(rank - 1) % pp, pp_next_rank=(rank + 1) % pp, stage_hand_off=None)
    microbatches = [SimpleNamespace(batch_size=SHAPE[1], positions=torch.zeros(1, SHAPE[0])) for _ in range(m)]
    schedules.get_schedule(topo, schedule=schedule)(chunks, microbatches, None, topo, forward_only=forward_only)
    return events, exchanges


def _recorded(monkeypatch, name, vpp, schedule, pp, m, forward_only=False):
    return [_record(monkeypatch, pp, vpp, m, schedule, rank, forward_only) for rank in range(pp)]


@pytest.mark.parametrize("name, vpp, schedule, pp, m", CASES, ids=[f"{c[0]}-pp{c[3]}-m{c[4]}" for c in CASES])
def test_every_schedule_completes_under_nccls_rules(monkeypatch, name, vpp, schedule, pp, m):
    for forward_only in (False, True):
        recorded = _recorded(monkeypatch, name, vpp, schedule, pp, m, forward_only)
        for serialised in (False, True):
            ok, stuck = simulate([events for events, _ in recorded], serialised)
            assert ok, (forward_only, serialised, stuck)
        # each batch holds the operations of one group; a batch waited for before the next compute holds a
        # receive (sends never hold the stage: only the end of the step waits for them)
        for events, _ in recorded:
            posts = {e[1]: e[3] for e in events if e[0] == "post"}
            last = max((i for i, e in enumerate(events) if e[0] == "post"), default=-1)
            early_waits = [posts[e[1]] for i, e in enumerate(events) if e[0] == "wait" and i < last]
            assert all(any(op == "recv" for op, _ in batch) for batch in early_waits), early_waits


# (stage widths, sequence parallelism per stage): stages of different widths, each side sp or not
HETERO = [((2, 1), (False, False)), ((1, 2), (False, True)), ((2, 1), (True, False)), ((2, 4), (True, True)),
          ((2, 1, 2, 1), (True, False, False, True))]


def _hetero_topo(layout, rank):
    """Rank ``rank``'s stand-in topology in ``layout`` (stages of different widths): its pipeline view
    (its source in each stage) and its hand-off, as :class:`~megand.core.parallel_state.Topology` has them."""
    hand_off = StageHandOff(layout, rank)
    view = [hand_off.source(stage) for stage in range(layout.pp)]
    stage = hand_off.stage
    return SimpleNamespace(pp_size=layout.pp, pp_rank=stage, vpp=layout.vpp, device=torch.device("cpu"),
                           ranks={"pp": view}, pp_group="pp", pp_channel_groups=("act_down", "act_up", "grad_down", "grad_up"),
                           pp_prev_rank=view[(stage - 1) % layout.pp], pp_next_rank=view[(stage + 1) % layout.pp],
                           stage_hand_off=hand_off, tp_group="tp")


@pytest.mark.parametrize("widths, sp", HETERO, ids=[f"{'-'.join(map(str, w))}-sp{''.join(str(int(x)) for x in s)}"
                                                     for w, s in HETERO])
@pytest.mark.parametrize("name, vpp, schedule", [(s[0], s[1], s[2]) for s in SCHEDULES])
def test_stages_of_different_widths_complete_under_nccls_rules(monkeypatch, widths, sp, name, vpp, schedule):
    """Every rank of pipelines whose stages have different tp widths (hand_off.py: a message becomes
    sends to each receiver a sender serves, one receive at each receiver) completes under NCCL's rules,
    on separate and on serialised streams, for every schedule (dp=2: ranks of two (dp, cp) coordinates)."""
    pp = len(widths)
    if schedule in ("zbv", "dualpipev") and pp % 2:
        pytest.skip("a V needs an even pp")  # none here: every HETERO entry is even
    m = SCHEDULES_BY_NAME[name][2 if pp == 2 else 4][-1]
    layout = ParallelLayout(pp=pp, dp=2, vpp=vpp, pp_schedule=schedule, stage_tp=widths, stage_sp=sp)
    for forward_only in (False, True):
        recorded = [_record(monkeypatch, pp, vpp, m, schedule, layout.stage_of(r), forward_only,
                            topo=_hetero_topo(layout, r))[0] for r in range(layout.world_size)]
        for serialised in (False, True):
            ok, stuck = simulate(recorded, serialised)
            assert ok, (forward_only, serialised, stuck)


def _message_orders(pp, vpp, m, schedule, group):
    """Per (group, sender, receiver): the messages sent, and the messages the receiver's actions expect,
    each in its own rank's order, as (kind, receiving virtual stage, micro-batch)."""
    sent, expected = {}, {}
    for rank in range(pp):
        for a in schedule_actions(pp, vpp, m, rank, schedule=schedule):
            kind = ACTIVATION if a.kind == FORWARD else GRADIENT
            if a.send_to is not None and a.send_to != rank:
                receiving = a.stage + 1 if kind == ACTIVATION else a.stage - 1
                sent.setdefault(group(kind, rank, a.send_to), []).append((kind, receiving, a.microbatch))
            if a.recv_from is not None and a.recv_from != rank:
                expected.setdefault(group(kind, a.recv_from, rank), []).append((kind, a.stage, a.microbatch))
    return sent, expected


@pytest.mark.parametrize("name, vpp, schedule", [(s[0], s[1], s[2]) for s in SCHEDULES])
def test_each_message_reaches_the_action_that_expects_it(name, vpp, schedule):
    """Matching by order per group gives each receive the message its action needs: per group, sender and
    receiver, the messages leave in the order the receiving end consumes them. On one group for both kinds
    (the earlier executor, without its reordering) the V schedules' links would not."""
    per_kind_and_direction = lambda kind, sender, receiver: (kind, receiver < sender, sender, receiver)  # noqa: E731
    one_group = lambda kind, sender, receiver: (sender, receiver)  # noqa: E731
    mismatched = []
    for pp in (2, 4):
        for m in SCHEDULES_BY_NAME[name][pp]:
            sent, expected = _message_orders(pp, vpp, m, schedule, per_kind_and_direction)
            assert sent == expected, (pp, m)
            sent, expected = _message_orders(pp, vpp, m, schedule, one_group)
            mismatched += [(pp, m)] if sent != expected else []
    assert bool(mismatched) == (schedule in ("zbv", "dualpipev")), mismatched


# -- the earlier executor: one communicator, order-matched receives, every batch waited for at once -----

def _earlier_program(exchanges, rank, every):
    """What the earlier executor posted for ``exchanges`` (each call's items: ("send"|"recv", peer, kind)):
    one group; in each call activations before gradients and a send before a receive; a receive first
    took the peer's earlier messages of the other kind (in the order that peer sends them, from its action
    list); each call's batch waited for at once (NCCL coalesces it: its sends too)."""
    order = {peer: [ACTIVATION if a.kind == FORWARD else GRADIENT for a in theirs if a.send_to == rank]
             for peer, theirs in enumerate(every) if peer != rank}
    early, program = {}, []
    for items in exchanges:
        ops = []
        for op, peer, kind in sorted(items, key=lambda item: (item[2], item[0] != "send")):
            if op == "send":
                ops.append(("send", peer))
            elif early.get((peer, kind)):
                early[(peer, kind)] -= 1
            else:
                while order[peer] and order[peer][0] != kind:
                    other = order[peer].pop(0)
                    early[(peer, other)] = early.get((peer, other), 0) + 1
                    ops.append(("recv", peer))
                order[peer].pop(0)
                ops.append(("recv", peer))
        if ops:
            batch = len(program) // 2
            program += [("post", batch, "pp", ops), ("wait", batch)]
    return program


@pytest.mark.parametrize("name, vpp, schedule, pp, m", CASES, ids=[f"{c[0]}-pp{c[3]}-m{c[4]}" for c in CASES])
def test_the_earlier_single_communicator_path_deadlocks_on_the_v_schedules(monkeypatch, name, vpp, schedule, pp, m):
    """The regression: the path that stalled. Its exchanges are the current executor's (the same calls,
    each posting one batch on one group); it completes 1F1B and zb1p and deadlocks on zbv and dualpipev
    from two micro-batches on (two stages each sending before receiving what the other sends), and on
    interleaved 1F1B wherever a step has more than one round of micro-batches (m > pp)."""
    every = [schedule_actions(pp, vpp, m, rank, schedule=schedule) for rank in range(pp)]
    recorded = _recorded(monkeypatch, name, vpp, schedule, pp, m)
    ok, _ = simulate([_earlier_program(exchanges, rank, every) for rank, (_, exchanges) in enumerate(recorded)])
    deadlocks = (schedule in ("zbv", "dualpipev") and m > 1) or (name == "interleaved" and m > pp)
    assert ok != deadlocks, (name, pp, m)
