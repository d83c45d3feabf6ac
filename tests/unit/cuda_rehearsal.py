"""Run many CUDA rehearsals in ONE child process (the runtime stand-in is loaded once, torch imported
once): ``rehearse_cases({name: argv})`` -> ``{name: {"code", "report", "error"}}``."""

import contextlib
import io
import json
import sys

from megand.tools import fake_cuda


def run_cases(argv):
    """The child's entry: ``argv[0]`` is a JSON object {name: argv}; prints one JSON object of results."""
    from megand.tools.rehearse import main

    results = {}
    for name, case in json.loads(argv[0]).items():
        out, err, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([*case, "--device", "cuda", "--json"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
                print(e.code if not isinstance(e.code, int) else "", file=err)
            except Exception as e:  # a crash of the rehearsal itself: reported, the other cases still run
                code = 2
                print(f"{type(e).__name__}: {str(e).splitlines()[0][:2000]}", file=err)
        lines = [x for x in out.getvalue().splitlines() if x.startswith("{")]
        results[name] = {"code": code, "report": json.loads(lines[-1]) if lines else None,
                         "error": "\n".join(x for x in err.getvalue().splitlines() if not x.startswith("rehearse: ")
                                            or "fail" in x or "does not fit" in x or "allowed" in x)}
    sys.stdout.write("\nRESULTS " + json.dumps(results) + "\n")


def rehearse_cases(cases: dict, timeout: float = 900) -> dict:
    proc = fake_cuda.run_child("tests.unit.cuda_rehearsal:run_cases", [json.dumps(cases)], capture_output=True,
                               text=True, timeout=timeout)
    marker = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert proc.returncode == 0 and marker, f"the rehearsal child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(marker[-1][len("RESULTS "):])
