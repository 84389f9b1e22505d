#!/usr/bin/env bash
# Profile the demo's layers on a GPU with Nsight Systems, then print the per-range time table.
#
#   benchmarks/profile/nsys_demo.sh                       # one GPU, LocalGroup(P) in one process
#   NPROC=8 benchmarks/profile/nsys_demo.sh               # 8 ranks under torchrun (NCCL)
#   OUT=build/prof DEMO_ARGS="-P 8 --tokens-per-rank 4096" benchmarks/profile/nsys_demo.sh
#
# The demo runs its checked pass, then (--profile) two more passes with GPUSOLVER_NVTX=1: the
# second between cudaProfilerStart/Stop, which is all nsys records (--capture-range=cudaProfilerApi).
# Traces: CUDA (kernels, copies, runtime calls: the synchronising ones are the host reads), NVTX
# (gpusolver's ranges; NCCL's own NVTX ranges too, NCCL_NVTX_DISABLE unset) and OS runtime calls.
# Then nsys_table.py turns the sqlite export into the table: solver vs attention vs communication
# time, the sync calls inside each range, and the GPU's idle gaps while a range was open.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-build/profile}
NPROC=${NPROC:-1}
DEMO_ARGS=${DEMO_ARGS:--P 8 --tokens-per-rank 2048 --heads 32:8 --head-dim 128 --dtype bf16 --layers 4 --no-check}
export PYTHONPATH=${PYTHONPATH:-.}

command -v nsys >/dev/null || { echo "nsys_demo.sh: nsys (Nsight Systems) is not on PATH" >&2; exit 1; }
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    { echo "nsys_demo.sh: needs a CUDA GPU (torch.cuda.is_available() is false)" >&2; exit 1; }
mkdir -p "$OUT"

TRACE=cuda,nvtx,osrt
# newer nsys versions trace NCCL calls directly; older ones get NCCL's NVTX ranges through -t nvtx
if nsys profile --help 2>/dev/null | grep -q -- "nccl"; then TRACE=$TRACE,nccl; fi

if [ "$NPROC" -gt 1 ]; then
    LAUNCH=(torchrun --standalone --nproc-per-node "$NPROC" -m gpusolver demo)
    DEMO_ARGS=$(echo "$DEMO_ARGS" | sed -E 's/(^| )-P [0-9]+//')  # P is the world size
else
    LAUNCH=("$PYTHON" -m gpusolver demo)
fi

# shellcheck disable=SC2086
GPUSOLVER_NVTX=1 nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t "$TRACE" \
    --force-overwrite=true -o "$OUT/demo" "${LAUNCH[@]}" $DEMO_ARGS --profile --out "$OUT/demo_plan.png"
nsys export --type sqlite --force-overwrite=true -o "$OUT/demo.sqlite" "$OUT/demo.nsys-rep"
"$PYTHON" benchmarks/profile/nsys_table.py "$OUT/demo.sqlite" --out "$OUT/nvtx_table.md"
echo "report: $OUT/demo.nsys-rep (open in nsys-ui); table: $OUT/nvtx_table.md"
