"""What a failed checkpoint save does to the run: it is reported and training goes on.

A save that fails (the writer's error, a full disk, a read-only directory, a save over
``checkpoint.save_timeout_s``) has left the previous checkpoint and ``latest`` as they were and removed its
partial files (the checkpointer sees to that); the next interval tries again. Each failure is reported on
the console, as an event in ``metrics.jsonl`` and as a wandb alert. The run stops (exit code
:data:`EXIT_SAVE_FAILED`) only after ``checkpoint.max_failed_saves`` consecutive failures, or when the
final save fails (the run's work since the last good checkpoint would be lost silently otherwise);
``checkpoint.continue_on_error=true`` never stops it. Every rank holds the same counts: the checkpointer
agrees on each save's outcome.
"""

from __future__ import annotations

EXIT_SAVE_FAILED = 5  # the process exit code when the run stops on failed checkpoint saves


class SaveFailureStop(RuntimeError):
    """Too many consecutive failed saves, or a failed final save; ``latest`` names the last good checkpoint."""

    every_rank = True  # every rank raises it alike: the entry script prints it once


class SaveFailures:
    def __init__(self, max_failed: int, continue_on_error: bool, report):
        """``report(record, console_line, alert)``: the run's logging (logging rank: metrics.jsonl, console, wandb)."""
        self.max_failed, self.continue_on_error, self.report = max_failed, continue_on_error, report
        self.consecutive = 0
        self.total = 0

    def succeeded(self) -> None:
        self.consecutive = 0

    def failed(self, iteration: int, error: Exception, final: bool) -> None:
        """Report the failed save of ``iteration``; raise :class:`SaveFailureStop` when the run must stop."""
        self.consecutive += 1
        self.total += 1
        stops = not self.continue_on_error and (final or self.consecutive >= self.max_failed)
        if stops:
            why = ("the final save failed" if final else
                   f"{self.consecutive} consecutive saves failed (checkpoint.max_failed_saves={self.max_failed})")
            then = f"the run stops (exit code {EXIT_SAVE_FAILED}): {why}"
        elif final:
            then = "the run ends without it (checkpoint.continue_on_error=true)"
        else:
            then = (f"training continues, the next save is at the next interval (failure {self.consecutive} in a "
                    + (f"row of at most checkpoint.max_failed_saves={self.max_failed})" if not self.continue_on_error
                       else "row; checkpoint.continue_on_error=true)"))
        record = {"iter": iteration, "event": "checkpoint_save_failed", "error": str(error),
                  "failed_saves_in_a_row": self.consecutive, "failed_saves_total": self.total, "final": final,
                  "run_stops": stops}
        self.report(record, f" WARNING: checkpoint save at iteration {iteration} failed, {then}: {error}",
                    f"checkpoint save at iteration {iteration} failed ({then})")
        if stops:
            raise SaveFailureStop(f"{why}; the last one: {error}")
