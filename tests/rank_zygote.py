"""A process that has already imported what a rank imports (torch, Hydra, megand) and forks the test runs'
ranks from itself, so that each rank skips those imports (about 3 CPU-seconds each: half of a tiny run's
cost, and the two cores of CI run several thousand ranks a suite).

A forked rank is what ``python pretrain_gpt.py ...`` would be: its own pid, environment, working directory,
argv, stdout and stderr files, the script run as ``__main__``, exit handlers run, the exit code (or the
killing signal) reported. The zygote itself never runs a tensor operation, so it holds no threads or
device state a child could inherit. Only runs whose environment cannot change what an import does are
forked (see ``tests/harness.py``); the rest start a fresh interpreter as before.

Protocol, one JSON object per line on stdin, one reply per line on stdout:
``{"op": "spawn", "argv": [...], "env": {...}, "cwd": ..., "stdout": path, "stderr": path}`` -> ``{"pid": N}``;
``{"op": "wait", "pid": N, "timeout": S}`` -> ``{"code": C}`` (null while it still runs after S seconds).
"""

import json
import os
import sys
import time


def _preload() -> None:
    import hydra  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import megand.training.pretrain  # noqa: F401


def _run_rank(req: dict) -> None:
    """In the forked child: become ``python argv...`` and exit with its code. Never returns."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        script = req["argv"][0]
        sys.argv = list(req["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _wait(pid: int, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def main() -> None:
    _preload()
    reply = sys.stdout
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _run_rank(req)
            answer = {"pid": pid}
        elif req["op"] == "wait":
            answer = {"code": _wait(req["pid"], req["timeout"])}
        else:
            answer = {"error": f"unknown op {req['op']!r}"}
        print(json.dumps(answer), file=reply, flush=True)


if __name__ == "__main__":
    main()
