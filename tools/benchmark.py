"""Benchmark a training config for a fixed number of steps after warm-up; print one JSON line.

The config is the training config (Hydra overrides, as for ``pretrain_gpt.py``):

    python tools/benchmark.py --mode both model=llama_50m train.micro_batch_size=4 --steps 5 --warmup 2
    torchrun --nproc-per-node=8 tools/benchmark.py --mode megand model=llama_8b parallel.tp=8 \\
        parallel.sequence_parallel=true train.micro_batch_size=1 --steps 10

Modes (same keys: tokens_per_s, tflops_per_s per rank, mfu, mem_peak_bytes (max over ranks),
step_time_median_s and spread, ...):
- ``megand``: ``megand.training.pretrain.Trainer`` built in-process, timed ``train_step()`` calls; one
  micro-batch per data-parallel rank per step unless ``train.global_batch_size`` is given.
- ``baseline``: the same model shape trained by a plain single-process PyTorch/transformers loop.
- ``both``: megand, then the baseline in the same process (rank 0); adds ``baseline`` (its result) and
  ``overhead_ratio`` = baseline tokens/s / megand tokens/s (1.0: no framework overhead).
On CUDA the default precision is bf16 (``train.precision``) and MFU is against the GPU's peak; on CPU,
fp32 against a measured matmul peak.
"""

from megand.tools.benchmark import main

if __name__ == "__main__":
    main()
