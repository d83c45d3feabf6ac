"""The keys of long runs (guards, watchdog, exits, retention) are checked before any work."""

import pytest

from megand.training.config import ConfigError, compose, validate


@pytest.mark.parametrize("overrides, message", [
    (["train.max_skipped_steps=0"], r"train.max_skipped_steps=0 must be positive"),
    (["train.collective_timeout_s=-1"], r"train.collective_timeout_s=-1.0 must be positive"),
    (["train.exit_duration_mins=0"], r"train.exit_duration_mins=0.0 must be positive"),
    (["train.exit_interval=0"], r"train.exit_interval=0 must be positive"),
    (["checkpoint.keep_last=0"], r"checkpoint.keep_last=0 must be positive"),
    (["checkpoint.save_timeout_s=0"], r"checkpoint.save_timeout_s=0.0 must be positive"),
    (["train.spike_factor=1"], r"train.spike_factor=1.0 must be greater than 1"),
    (["train.straggler_ratio=0.5"], r"train.straggler_ratio=0.5 must be at least 1"),
    (["train.spike_rollback=true"], r"train.spike_rollback=true needs checkpoints to roll back to: "
                                    r"checkpoint.save=None and checkpoint.interval=0"),
    (["checkpoint.save=/tmp/x", "checkpoint.local_dir=/tmp/l"], r"checkpoint.local_dir=/tmp/l and "
                                                                 r"checkpoint.local_interval=0: the node-local tier needs both"),
    (["checkpoint.local_interval=5"], r"checkpoint.local_dir=None and checkpoint.local_interval=5"),
    (["checkpoint.local_dir=/tmp/l", "checkpoint.local_interval=5"], r"checkpoint.local_dir=/tmp/l is a fast copy "
                                                                     r"of a run that also saves to the shared tier"),
])
def test_invalid_long_run_keys_name_the_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides), 1)


def test_valid_long_run_keys_pass():
    validate(compose(["train.spike_rollback=true", "checkpoint.save=/tmp/x", "checkpoint.interval=5",
                      "checkpoint.keep_last=2", "train.exit_duration_mins=30", "train.collective_timeout_s=60",
                      "checkpoint.local_dir=/tmp/l", "checkpoint.local_interval=1"]), 1)
