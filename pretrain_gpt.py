"""Pretrain a GPT or LLaMA model: `torchrun --nproc-per-node=N pretrain_gpt.py +experiment=NAME key=value ...`."""

import os
import sys

import megand

megand.prefer_huge_pages()  # before anything imports torch

import hydra  # noqa: E402

from megand.training.config import ConfigError, register_schema  # noqa: E402
from megand.training.peers import EXIT_PEER_LOST, peer_lost  # noqa: E402

register_schema()


def report(e: BaseException, what: str) -> None:
    """One line on stderr; an error every rank raised alike (``every_rank``) is printed by rank 0 only."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or not getattr(e, "every_rank", False):
        print(f"megand: {what}: {e}", file=sys.stderr, flush=True)


def model_adoption(cfg):
    """With checkpoint.load and no model given, train the checkpoint's model (see training/checkpoint_model.py):
    the step the trainer runs once it knows which state the run starts from (Hydra's record of what the
    command line set is read here, where it exists)."""
    from hydra.core.hydra_config import HydraConfig

    from megand.training.checkpoint_model import adopt_checkpoint_model

    hydra_cfg = HydraConfig.get()
    overrides, choice = list(hydra_cfg.overrides.task), hydra_cfg.runtime.choices.get("model")

    def adopt(saved: dict | None) -> None:
        taken = adopt_checkpoint_model(cfg, overrides, choice, saved)
        if taken and int(os.environ.get("RANK", "0")) == 0:
            print(f" model from checkpoint {cfg.checkpoint.load}: "
                  + ", ".join(f"{k}={cfg.model[k]}" for k in taken), flush=True)

    return adopt


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg) -> None:
    from megand.core.checkpointing import CheckpointError
    from megand.data.errors import DataError
    from megand.training.guards import EXIT_NON_FINITE, NonFiniteStop
    from megand.training.pretrain import pretrain
    from megand.training.save_failures import EXIT_SAVE_FAILED, SaveFailureStop

    # every user-facing failure is one line and exit code 2; anything else is a bug, with its traceback
    try:
        pretrain(cfg, adopt_model=model_adoption(cfg))
    except ConfigError as e:
        report(e, "invalid configuration")
        sys.exit(2)
    except CheckpointError as e:
        report(e, "cannot load checkpoint")
        sys.exit(2)
    except DataError as e:
        report(e, "bad training data")
        sys.exit(2)
    except OSError as e:
        report(e, "file system error")
        sys.exit(2)
    except SaveFailureStop as e:  # raised by every rank alike; `latest` names the last good checkpoint
        report(e, "checkpoint saves failed")
        sys.exit(EXIT_SAVE_FAILED)
    except NonFiniteStop as e:  # raised by every rank alike
        report(e, "training stopped")
        sys.exit(EXIT_NON_FINITE)
    except RuntimeError as e:  # a peer rank died: one line on each survivor, and the launcher restarts the job
        lost = peer_lost(e)
        if lost is None:
            raise
        print(f"megand: rank {os.environ.get('RANK', '0')} stopped: {lost}", file=sys.stderr, flush=True)
        sys.exit(EXIT_PEER_LOST)


if __name__ == "__main__":
    main()
