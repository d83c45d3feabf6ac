"""Pretrain a GPT or LLaMA model: `torchrun --nproc-per-node=N pretrain_gpt.py +experiment=NAME key=value ...`."""

import sys

import hydra

from megand.training.config import ConfigError, register_schema

register_schema()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg) -> None:
    from megand.core.checkpointing import CheckpointError, CheckpointWriteError
    from megand.training.guards import EXIT_NON_FINITE, NonFiniteStop
    from megand.training.pretrain import pretrain

    try:
        pretrain(cfg)
    except ConfigError as e:
        print(f"megand: invalid configuration: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except CheckpointError as e:  # raised by every rank alike, before training
        print(f"megand: cannot load checkpoint: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except CheckpointWriteError as e:  # raised by every rank alike; the previous checkpoint is intact
        print(f"megand: cannot save checkpoint: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except NonFiniteStop as e:  # raised by every rank alike
        print(f"megand: training stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_NON_FINITE)


if __name__ == "__main__":
    main()
