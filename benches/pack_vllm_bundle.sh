#!/usr/bin/env bash
# Re-pack the vLLM bundle of ../shared/gpu/make-vllm-bundle.sh (.carry/gpu1..4) into transfers that fit beside
# this repository's working tree. A device call carries at most 64 MiB including every tracked file, and the
# committed test pair (tests/fixtures/models, ~26 MB) leaves ~37 MB per call; gpu1, gpu2 and gpu4 are larger.
#
#   bash benches/pack_vllm_bundle.sh          # writes .carry/ship/bundle.tar.00 .. .05
# Then one device call per chunk, in a row (the host keeps /tmp while it stays up, ~30 s idle):
#   carry .carry/ship/bundle.tar.NN, run: mkdir -p /tmp/ship && cp .carry/ship/bundle.tar.NN /tmp/ship/
# and with the last chunk:
#   mkdir -p /tmp/stash && cat /tmp/ship/bundle.tar.* | tar -x -C /tmp/stash && bash /tmp/stash/gpu-setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CHUNK=${CHUNK:-37000000}
for part in gpu1 gpu2 gpu3 gpu4; do
  [ -d ".carry/$part" ] || { echo "missing .carry/$part: run bash ../shared/gpu/make-vllm-bundle.sh first" >&2; exit 1; }
done
tree_bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
if [ $((tree_bytes + CHUNK)) -gt $((64 * 1024 * 1024)) ]; then
  echo "tracked files ($tree_bytes bytes) + a chunk ($CHUNK) exceed 64 MiB: lower CHUNK" >&2; exit 1
fi
rm -rf .carry/ship && mkdir -p .carry/ship
tar -cf - -C .carry/gpu1 . -C ../gpu2 . -C ../gpu3 . -C ../gpu4 . | split -b "$CHUNK" -d -a 2 - .carry/ship/bundle.tar.
ls -l .carry/ship
