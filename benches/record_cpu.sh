#!/usr/bin/env bash
# Runs the CPU benchmarks and records them with the commit and the machine:
#   bash benches/record_cpu.sh            -> benches/results/cpu-<commit>/ (README.md, and JSON of each run)
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse --short HEAD)
dir="benches/results/cpu-${commit}"
out="${dir}/README.md"
mkdir -p "$dir"
{
  echo "# CPU benchmarks at ${commit}"
  echo
  echo "- date: $(date -u +%F)"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem/ {print $2}') GiB"
  echo "- load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ -n "$(git status --porcelain -- . ':!benches/results')" ]; then echo "- working tree: uncommitted changes present"; fi
  echo
  echo "## python benches/bench_python.py --repeat 15 (serial)"
  echo '```'
  .venv/bin/python benches/bench_python.py --repeat 15 --json "$dir/bench_python_serial.json"
  echo '```'
  echo
  echo "## python benches/bench_python.py --repeat 15 --threads 2 --budgets 64 256"
  echo '```'
  .venv/bin/python benches/bench_python.py --repeat 15 --threads 2 --budgets 64 256 --json "$dir/bench_python_threads2.json"
  echo '```'
  echo
  echo "## cargo bench --bench tree (criterion; time per call, throughput in tree nodes)"
  echo '```'
  # Criterion's comparisons with an earlier run (lines with %) are left out.
  cargo bench --bench tree -- --noplot 2>/dev/null | grep -E '^(build|build\+compile\+accept)/|time:|thrpt:' | grep -v '%'
  echo '```'
} | tee "$out"
echo "recorded in $out" >&2
