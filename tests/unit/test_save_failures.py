"""The failed-save policy: reported every time, training goes on, the run stops after
checkpoint.max_failed_saves failures in a row or on a failed final save (never with continue_on_error)."""

import pytest

from megand.training.save_failures import SaveFailures, SaveFailureStop


def policy(max_failed=3, continue_on_error=False):
    reports = []
    return SaveFailures(max_failed, continue_on_error, lambda record, line, alert: reports.append(record)), reports


def test_stops_after_max_failed_in_a_row_only():
    failures, reports = policy(max_failed=2)
    failures.failed(2, OSError("disk full"), final=False)
    failures.succeeded()  # a good save in between resets the count
    failures.failed(4, OSError("disk full"), final=False)
    with pytest.raises(SaveFailureStop, match=r"2 consecutive saves failed \(checkpoint.max_failed_saves=2\); "
                                              r"the last one: disk full"):
        failures.failed(6, OSError("disk full"), final=False)
    assert [(r["iter"], r["failed_saves_in_a_row"], r["failed_saves_total"], r["run_stops"]) for r in reports] == [
        (2, 1, 1, False), (4, 1, 2, False), (6, 2, 3, True)]
    assert all(r["event"] == "checkpoint_save_failed" and r["error"] == "disk full" for r in reports)


def test_final_save_failure_stops_unless_continue_on_error():
    with pytest.raises(SaveFailureStop, match="the final save failed"):
        policy()[0].failed(10, OSError("read-only"), final=True)
    tolerant, reports = policy(max_failed=1, continue_on_error=True)
    for it in (2, 4, 6):
        tolerant.failed(it, OSError("x"), final=it == 6)
    assert [r["run_stops"] for r in reports] == [False, False, False]
