"""benches/gpu_jobs.py: jobs on shared GPUs wait for each other, others run side by side, a job past its time
is killed, and the archive holds everything even then."""

import subprocess
import sys
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "gpu_jobs.py"


def test_jobs_order_limits_and_archive(tmp_path):
    archive = tmp_path / "run.tgz"
    start = time.time()
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--archive",
            str(archive),
            "--deadline",
            "20",
            "--job",
            "0|10|first|sleep 1; echo $CUDA_VISIBLE_DEVICES > {dir}/gpus.txt",
            "--job",
            "1|1|stuck|echo started; sleep 30",
            "--job",
            "0,1|10|after|cat {work}/first/gpus.txt > {dir}/seen.txt; echo done",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.time() - start
    assert result.returncode == 0, result.stderr
    assert "== first (GPUs 0): finished, rc 0" in result.stdout
    assert "== stuck (GPUs 1): KILLED after 1 s" in result.stdout and "started" in result.stdout
    assert "== after (GPUs 0,1): finished, rc 0" in result.stdout
    assert elapsed < 15  # the stuck job was killed, not waited for
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert {"./first.log", "./stuck.log", "./after.log", "./commit.txt", "./after/seen.txt"} <= names
        # "after" ran once both GPUs were free, so it saw the first job's file.
        assert tar.extractfile("./after/seen.txt").read().decode().strip() == "0"


def test_bad_job_is_refused_with_the_format(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--archive",
            str(tmp_path / "x.tgz"),
            "--deadline",
            "5",
            "--job",
            "gpu0|10|x|true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "GPUS must be GPU numbers" in result.stderr


def test_commit_txt_records_the_stated_commit_and_warns_when_git_disagrees(tmp_path):
    archive = tmp_path / "run.tgz"
    args = [sys.executable, str(SCRIPT), "--archive", str(archive), "--deadline", "10", "--job", "0|5|x|true"]
    subprocess.run([*args, "--commit", "0000000"], capture_output=True, text=True, timeout=60, check=True)
    with tarfile.open(archive) as tar:
        text = tar.extractfile("./commit.txt").read().decode()
    assert "commit stated by the caller: 0000000" in text and "WARNING" in text
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=SCRIPT.parents[1]).stdout
    subprocess.run(
        [*args, "--commit", head.strip()[:7]],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=SCRIPT.parents[1],
    )
    with tarfile.open(archive) as tar:
        text = tar.extractfile("./commit.txt").read().decode()
    assert f"git HEAD here: {head.strip()}" in text and "WARNING" not in text


def _processes_with(argument: str) -> list:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if argument in (entry / "cmdline").read_bytes().split(b"\0"):
                found.append(entry.name)
        except OSError:
            pass
    return found


def test_what_a_job_leaves_in_a_session_of_its_own_is_killed_when_it_ends(tmp_path):
    """A server started with ``start_new_session`` (vllm_serve_e2e's) escapes the job's process-group kill and kept
    a GPU's memory: the next job's engine could not start. The runner reaps such orphans when their job ends."""
    marker = "313.25"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--archive",
            str(tmp_path / "run.tgz"),
            "--deadline",
            "30",
            "--job",
            f"0|2|server|setsid sleep {marker} & sleep 60",  # killed at 2 s; its server would live on
            "--job",
            f"0|10|next|setsid sleep {marker} & echo spawned",  # ends at once, leaving its server
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "== server (GPUs 0): KILLED after 2 s" in result.stdout
    assert _processes_with(marker.encode()) == []
    with tarfile.open(tmp_path / "run.tgz") as tar:
        for name in ("./server.log", "./next.log"):
            assert "left behind by a job" in tar.extractfile(name).read().decode()
