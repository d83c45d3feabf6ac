"""FP8 recipes are records (megand/core/tensor_parallel/fp8_recipes/): the configuration, the layers, the
memory estimator and the CUDA rehearsal's kernel rule read the record, and the estimator counts the
step's FP8 weight cache a recipe's record declares, equal to the bytes a training step holds."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megand.core.tensor_parallel import fp8_recipes
from megand.core.tensor_parallel.fp8 import Fp8Policy, quantize
from megand.core.tensor_parallel.fp8_recipes import RECIPES, fp8_recipe, kernel_recipe, rowwise
from megand.core.tensor_parallel.fp8_recipes.record import Fp8Recipe
from megand.core.tensor_parallel.fp8_recipes.scaling import E4M3
from megand.training import peak
from megand.training.config import ConfigError, compose

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
FP8 = ["train.precision=bf16", "train.fp8_bf16_layers=0", "model.num_layers=2", "train.iters=1",
       "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2"]
MOE = ["model=moe_tiny", "model.moe_shared_experts=1"]


@pytest.fixture
def one_process_world(tmp_path, monkeypatch):
    for name in DIST_ENV:  # init_distributed sets these for a one-process world: restore them afterwards
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda *a, **k: 50e9)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield tmp_path
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("experiment, extra, recipe", [
    ("tiny_llama", [], "tensorwise"), ("tiny_gpt", [], "tensorwise"), ("tiny_llama", MOE, "tensorwise"),
    ("tiny_llama", [], "rowwise")], ids=["llama", "gpt", "moe", "rowwise"])
def test_estimated_fp8_weight_cache_is_what_a_step_holds(one_process_world, monkeypatch, experiment, extra, recipe):
    """The FP8 weights a training step keeps quantised (``weights_cached``, read at the end of its last
    backward) are the estimator's ``fp8_cache_bytes`` (one byte per element and copy; the SwiGLU fc1 twice)
    plus one fp32 scale per copy; a recipe whose record keeps no cache holds none and is estimated at 0."""
    from megand.tools.estimate_memory import Layout, estimate_memory
    from megand.training.pretrain import Trainer

    cfg = compose([f"+experiment={experiment}", *extra, *FP8, f"train.fp8={recipe}",
                   f"run_dir={one_process_world / 'run'}"])
    held = []
    original = Trainer.fp8_weights

    @contextlib.contextmanager
    def measured(self):
        with original(self):
            yield
            caches = [m.gemm.cache for chunk in self.chunks for m in chunk.modules()
                      if isinstance(getattr(m, "gemm", None), Fp8Policy) and m.gemm.cache]
            held.append((sum(q.data.nbytes for c in caches for q in c.values()),
                         sum(q.scale.nbytes for c in caches for q in c.values()), sum(len(c) for c in caches)))

    monkeypatch.setattr(Trainer, "fp8_weights", measured)
    Trainer(cfg).step()
    (data, scales, copies), = held
    layout = Layout.from_config({**dict(cfg.parallel), "dp": 1}, dict(cfg.train), dict(cfg.optim))
    estimated = estimate_memory(dict(cfg.model), layout).peak.fp8_cache_bytes
    assert estimated == data
    if fp8_recipe(recipe).weight_cache_bytes:
        assert data > 0 and scales == 4 * copies
    else:
        assert data == scales == 0


def test_a_new_recipe_is_one_record(monkeypatch, tmp_path):
    """A recipe registered as a record (here rowwise scaling with e4m3 output gradients) is accepted by the
    configuration, runs in the layers (forward as rowwise, its own gradient format) and is read by the
    estimator and the planner, none of which names it."""
    from megand.core.tensor_parallel.fp8 import NO_KERNELS, scaled_mm
    from megand.tools.estimate_memory import Layout, estimate_memory
    from megand.tools.planner.cost import _add_sharded_comm  # noqa: F401 (imports the planner's reader)
    from megand.training.config import check_fp8

    toy = Fp8Recipe(name="rowwise_e4m3", granularity="row", quantize=rowwise.RECIPE.quantize, grad_dtype=E4M3,
                    kernel="rowwise", kernel_what="FP8 products with per-row scales (SM 9.0+)",
                    kernel_bf16_only=True, kernel_scales=rowwise.RECIPE.kernel_scales)
    monkeypatch.setitem(RECIPES, toy.name, toy)
    cfg = compose(["+experiment=tiny_llama", "train.precision=bf16", "train.fp8=rowwise_e4m3",
                   f"run_dir={tmp_path}"])
    check_fp8(cfg.train)
    policy = Fp8Policy(recipe="rowwise_e4m3")
    assert policy.grad_dtype == E4M3 and Fp8Policy(recipe="rowwise").grad_dtype != E4M3
    x, w = torch.randn(8, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    reference = scaled_mm(quantize(x, "rowwise", E4M3, 1), quantize(w, "rowwise", E4M3, 1).t(), torch.bfloat16,
                          NO_KERNELS)
    assert torch.equal(policy.forward(x, w), reference)
    layout = Layout.from_config({**dict(cfg.parallel), "dp": 2}, dict(cfg.train),
                                {**dict(cfg.optim), "sharding": "optim_grads_params"})
    assert estimate_memory(dict(cfg.model), layout).peak.fp8_cache_bytes == 0  # no cache declared
    with pytest.raises(ConfigError, match="expected null or one of tensorwise, rowwise, mxfp8, rowwise_e4m3"):
        check_fp8(compose(["+experiment=tiny_llama", "train.precision=bf16", "train.fp8=blockwise",
                           f"run_dir={tmp_path}"]).train)


def test_the_rehearsal_names_each_kernel_by_the_record_whose_scales_it_takes():
    e8m0 = torch.ones(4, dtype=torch.float8_e8m0fnu)
    assert kernel_recipe(e8m0).name == "mxfp8"
    assert kernel_recipe(torch.ones(4, 1)).name == "rowwise"
    assert kernel_recipe(torch.ones(())).name == "tensorwise"
    assert [r.kernel for r in RECIPES.values()] == ["tensorwise", "rowwise", "mx"]


def test_unknown_recipe_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="fp8 recipe 'delayed': expected one of tensorwise, rowwise, mxfp8"):
        fp8_recipes.fp8_recipe("delayed")
    with pytest.raises(ValueError, match="granularity 'channel'"):
        Fp8Recipe(name="x", granularity="channel", quantize=None, grad_dtype=E4M3, kernel="rowwise", kernel_what="")
