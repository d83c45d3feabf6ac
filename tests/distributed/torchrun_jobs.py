"""Launch pretrain_gpt.py under torchrun from a test and act on its ranks from outside: find a rank's
process, signal it, wait for the metrics to advance, read the job's output as it comes."""

import os
import signal
import subprocess
import sys
import threading
import time

from megand.tools.spawn import free_port
from tests.harness import ranks_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Job:
    """A torchrun job (one agent by default) whose output is collected line by line with arrival times."""

    def __init__(self, run_dir, overrides, nproc, launcher_args=(), nnodes=1, launcher=("-m", "torch.distributed.run"),
                 preexec_fn=None, rendezvous=None, node_env=None):
        """``launcher``: the agent's command after the interpreter (torchrun's module, or tools/launch.py);
        ``rendezvous``: the agents' rendezvous arguments (default: standalone, or static over ``nnodes``);
        ``node_env``: per node, environment variables of its agent (e.g. its own node-local directory)."""
        self.lines: list[tuple[float, str]] = []
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ranks_env(nproc * nnodes)}
        script = [os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides]
        self.agents = []
        for node in range(nnodes):
            args = (rendezvous if rendezvous is not None else ["--standalone"] if nnodes == 1 else
                    [f"--nnodes={nnodes}", f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}"])
            cmd = [sys.executable, *launcher, *args, f"--nproc-per-node={nproc}",
                   *launcher_args, *script]
            agent = subprocess.Popen(cmd, env={**env, **(node_env[node] if node_env else {})}, cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, preexec_fn=preexec_fn)
            threading.Thread(target=self._read, args=(agent,), daemon=True).start()
            self.agents.append(agent)
        self.run_dir = run_dir

    def _read(self, agent):
        for line in agent.stdout:
            self.lines.append((time.monotonic(), line))

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def ranks(self) -> dict[int, int]:
        """Global rank -> pid of the current workers of every agent."""
        found = {}
        for agent in self.agents:
            for pid in children(agent.pid):
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                    found[int(env[b"RANK"])] = pid
                except (OSError, KeyError, ValueError):
                    pass
        return found

    def wait_for(self, predicate, timeout=300):
        deadline = time.time() + timeout
        while not predicate():
            if all(a.poll() is not None for a in self.agents):
                raise AssertionError(f"job ended early:\n{self.output[-4000:]}")
            if time.time() > deadline:
                self.kill()
                raise AssertionError(f"timed out:\n{self.output[-4000:]}")
            time.sleep(0.1)

    def wait(self, timeout=600) -> int:
        """The job's exit code (the worst agent's)."""
        try:
            codes = [a.wait(timeout=timeout) for a in self.agents]
        finally:
            self.kill()
        time.sleep(0.2)  # let the reader threads drain
        return max(codes, key=abs)

    def kill(self, nodes=None):
        """SIGKILL the agents of ``nodes`` (default: all) and their workers."""
        for node, agent in enumerate(self.agents):
            if agent.poll() is None and (nodes is None or node in nodes):
                pids = children(agent.pid) + [agent.pid]
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def children(pid) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def metric_iters(run_dir) -> list[int]:
    import json

    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(x)["iter"] for x in f if '"loss"' in x]
    except (FileNotFoundError, ValueError):
        return []
