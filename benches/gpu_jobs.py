"""Run GPU jobs side by side, each on its own GPUs and under its own time limit, and always
leave one archive of everything they wrote.

    python3 benches/gpu_jobs.py --archive $OUT/run.tgz --deadline 560 --commit <the commit of the files sent> \
        --job "0|330|pair|python3 tests/gpu/vllm_ddtree_e2e.py --model tests/fixtures/models --out {dir}" \
        --job "1|330|qn|python3 tests/gpu/vllm_ddtree_e2e.py --model tiny-qwen3-next-all-experts --out {dir}" \
        --job "0,1|200|tp2|python3 tests/gpu/vllm_ddtree_e2e.py --reuse {work}/pair/vllm_ddtree_e2e.json ..."

A job is ``GPUS|SECONDS|NAME|COMMAND``: ``GPUS`` becomes ``CUDA_VISIBLE_DEVICES``; ``{dir}`` in the command is
the job's own folder and ``{work}`` the folder of all jobs (a later job can read an earlier one's results).
Jobs start in the order given, each once its GPUs are free of earlier jobs, so jobs on other GPUs run
side by side. A job past its seconds, or still running at ``--deadline``, is killed with its process
group. Whatever happens, every job's folder and log (``NAME.log``: stdout and stderr) go into one
``--archive`` (one file to copy back from the GPU host), and a summary line per job is printed: return code,
seconds, and the last lines of its log.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class Job:
    gpus: List[str]
    seconds: int
    name: str
    command: str
    returncode: Optional[int] = None
    elapsed: float = 0.0
    status: str = "not started"
    done: threading.Event = field(default_factory=threading.Event)


def parse_job(text: str) -> Job:
    parts = text.split("|", 3)
    if len(parts) != 4 or not parts[1].isdigit() or not parts[2]:
        raise argparse.ArgumentTypeError(f"a job is GPUS|SECONDS|NAME|COMMAND, got {text!r}")
    gpus = [g for g in parts[0].split(",") if g]
    if not gpus or not all(g.isdigit() for g in gpus):
        raise argparse.ArgumentTypeError(f"GPUS must be GPU numbers like 0 or 0,1, got {parts[0]!r}")
    if not parts[2].replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"NAME may hold letters, digits, '-' and '_' only, got {parts[2]!r}")
    return Job(gpus, int(parts[1]), parts[2], parts[3])


#: ``prctl`` option: orphaned descendants are re-parented to this process instead of init.
PR_SET_CHILD_SUBREAPER = 36
#: The pids of the jobs' own shells while they run (what is not one of them, among this process's children, was
#: left behind by a job).
_running: set = set()
_running_lock = threading.Lock()


def become_subreaper() -> bool:
    """Makes this process the reaper of its jobs' orphans (Linux), so that what a job started in a session of its
    own (a ``vllm serve`` server started with ``start_new_session``), out of reach of the job's process-group kill,
    is found when the job ends. False where ``prctl`` is not there."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def left_behind() -> List[int]:
    """This process's children that are not a running job's shell: orphans a job left, re-parented here."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # (the field after the state: the parent's pid)
            found.append(int(entry))
    with _running_lock:
        return [pid for pid in found if pid not in _running]


def kill_left_behind(log) -> None:
    """Kills (with their process groups) and reaps what jobs left behind: a server still holding a GPU made the next
    job's engine fail at start-up ("Free memory on device ... is less than desired")."""
    for pid in left_behind():
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        log.write(f"[gpu_jobs] killed pid {pid}, left behind by a job in a session of its own\n")


def run_job(job: Job, work: str, stop_at: float) -> None:
    folder = os.path.join(work, job.name)
    os.makedirs(folder, exist_ok=True)
    command = job.command.replace("{dir}", shlex.quote(folder)).replace("{work}", shlex.quote(work))
    left = stop_at - time.time()
    if left <= 5:
        job.status = "skipped: no time left before the deadline"
        return
    limit = min(job.seconds, left)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(job.gpus), PYTHONUNBUFFERED="1")
    start = time.time()
    with open(os.path.join(work, f"{job.name}.log"), "w") as log:
        log.write(f"$ CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {command}\n")
        log.flush()
        with _running_lock:
            proc = subprocess.Popen(
                command, shell=True, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            _running.add(proc.pid)
        try:
            job.returncode = proc.wait(timeout=limit)
            job.status = "finished"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            job.returncode = proc.returncode
            job.status = f"KILLED after {limit:.0f} s"
        finally:
            with _running_lock:
                _running.discard(proc.pid)
        kill_left_behind(log)
    job.elapsed = time.time() - start


def run_all(jobs: List[Job], work: str, deadline: int) -> None:
    """Starts each job once every earlier job on any of its GPUs has ended."""
    stop_at = time.time() + deadline
    threads = []
    for i, job in enumerate(jobs):
        before = [other for other in jobs[:i] if set(other.gpus) & set(job.gpus)]

        def start(job=job, before=before):
            for other in before:
                other.done.wait()
            try:
                run_job(job, work, stop_at)
            finally:
                job.done.set()

        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def tail(path: str, lines: int) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return ""


def commit_lines(stated: str) -> str:
    """What ``commit.txt`` says of the code: this copy's git HEAD and, given ``--commit``, the caller's commit, with a
    warning line when the HEAD does not start with it (the files are the caller's; the git metadata may be older)."""
    head = subprocess.run(["git", "log", "-1", "--format=%H %cd"], capture_output=True, text=True).stdout.strip()
    lines = [f"git HEAD here: {head or '(none)'}"]
    if stated:
        lines.append(f"commit stated by the caller: {stated}")
        if not head.startswith(stated):
            lines.append("WARNING: the stated commit is not this copy's git HEAD; the files are the caller's")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", action="append", type=parse_job, required=True, help="GPUS|SECONDS|NAME|COMMAND")
    ap.add_argument("--archive", required=True, help="the .tgz to write (e.g. $OUT/run.tgz)")
    ap.add_argument("--deadline", type=int, required=True, help="seconds until every job still running is killed")
    ap.add_argument("--tail", type=int, default=8, help="log lines per job in the summary")
    ap.add_argument(
        "--commit",
        default="",
        help="the commit the caller's files are at (recorded beside this copy's git HEAD, which a host that receives "
        "the working tree without fresh git metadata may report stale)",
    )
    args = ap.parse_args()
    names = [job.name for job in args.job]
    if len(set(names)) != len(names):
        ap.error(f"job names must differ, got {names}")
    work = tempfile.mkdtemp(prefix="gpu_jobs_")
    with open(os.path.join(work, "commit.txt"), "w") as handle:
        handle.write(commit_lines(args.commit))
        handle.write(time.strftime("run at %Y-%m-%d %H:%M:%S %Z\n"))
    try:
        become_subreaper()
        run_all(args.job, work, args.deadline)
    finally:
        os.makedirs(os.path.dirname(os.path.abspath(args.archive)), exist_ok=True)
        with tarfile.open(args.archive, "w:gz") as archive:
            archive.add(work, arcname=".")
    for job in args.job:
        rc = "-" if job.returncode is None else job.returncode
        print(f"== {job.name} (GPUs {','.join(job.gpus)}): {job.status}, rc {rc}, {job.elapsed:.0f} s")
        print(tail(os.path.join(work, f"{job.name}.log"), args.tail), end="")


if __name__ == "__main__":
    main()
