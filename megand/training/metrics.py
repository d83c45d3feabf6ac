"""What a run reports: the console line and ``metrics.jsonl``, written by the logging rank only."""

import json
import os


def console_line(m: dict, iters: int) -> str:
    """Megatron's line; a run with multi-token prediction adds ``mtp loss`` (its depths' mean) after ``lm loss``."""
    mtp = f"mtp loss {m['mtp_loss']:.3E} | " if "mtp_loss" in m else ""
    return (f" iteration {m['iter']}/{iters} | consumed samples {m['consumed_samples']} | "
            f"elapsed time per iteration (ms): {m['iter_time_ms']:.1f} | learning rate {m['lr']:.3E} | "
            f"global batch size {m['global_batch_size']} | lm loss {m['loss']:.3E} | {mtp}loss scale {m['loss_scale']:.1f} | "
            f"grad norm {m['grad_norm']:.3f} | tokens/s {m['tokens_per_s']:.0f} | TFLOP/s {m['tflops_per_s']:.3g} | "
            f"skipped {m['skipped']} |")


class MetricsWriter:
    def __init__(self, run_dir: str, enabled: bool, append: bool = False):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self.file = open(self.path, "a" if append else "w")

    def write(self, record: dict) -> None:
        if self.enabled:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
