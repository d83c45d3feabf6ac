"""The hang summary from per-rank reports (the flight recorder's entries as torch dumps them): the ranks
that did not reach the collective the others wait in, by sequence number or by a missing report."""

from megand.training.hang_report import summarize


def entry(group, seq, op="all_reduce", sizes=((4,),)):
    return {"process_group": [group, "undefined"], "pg_id": int(group), "collective_seq_id": seq, "p2p_seq_id": 0,
            "is_p2p": False, "profiling_name": f"gloo:{op}", "input_sizes": [list(s) for s in sizes],
            "input_dtypes": ["Float"], "retired": False}


def report(rank, world, groups, entries, completed):
    return {"rank": rank, "world_size": world, "iteration": 7, "phase": "gradient reduction", "groups": groups,
            "recorder": {"entries": entries, "pg_status": {g: {"last_completed_collective": str(c)}
                                                             for g, c in completed.items()}}}


def test_names_the_rank_behind_and_the_missing_one():
    groups = {"1": [0, 1, 2, 3], "2": [0, 1], "3": [2, 3]}
    reports = {
        0: report(0, 4, groups, [entry("2", 5), entry("1", 9, "all_gather", ((8, 4),))], {"1": 8, "2": 5}),
        1: report(1, 4, groups, [entry("2", 5), entry("1", 8, "all_gather", ((8, 4),))], {"1": 8, "2": 5}),
        2: report(2, 4, groups, [entry("3", 3), entry("1", 9, "all_gather", ((8, 4),))], {"1": 8, "3": 3}),
    }
    lines = summarize(reports)
    assert lines[0] == ("hang reports of 3 of 4 ranks; no report from rank(s) [3] (stopped, dead, or their run "
                        "directory is elsewhere)")
    waits = [line for line in lines if line.startswith("process group")]
    assert waits == [
        "process group 1 (ranks [0, 1, 2, 3]): rank(s) [0, 2] wait in collective #9, all_gather of sizes [[8, 4]] "
        "(Float); not reached by: rank 1 (last entered #8: all_gather of sizes [[8, 4]] (Float)), rank 3 (no report)"]
    assert lines[-1] == "ranks the others wait for: [1, 3]"


def test_nothing_pending_names_nobody():
    groups = {"1": [0, 1]}
    reports = {r: report(r, 2, groups, [entry("1", 4)], {"1": 4}) for r in (0, 1)}
    assert [line for line in summarize(reports) if "wait" in line] == []


def test_a_rank_held_in_an_earlier_collective_is_not_the_one_waited_for():
    # rank 1 stopped mid all-reduce #5: rank 0 got its share and went on into #6, rank 2 still waits in #5
    groups = {"1": [0, 1, 2]}
    reports = {0: report(0, 3, groups, [entry("1", 5), entry("1", 6)], {"1": 5}),
               2: report(2, 3, groups, [entry("1", 4), entry("1", 5)], {"1": 4})}
    lines = summarize(reports)
    assert [line for line in lines if line.startswith("process group")] == [
        "process group 1 (ranks [0, 1, 2]): rank(s) [0] wait in collective #6, all_reduce of sizes [[4]] (Float); "
        "not reached by: rank 1 (no report), rank 2 (waits in #5: all_reduce of sizes [[4]] (Float))"]
    assert lines[-1] == "ranks the others wait for: [1]"


def test_ranks_that_all_wait_are_named_when_no_other_is_behind():
    # every member reported and waits: rank 1 in #5, which ranks 0 and 2 left (a lost transfer)
    groups = {"1": [0, 1, 2]}
    reports = {0: report(0, 3, groups, [entry("1", 6)], {"1": 5}), 1: report(1, 3, groups, [entry("1", 5)], {"1": 4}),
               2: report(2, 3, groups, [entry("1", 6)], {"1": 5})}
    assert summarize(reports)[-1] == "ranks the others wait for: [1]"
