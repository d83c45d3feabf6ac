"""A training step reads device values to the host at most once (the agreed skip decision) between log
lines: no per-step `.item()` for the loss, the gradient norm or the batch checksum; no hidden transfers
(host-to-device copies of host-built tensors, device-to-host copies), which wait for the device too."""

import os
import traceback
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import megand
from megand.training.config import compose
from tests.unit.test_trainer_wandb import one_process_world  # noqa: F401  (fixture)

# Tensor methods that copy a value to the host (on a GPU: wait for the device)
READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__format__", "__repr__"}
# tensors built from host data or allocated without a device: they live on the host
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like", "full_like"}
TRANSFERS = {"to", "cpu", "cuda", "copy_"}


# the package's own folder: a checkout is itself often named megand, and its tests are not package code
PACKAGE_DIR = os.path.dirname(os.path.abspath(megand.__file__))


def _site(stack=None) -> str:
    """``megand/path:line`` of the innermost frame in the package of the current stack (where the read is
    written)."""
    for frame in reversed(stack or traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(PACKAGE_DIR + os.sep):
            return f"megand/{os.path.relpath(path, PACKAGE_DIR)}:{frame.lineno}"
    return "?"


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _target_device(name, args, kwargs):
    """The device a ``to``/``cuda``/``cpu`` call moves its tensor to (None: no device given). On a CPU run
    the run's device is the host too: a move to the host is one written as such (``.cpu()``, the string
    ``"cpu"``), while a ``torch.device`` object (``x.device``) names the run's device ("device")."""
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        return "device"
    values = [kwargs["device"]] if kwargs.get("device") is not None else list(args[1:])
    for value in values:
        if isinstance(value, str):
            return "cpu" if value == "cpu" else "device"
        if isinstance(value, torch.device):
            return "device"
        if isinstance(value, torch.Tensor):
            return "device"
    return None


class HostReads(TorchFunctionMode):
    """Counts the host synchronisations of tensor values while active, by kind, with their megand source
    line (``sites``):

    - reads of values: the Tensor methods above, and any other read of a scalar from inside an op
      (``aten._local_scalar_dense``, seen by the dispatch mode);
    - ``to_host``: ``.cpu()`` / ``.to("cpu")`` of a device tensor (on a GPU a device-to-host copy);
    - ``h2d``: a host-built tensor (``torch.tensor(list)``, a factory without a device, and what is
      computed from them) copied to a device without ``non_blocking``, or ``torch.tensor(data,
      device=...)``: on a GPU a blocking copy from pageable memory.

    On CPU every tensor is on the host; what the code would move on a GPU is told apart by where each
    tensor was built. ``host_tensors``: tensors that live on the host by design (not counted)."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self.host_ids = {id(t) for t in host_tensors}
        self.reads, self.sites, self._inside = [], [], 0
        self._host_built = {}  # id -> weakref of tensors built on the host
        self._dispatch = _ScalarReads(self)

    def __enter__(self):
        self._dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._dispatch.__exit__(*exc)

    def add_host_tensor(self, t) -> None:
        """Count ``t`` (and what is computed from it) as host memory: built on the host before the count."""
        self._mark_host(t)

    def record(self, kind):
        self.reads.append(kind)
        self.sites.append((kind, _site()))

    def on_host(self, t) -> bool:
        ref = self._host_built.get(id(t))
        return id(t) in self.host_ids or (ref is not None and ref() is t)

    def _mark_host(self, out):
        for t in _tensors([out]):
            self._host_built[id(t)] = weakref.ref(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in READS:
            if source is None or not self.on_host(source):
                self.record(name)
            self._inside += 1
            try:
                return func(*args, **kwargs)
            finally:
                self._inside -= 1
        if name in TRANSFERS and source is not None:
            target = _target_device(name, args, kwargs) if name != "copy_" else str(source.device)
            if name == "copy_":
                src = args[1]
                if self.on_host(src) and not self.on_host(source) and not kwargs.get("non_blocking", False):
                    self.record("h2d")
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            if target is None:  # a dtype conversion: stays where it is
                if self.on_host(source):
                    self._mark_host(out)
            elif self.on_host(source):
                if target == "cpu":
                    self._mark_host(out)
                elif not kwargs.get("non_blocking", False):
                    self.record("h2d")
            elif target == "cpu" and not self.on_host(source):
                self.record("to_host")
                if out is not source:  # (on a CPU run the "device" tensor itself comes back)
                    self._mark_host(out)
            return out
        out = func(*args, **kwargs)
        if func is torch.tensor or func is torch.as_tensor:
            if kwargs.get("device") is not None and not isinstance(args[0] if args else None, torch.Tensor):
                self.record("h2d")  # built from host data straight onto a device
            elif kwargs.get("device") is None:
                self._mark_host(out)
        elif name in FACTORIES and kwargs.get("device") is None and not name.endswith("_like"):
            self._mark_host(out)
        elif kwargs.get("device") is None and any(self.on_host(t) for t in _tensors(args)):
            self._mark_host(out)  # computed from host tensors: on the host
        return out


class _ScalarReads(TorchDispatchMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten._local_scalar_dense.default and not self.owner._inside
                and not self.owner.on_host(args[0])):
            self.owner.record("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


def test_host_read_counter_sees_reads():
    x = torch.ones(3)
    with HostReads() as counter:
        x.sum().item()
        bool(x.all())
        x.tolist()
        torch.ones(2, 2).nonzero()  # no scalar read on CPU: not counted
    assert counter.reads == ["item", "__bool__", "tolist"]


def test_read_sites_are_package_lines_in_a_checkout_named_megand(tmp_path):
    """A clone named ``megand`` holds its tests under ``.../megand/tests/``: a read written in a test (here
    code compiled as ``<clone>/megand/tests/unit/reads.py``) is not package code (before: reported as
    ``megand/tests/unit/reads.py:2``, so the layouts' tests failed in such a clone)."""
    from megand.core.transformer.moe import moe_layers

    test_file = str(tmp_path / "megand" / "tests" / "unit" / "reads.py")
    scope = {"_site": _site, "moe_layers": moe_layers}
    exec(compile("def read():\n    return _site()\n", test_file, "exec"), scope)
    assert scope["read"]() == "?"
    package_frame = traceback.FrameSummary(moe_layers.__code__.co_filename, 7, "moe_layers")
    test_frame = traceback.FrameSummary(test_file, 2, "read")
    assert _site([package_frame, test_frame]) == "megand/core/transformer/moe.py:7"


def test_host_read_counter_sees_transfers():
    x = torch.ones(3)
    with HostReads() as counter:
        sizes = torch.tensor([1, 2]).cumsum(0).to(torch.int32)  # built on the host: no sync
        sizes.tolist()
        sizes.to(x.device)  # a blocking host-to-device copy
        sizes.to(x.device, non_blocking=True)
        torch.tensor([1, 2], device=x.device)  # host data straight to the device
        x.to(device="cpu")  # device-to-host
        x.cpu()
        torch.tensor_split(x, torch.tensor([1]))  # split points on the host: no sync
    assert counter.reads == ["h2d", "h2d", "to_host", "to_host"]
    assert counter.sites == [(kind, "?") for kind in counter.reads]  # not called from megand


# MoE: every routing path (capacity, the sigmoid router's bias update, shared experts) keeps its
# statistics on the device
MOE = ["model=moe_tiny", "model.moe_router=sigmoid", "model.moe_capacity_factor=1.0", "model.moe_shared_experts=1"]
# where the loop over experts (CPU, and fp32/fp16 on a GPU) reads its split points (through the one seam of
# the model's host reads): once per MoE layer and micro-batch, for both GEMMs (the fused grouped GEMM reads
# nothing)
SPLIT_SIZE_READ = "megand/core/host_reads.py"


@pytest.mark.parametrize("experiment, extra", [("tiny_llama", []), ("tiny_gpt", []), ("tiny_llama", MOE)],
                         ids=["tiny_llama", "tiny_gpt", "moe"])
def test_one_host_read_per_step_between_log_lines(one_process_world, experiment, extra):  # noqa: F811
    from megand.core.transformer.moe import moe_layers
    from megand.training.pretrain import Trainer

    cfg = compose([f"+experiment={experiment}", *extra, "model.num_layers=2", "train.iters=8", "train.log_interval=4",
                   "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
                   f"run_dir={one_process_world / 'run'}"])
    trainer = Trainer(cfg)
    trainer.step()  # first step: lazy initialisation is not the steady state
    # AdamW's step counters are host tensors here (torch's foreach AdamW reads them for its bias
    # corrections); reading host memory waits for no device
    counters = [x.step for x in trainer.optimizer.pieces if x.step.device.type == "cpu"]
    per_step = []
    for _ in range(2):
        with HostReads(host_tensors=counters) as counter:
            loss, result = trainer.step()
        per_step.append(counter.sites)
    split_reads = len(moe_layers(trainer.chunks)) * 2  # MoE layers x micro-batches
    for sites in per_step:
        step_reads = [site for site in sites if not site[1].startswith(SPLIT_SIZE_READ)]
        assert [(kind, where.split(":")[0]) for kind, where in step_reads] == [("tolist", "megand/core/metrics.py")], \
            sites  # the agreed loss, grad norm and skip flags
        assert [kind for kind, where in sites if where.startswith(SPLIT_SIZE_READ)] == ["tolist"] * split_reads, sites
    assert loss > 0 and result.grad_norm > 0 and not result.skipped


@pytest.mark.parametrize("extra", [[], MOE], ids=["dense", "moe"])
def test_a_log_line_reads_once_whatever_the_world_size(one_process_world, extra):  # noqa: F811
    """The per-rank figures of a log line (memory, busy time, MoE statistics) are gathered into one tensor
    and read once, not one read per rank and figure."""
    from megand.training.pretrain import Trainer

    cfg = compose(["+experiment=tiny_llama", *extra, "model.num_layers=2", "train.iters=8", "train.log_interval=1",
                   "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
                   f"run_dir={one_process_world / 'run'}"])
    trainer = Trainer(cfg)
    loss, result = trainer.step()
    with HostReads() as counter:
        trainer.log(loss, result, 0.1)
    assert [kind for kind, _ in counter.sites] == ["tolist"], counter.sites
