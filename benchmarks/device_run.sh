#!/usr/bin/env bash
# One device call of the H200 workflow (benchmarks/NOTES.md), run from the repository root
# on the GPU machine with the tree on PYTHONPATH; results and logs go to $OUT (or ./out).
#
#   bash benchmarks/device_run.sh check   # GPU tests, mla-plugins check, quant_bench, unit_cost,
#                                         # --variants
#   bash benchmarks/device_run.sh bench   # benchmarks/prefill.py: shapes, peers, serving
#
# `check` takes ~4-5 minutes, `bench` ~2-3: each fits one 10-minute call. Wheels in .whl/
# (nvidia-cudnn-frontend for the cuDNN FP8 peer) are installed first when present; the vLLM
# sync-check test needs vLLM's own gpu_sync_debug.py in .vllm_sync/ (README, tests/gpu).
set -uo pipefail
stage=${1:?"stage: check or bench"}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:.
else
    export PYTHONPATH=.
fi
status=0
case "$stage" in
    check)
        python3 -m pytest tests/gpu tests/core/test_torch_kernel.py tests/core/test_plan.py -q \
            2>&1 | tee "$out/gpu-tests.log" || status=1
        python3 -m mla_plugins.cli check 2>&1 | tee "$out/check.log" || status=1
        python3 benchmarks/quant_bench.py 2>&1 | tee "$out/quant-bench.log" || status=1
        python3 benchmarks/unit_cost.py --out "$out/h200-unit-cost.json" \
            2>&1 | tee "$out/unit-cost.log" || status=1
        python3 benchmarks/prefill.py --variants --out "$out/h200-variants.json" \
            2>&1 | tee "$out/variants.log" || status=1
        ;;
    bench)
        python3 benchmarks/prefill.py --out "$out/h200.json" 2>&1 | tee "$out/prefill.log" || status=1
        ;;
    *)
        echo "unknown stage $stage (check or bench)" >&2
        exit 2
        ;;
esac
exit $status
