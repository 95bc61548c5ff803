#!/usr/bin/env bash
# The GPU command of the pair training (see python/ddtree/training/pipeline.py). On the H200:
#   carry: .whl (the ddtree abi3 wheel, plus transformers>=5.24 as a wheel where the host has an older one:
#          the engine drives HF modules directly) and .carry/train-pair (from `python -m ddtree.training prepare`)
#   run:   bash benches/train_pair.sh            (writes everything under $OUT; ~9 minutes)
# Extra arguments go to `python -m ddtree.training run` (e.g. --target-steps N --drafter-steps M to reproduce).
set -euo pipefail
OUT=${OUT:-/tmp/train-pair-out}
# Its own site directory: transformers 5.24 must not replace the 5.17 that a vLLM bundle in /tmp/site runs with.
SITE=${TRAIN_SITE:-/tmp/train-site}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)'
exec python3 -m ddtree.training run --data .carry/train-pair --out "$OUT" --seed 0 "$@"
