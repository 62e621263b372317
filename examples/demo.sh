#!/usr/bin/env bash
# The xirang demo, on a fresh machine or an old one (idempotent):
#
#     bash examples/demo.sh                     # digits, 2 ranks, gloo vs xirang+bf16-ef, 300 steps
#     bash examples/demo.sh --task text         # arguments go to benchmarks/train_compare.py
#
# Set-up (shared with tests/run.sh, in tests/setup_env.sh): uses `python3` if it can import torch,
# else creates .venv/ with torch 2.13.0; installs numpy, scikit-learn, tqdm when missing; builds and
# installs xirang with `pip install --no-build-isolation .` unless already installed from the same
# sources. Then runs benchmarks/train_compare.py (over examples/train.py) under torchrun with $NPROC
# ranks (default 2), which trains the gloo baseline and xirang with the bf16 error-feedback hook in
# turn, with the same seed, and prints one side-by-side table and a JSON summary (also written to build/demo-summary.json).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../tests/setup_env.sh
source "$here/../tests/setup_env.sh" || { echo "demo: set-up failed" >&2; exit 1; }

if [ "$XIRANG_AVAILABLE" != 1 ]; then
    echo "demo: xirang is not available: $XIRANG_BUILD_ERROR" >&2
    echo "demo: the gloo baseline alone runs with:" >&2
    echo "      $PY -m torch.distributed.run --nproc_per_node=2 examples/train.py --backend gloo" >&2
    exit 1
fi

cd "$XIRANG_ROOT"
nproc_per_node="${NPROC:-2}"
# The ranks share this host, where xirang's default (XIRANG_TRANSPORT_LOCAL=auto) moves bytes through
# shared memory and runs the hook's op as an exact fp32 average. The demo shows the bf16
# error-feedback wire that ranks on different hosts use, so it keeps the TCP engine unless told
# otherwise (XIRANG_TRANSPORT_LOCAL=auto bash examples/demo.sh: same-host shared memory).
export XIRANG_TRANSPORT_LOCAL="${XIRANG_TRANSPORT_LOCAL:-tcp}"
echo "demo: XIRANG_TRANSPORT_LOCAL=$XIRANG_TRANSPORT_LOCAL" >&2
cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc_per_node"
     benchmarks/train_compare.py --summary build/demo-summary.json "$@")
echo "demo: ${cmd[*]}" >&2
if [[ "$PY" == "$XIRANG_ROOT/.venv/"* ]]; then
    echo "demo: the set-up uses .venv/ (no torch in the system python3): run 'source .venv/bin/activate' before the README's other commands" >&2
fi
exec "${cmd[@]}"
