"""Soak run: a long job that survives faults and ends where an uninterrupted run ends.

    python benchmarks/soak_faults.py --out /tmp/soak            # 4 ranks, tp=2 x dp=2, quickstart corpus

Runs the quickstart model (4 CPU ranks, tp=2 x dp=2, sequence parallel) for ``--iters`` steps twice:
once uninterrupted, once under ``torchrun --max-restarts=3`` with the same command resuming by itself
(checkpoint.load == checkpoint.save) while three faults hit it at random moments (``--seed``): two ranks
killed (SIGKILL) and one rank stopped (SIGSTOP; the others' hang watchdog exits them, the agent
restarts the job; the stopped rank is continued with SIGCONT once the restart is under way). Prints
each fault (rank, iteration reached, iteration resumed from, steps recomputed) and compares the
final losses, then one JSON line.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPROC = 4


def command(run_dir, overrides, restarts):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}"]
    if restarts:
        launcher.append(f"--max-restarts={restarts}")
    return [*launcher, os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}


def losses(run_dir) -> dict[int, float]:
    """iteration -> the loss of the last time it was computed."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                out[r["iter"]] = r["loss"]
    return out


def logged_iters(run_dir) -> list[int]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(x)["iter"] for x in f if '"loss"' in x]
    except (FileNotFoundError, ValueError):
        return []


def workers(agent_pid) -> dict[int, int]:
    """Global rank -> pid of the agent's current workers."""
    try:
        with open(f"/proc/{agent_pid}/task/{agent_pid}/children") as f:
            pids = [int(p) for p in f.read().split()]
    except OSError:
        return {}
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env_vars = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            found[int(env_vars[b"RANK"])] = pid
        except (OSError, KeyError, ValueError):
            pass
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/megand_soak")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--interval", type=int, default=25, help="checkpoint.interval")
    ap.add_argument("--timeout", type=float, default=20, help="train.collective_timeout_s (hang watchdog)")
    ap.add_argument("--seed", type=int, default=None, help="draws the fault moments and ranks (default: random)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    common = ["+experiment=quickstart", f"train.iters={args.iters}", "train.log_interval=1",
              f"data.cache_dir={args.out}/data_cache"]

    t0 = time.monotonic()
    reference_dir = os.path.join(args.out, "uninterrupted")
    subprocess.run(command(reference_dir, common, 0), env=env(), cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reference_s = time.monotonic() - t0
    reference = losses(reference_dir)

    run_dir, save = os.path.join(args.out, "faults"), os.path.join(args.out, "ckpt")
    overrides = [*common, f"checkpoint.save={save}", f"checkpoint.load={save}", f"checkpoint.interval={args.interval}",
                 "checkpoint.keep_last=2", f"train.collective_timeout_s={args.timeout}"]
    log_path = os.path.join(args.out, "faults.log")
    log = open(log_path, "w")
    t0 = time.monotonic()
    agent = subprocess.Popen(command(run_dir, overrides, 3), env=env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    kinds = ["kill", "kill", "stop"]
    rng.shuffle(kinds)
    # three moments spread over the run: one in each third (at least two intervals apart)
    thirds = [(args.iters * k // 3, args.iters * (k + 1) // 3) for k in range(3)]
    moments = [rng.randint(lo + args.interval, hi - args.interval // 2) for lo, hi in thirds]
    faults = []
    for kind, moment in zip(kinds, moments):
        while agent.poll() is None and (not logged_iters(run_dir) or logged_iters(run_dir)[-1] < moment
                                        or len(workers(agent.pid)) < NPROC):
            time.sleep(0.05)
        if agent.poll() is not None:
            break
        before = workers(agent.pid)
        rank = rng.randrange(NPROC)
        reached = logged_iters(run_dir)[-1]
        fault = {"kind": kind, "rank": rank, "iteration_reached": reached, "at_s": round(time.monotonic() - t0, 1)}
        if kind == "kill":
            os.kill(before[rank], signal.SIGKILL)
        else:
            os.kill(before[rank], signal.SIGSTOP)
            stopped_at = time.monotonic()
            # the others' watchdog exits them; the agent then restarts every worker
            while agent.poll() is None and set(workers(agent.pid).values()) & set(before.values()) - {before[rank]}:
                time.sleep(0.1)
            fault["others_exited_after_s"] = round(time.monotonic() - stopped_at, 1)
            try:
                os.kill(before[rank], signal.SIGCONT)
            except ProcessLookupError:
                pass
        faults.append(fault)
        # wait for the restarted workers to resume and log a step
        while agent.poll() is None and not set(workers(agent.pid).values()).isdisjoint(before.values()):
            time.sleep(0.1)
        n = len(logged_iters(run_dir))
        while agent.poll() is None and len(logged_iters(run_dir)) <= n:
            time.sleep(0.1)
    code = agent.wait()
    faulty_s = time.monotonic() - t0
    log.close()
    text = open(log_path).read()
    resumed = [int(m) for m in re.findall(r"loaded checkpoint \S+ at iteration (\d+)", text)]
    hangs = len(re.findall(r"hang detected", text))
    for fault, start in zip(faults, resumed):
        fault["resumed_from"] = start
        fault["steps_recomputed"] = fault["iteration_reached"] - start
    final = losses(run_dir)
    differ = sorted(i for i in reference if final.get(i) != reference[i])
    print(f"soak: quickstart, {NPROC} ranks (tp=2 x dp=2), {args.iters} iterations, checkpoint.interval="
          f"{args.interval}, torchrun --max-restarts=3, seed {seed}")
    for k, f in enumerate(faults, 1):
        extra = f", the other ranks exited {f['others_exited_after_s']} s later (watchdog)" if "others_exited_after_s" in f else ""
        print(f"  fault {k}: {f['kind']} rank {f['rank']} at iteration {f['iteration_reached']} ({f['at_s']} s){extra}; "
              f"resumed from {f.get('resumed_from')}, {f.get('steps_recomputed')} steps recomputed")
    print(f"  job exit code {code}; {len(resumed)} restarts; {hangs} watchdog reports; uninterrupted {reference_s:.0f} s, "
          f"with faults {faulty_s:.0f} s")
    print(f"  final loss {final.get(args.iters)!r} vs uninterrupted {reference.get(args.iters)!r}: "
          f"{'equal' if final.get(args.iters) == reference.get(args.iters) else 'DIFFERENT'}; iterations whose loss differs: "
          f"{len(differ)} of {len(reference)}")
    print(json.dumps({"soak": {"seed": seed, "exit_code": code, "faults": faults, "final_loss": final.get(args.iters),
                               "uninterrupted_final_loss": reference.get(args.iters), "iterations_differing": differ,
                               "log": log_path}}))
    sys.exit(0 if code == 0 and not differ and len(faults) == 3 else 1)


if __name__ == "__main__":
    main()
