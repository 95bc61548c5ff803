#!/usr/bin/env bash
# The GPU command of the pair training (python/ddtree/training/pipeline.py): trains the target and the DFlash
# drafter, evaluates them, writes the models, their card and metrics under $OUT (~9 minutes on an H200).
#   DATA=DIR  the directory written by `python -m ddtree.training prepare` (required)
#   WHEELS=DIR  optional: wheels to install into a site directory of its own first (the ddtree wheel, and
#               transformers >= 5.24 where the machine has an older one: the engine drives HF modules directly)
#   bash benches/train_pair.sh [arguments of `python -m ddtree.training run`, e.g. --drafter-snapshots 0.25 0.5]
set -euo pipefail
OUT=${OUT:-/tmp/train-pair-out}
DATA=${DATA:?set DATA to the directory written by python -m ddtree.training prepare}
if [ -n "${WHEELS:-}" ]; then
  # A site directory of its own: the training's transformers must not replace the one other work runs with.
  SITE=${TRAIN_SITE:-/tmp/train-site}
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH=$SITE
fi
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)'
exec python3 -m ddtree.training run --data "$DATA" --out "$OUT" --seed 0 "$@"
