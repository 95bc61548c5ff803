"""CPU seconds by thread over a process tree, from ``/proc`` (Linux): which threads of an engine's processes were
busy during a timed run.

A bench takes :func:`snapshot` before and after a run and keeps :func:`busiest` of the difference. Threads are
named ``process/thread [tid]`` by their ``comm`` (vLLM titles its engine-core process ``VLLM::EngineCore``; a thread
carries its creator's name unless it sets its own, so the thread id tells a process's threads apart), and a thread
that exited before the second snapshot is not in it. Why: in
``gpu-h200-pair-cad0d30``'s profiles the same micro-operations ran 1.4-1.7x slower in every ddtree engine's process
than in the chain's; a thread busy beside the main one would show here. On a system without ``/proc`` every
snapshot is empty.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

#: Clock ticks per second of ``/proc/*/stat``'s CPU times.
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

Key = Tuple[int, int, str]  # (pid, tid, "process/thread")


def _stat(path: str) -> Tuple[str, List[str]]:
    """``(comm, the fields after it)`` of a ``stat`` file (``comm`` may hold spaces and parentheses)."""
    with open(path) as f:
        text = f.read()
    start, end = text.index("("), text.rindex(")")
    return text[start + 1 : end], text[end + 2 :].split()


def _children(pid: int) -> List[int]:
    """Child processes of ``pid``: ``/proc/<pid>/task/*/children`` where the kernel has it, else a scan of ``ppid``s."""
    found: List[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        return found
    except OSError:
        pass
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                _, fields = _stat(f"/proc/{entry}/stat")
            except OSError:
                continue
            if int(fields[1]) == pid:  # fields[1] is ppid (the 4th field of stat)
                found.append(int(entry))
    return found


def process_tree(root: int) -> List[int]:
    """``root`` and every process below it."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += _children(pid)
    return out


def snapshot(root: int = 0) -> Dict[Key, float]:
    """CPU seconds (user + system) of every thread of ``root``'s process tree (this process when 0)."""
    root = root or os.getpid()
    out: Dict[Key, float] = {}
    if not os.path.isdir("/proc"):
        return out
    for pid in process_tree(root):
        try:
            process, _ = _stat(f"/proc/{pid}/stat")
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # exited meanwhile
        for tid in tids:
            try:
                thread, fields = _stat(f"/proc/{pid}/task/{tid}/stat")
            except OSError:
                continue
            # utime and stime are the 14th and 15th fields of stat: 11th and 12th after comm.
            out[(pid, int(tid), f"{process}/{thread}")] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def busiest(before: Dict[Key, float], after: Dict[Key, float], most: int = 12) -> Dict[str, float]:
    """The ``most`` threads with the most CPU seconds between two snapshots, ``{"process/thread [tid]": s}``
    (threads started in between count from 0)."""
    used = [(after[key] - before.get(key, 0.0), key) for key in after]
    used.sort(key=lambda item: -item[0])
    return {f"{key[2]} [{key[1]}]": round(seconds, 3) for seconds, key in used[:most] if seconds > 0}


def total(before: Dict[Key, float], after: Dict[Key, float]) -> float:
    """CPU seconds of the whole tree between two snapshots."""
    return sum(after[key] - before.get(key, 0.0) for key in after)
