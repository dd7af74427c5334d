#!/usr/bin/env bash
# One device call of the H200 workflow (benchmarks/NOTES.md), run from the repository root
# on the GPU machine with the tree on PYTHONPATH; results and logs go to $OUT (or ./out).
#
#   bash benchmarks/device_run.sh check   # GPU tests, mla-plugins check, quant_bench, a short
#                                         # benchmark (two shapes, no serving)
#   bash benchmarks/device_run.sh bench   # benchmarks/prefill.py: every shape and peer, the
#                                         # dispatch table, accuracy, serving
#   bash benchmarks/device_run.sh variants  # the Triton provider's fp8 phase-1 variants, unit cost
#   bash benchmarks/device_run.sh host    # FA3's host time piece by piece (host_fa3.py), then
#                                         # every GPU test
#   bash benchmarks/device_run.sh rotation  # the rotation's implementations: quant_bench (TB/s),
#                                         # rotation_cost.py (end to end), their GPU tests
#   bash benchmarks/device_run.sh amortized  # the rotated casts loading M once for more rows:
#                                         # quant_bench --amortized, rotation_cost (FA3 with
#                                         # triton_heads.STAGES 2, 3; ours with
#                                         # triton_quant.KV_BLOCKS 2, 4), their GPU tests
#   bash benchmarks/device_run.sh kernel  # the Gluon kernel's GPU tests, its variants at five
#                                         # shapes (prefill.py --variants), rotation_cost.py
#   bash benchmarks/device_run.sh final   # benchmarks/prefill.py without its serving section,
#                                         # then the serving section merged into the same JSON
#   bash benchmarks/device_run.sh verify  # rotation_cost.py at the small shapes, every GPU test
#   bash benchmarks/device_run.sh profile # Nsight Compute (full set) of the Gluon kernel and of
#                                         # FA3's FP8 forward, one launch each, B1-S8192-H128
#   bash benchmarks/device_run.sh gluon16 # the Gluon 16-bit kernel: its GPU tests, its variants
#                                         # at every shape beside FA3 bf16 (prefill.py --variants --bf16)
#   bash benchmarks/device_run.sh dev28   # every GPU test, the q_tma variants (fp8, 16-bit), the
#                                         # Gluon rotation cast's rate and cost through FA3
#   bash benchmarks/device_run.sh dev29   # every GPU test, FA3 batched against varlen
#                                         # (fa3_batched.py), ncu of ours and FA3 at B8-S2048-H128
#   bash benchmarks/device_run.sh final29 # the FA3 provider's GPU tests, then `final` without
#                                         # its serving section
#   bash benchmarks/device_run.sh final29b # the one-sequence shapes again after the last change
#   bash benchmarks/device_run.sh dev30   # the FA3 provider's and the Gluon cast's GPU tests, the
#                                         # Gluon cast's load prefetch and paired stores (quant_bench
#                                         # --gluon, rotation_cost through FA3 at every shape)
#   bash benchmarks/device_run.sh dev30b  # the FA3 provider's and the Gluon cast's GPU tests (the
#                                         # Gluon cast the provider's default), the rotation's cost
#                                         # through FA3 (dense, Gluon, Gluon without its knobs),
#                                         # host_fa3.py
#   bash benchmarks/device_run.sh final30 # every GPU test, then the Gluon cast's warps and rows a
#                                         # warp through FA3 at the three small shapes
#   bash benchmarks/device_run.sh final30b # final30 cut to fit little device time: the small
#                                         # shapes' knobs, then the GPU tests of the quantization
#   bash benchmarks/device_run.sh dev31   # every GPU test, then final30b's knobs and --min-chunks 64
#                                         # at the small shapes
#   bash benchmarks/device_run.sh dev31b  # the GPU suite's second half, the rotation's cost through
#                                         # FA3 at the small shapes (MIN_CHUNK 64 beside 256), the
#                                         # per-head quantization's passes apart (head_passes.py),
#                                         # the FA3 provider's GPU tests
#   bash benchmarks/device_run.sh dev32a  # the rotation's cost through FA3 at every shape, then
#                                         # head_passes.py (the per-head quantization's passes apart), the GPU suite's first half
#   bash benchmarks/device_run.sh dev32b  # the GPU suite's second half
#   bash benchmarks/device_run.sh dev33   # ncu (full set) of the unrotated and the Gluon cast at
#                                         # B1-S1024-H16 (profile_rotation.py --tokens 1024 --heads 16)
#   bash benchmarks/device_run.sh dev33b  # the Gluon cast's q and k programs first: its tests, ncu,
#                                         # head_passes.py and rotation_cost.py beside the old order
#   bash benchmarks/device_run.sh dev33c  # pass 1's PDL trigger early, left out, no PDL, with and
#                                         # without q and k first, at the small shapes
#   bash benchmarks/device_run.sh dev34   # the final tree (the Gluon cast without PDL): the rotation's
#                                         # cost through FA3 at every shape (--pdl-off), the passes
#                                         # apart at the small shapes, the GPU suite's first half
#                                         # (then dev32b: its second half)
#   bash benchmarks/device_run.sh dev34b  # kernel='auto' on the final tree beside the FA3 peers
#                                         # (prefill.py --auto-only), on whatever card the call got
#   bash benchmarks/device_run.sh dev35   # pass 1 rotated at 8 warps against 16: the quantization's
#                                         # and rotation's GPU tests, head_passes.py, rotation_cost.py
#   bash benchmarks/device_run.sh dev36   # (stop 36's record: the knobs it measured are removed) the
#                                         # Gluon fp8 softmax's exponentials partly on the FMA pipe, the
#                                         # Gluon cast at 128 registers at the small shapes
#   bash benchmarks/device_run.sh dev36b  # the whole GPU suite in one call
#   bash benchmarks/device_run.sh dev36c  # the Gluon fp8 row sums by the tensor cores (sum_mma): its
#                                         # GPU tests, its variants beside the defaults
#   bash benchmarks/device_run.sh dev37   # sum_mma (stop 39/40): the diagnostic (every way
#                                         # of building A, uniform and spread P), its GPU tests
#   bash benchmarks/device_run.sh dev40a  # dev40's checks alone: splat, the kernel's l per row, GPU tests
#   bash benchmarks/device_run.sh dev40   # sum_mma with the ones bitcast: the diagnostic, its GPU
#                                         # tests, its variants beside the defaults
#   bash benchmarks/device_run.sh dev41   # every GPU test, then sum_mma against the vector sums
#                                         # beside FA3 FP8 at four more shapes
#   bash benchmarks/device_run.sh dev42   # sum_mma's leads: the split case's spread, the persistent
#                                         # form against one CTA with it, its GPU tests
#   bash benchmarks/device_run.sh dev42b  # sum_mma the fp8 default, one CTA per unit for several
#                                         # sequences: test_triton.py, then B8-S2048-H128's forms
#                                         # beside the portable kernel
#   bash benchmarks/device_run.sh dev43   # the one-sequence threshold (stop 42: 1024 keys): the
#                                         # portable and the Gluon kernel at the one-sequence
#                                         # shapes around it, beside FA3 FP8
#   bash benchmarks/device_run.sh dev44   # the warpgroup barriers before mbarrier arrives and waits
#                                         # removed from the Gluon kernel's PTX (lean_sync): its GPU
#                                         # tests, its fp8 and 16-bit variants beside the defaults
#   bash benchmarks/device_run.sh dev45   # the persistent param's 16-bit isolation tests (stop 44's
#                                         # fixture fix), ncu of the 16-bit default and FA3 bf16
#   bash benchmarks/device_run.sh dev45o  # fp8_outliers (issue 22): its GPU tests and the persistent
#                                         # param's (stop 44's fixture fix), its cost at every shape
#                                         # (outlier_cost.py), the accuracy section
#   bash benchmarks/device_run.sh dev46   # fp8_outliers' second rule (fp8 corrections): its GPU
#                                         # tests, its cost, the accuracy section (then dev36b)
#   bash benchmarks/device_run.sh dev46b  # the same after its fix, each launch timed first
#                                         # (outlier_parts.py); dev46d: a shorter dev46b
#   bash benchmarks/device_run.sh last    # kernel='auto' against FA3 (prefill.py --auto-only),
#                                         # host_fa3.py, every GPU test, ncu of the rotated cast
#
# Each fits one 10-minute call. Wheels in .whl/ are installed first (carry .whl): fa3-fwd
# 0.0.3 and einops (FlashAttention-3's forward, the peer and the flash_attn provider's FA3),
# nvidia-cudnn-frontend 1.32 (the cuDNN peers). The vLLM sync-check test needs vLLM's own
# gpu_sync_debug.py in .vllm_sync/ (carry it; README).
set -uo pipefail
stage=${1:?"stage: check, bench, final, auto, host, rotation, amortized, kernel, gluon16, dev28, dev29, dev30, dev30b, final30, final30b, dev31, dev31b, dev32a, dev32b, dev33, dev33b, dev33c, dev34, dev34b, dev35, dev36, dev36b, dev36c, dev40, dev40a, dev41, dev42, dev42b, dev43, dev43b, dev43c, dev44, dev45, dev45o, dev46, dev46b, dev46d, final29, final29b, verify, profile, last or variants"}
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
# the card's short name for the results file and the dispatch table it writes (bench, final):
# mla_plugins.core.dispatch.TABLES decides which table a card reads, prefill.py holds to it
card_name() {
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 \
        && echo h100 || echo h200
}
# the rotation's three runs, logs and JSON named by $1: quant_bench with $2, rotation_cost
# with $3, the rotation's GPU tests (word splitting of $2 and $3 intended)
rotation_calls() {
    timeout 180 python3 benchmarks/quant_bench.py $2 > "$out/quant-bench-$1.log" 2>&1 || status=1
    grep -E "TB/s|differing" "$out/quant-bench-$1.log" | tail -70
    timeout 250 python3 benchmarks/rotation_cost.py $3 --out "$out/h200-$1.json" \
        > "$out/rotation-cost-$1.log" 2>&1 || status=1
    tail -16 "$out/rotation-cost-$1.log"
    timeout 150 python3 -m pytest tests/gpu/test_flash_attn_gpu.py tests/gpu/test_triton.py -q \
        -p no:cacheprovider \
        -k "flash_attn_gpu or quant or rotat or kron or pipelined or isolat or bad_values" \
        > "$out/gpu-tests-$1.log" 2>&1 || status=1
    tail -8 "$out/gpu-tests-$1.log"
}
# one line per row of rotation_cost.py's JSON $1: shape, the costs and times, any error
rotation_summary() {
    python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["env"])
for r in d["rows"]:
    print(r["shape"], {k: round(v, 4) for k, v in r.items() if k.endswith("_cost") or k.endswith("_ms")}, r.get("error", ""))
PY
}
# one line per row of head_passes.py's JSON $1: shape, its timings in µs whose key ends with
# one of the suffixes in $2 (comma-separated; default "_us": every one), "_us" cut off
head_passes_summary() {
    python3 - "$1" "${2:-_us}" <<'PY'
import json, sys
ends = tuple(sys.argv[2].split(","))
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], {k[:-3]: v for k, v in r.items() if k.endswith(ends)})
PY
}
# every GPU test, bounded by $1 seconds, into gpu-tests$3.log; its last $2 lines shown; $3 (as
# "-2of2"): part 2 of 2 of them only (benchmarks/pytest_part.py), for a cold machine, where
# the whole suite outlasts one call
all_gpu_tests() {
    local part=${3:-}
    part=${part#-}
    # SIGINT at the limit: pytest then still prints its summary with the failures' names (-rfE)
    MLA_TEST_PART=${part/of//} PYTHONPATH="$PYTHONPATH:benchmarks" timeout -s INT -k 30 "$1" \
        python3 -m pytest tests/gpu tests/core/test_torch_kernel.py tests/core/test_plan.py \
        -q -rfE --maxfail=20 -p no:cacheprovider -p pytest_part > "$out/gpu-tests${3:-}.log" 2>&1 || status=1
    tail -"$2" "$out/gpu-tests${3:-}.log"
}
# Nsight Compute of one phase-1 launch each, ours (the Gluon kernel, profile_phase1.py) and FA3's
# FP8 forward, at shape $1: each bounded by $2 seconds, into ncu-<who>$3.txt, its lines matching
# $4 shown; the remaining arguments are ncu's own (what to collect). PROFILE_ARGS=--bf16: the
# 16-bit kernel and FA3's bf16 forward instead
# fp8_outliers' GPU tests (with the isolation test's outliers mode), then outlier_cost.py.
# Arguments: the two timeouts (s), then the cost's shapes (comma-separated; "" for all)
outlier_tests_and_cost() {
    timeout -s INT -k 10 "$1" python3 -m pytest tests/gpu/test_fp8_outliers_gpu.py tests/gpu/test_triton.py \
        -q -rfE -p no:cacheprovider -k "outliers" > "$out/gpu-tests-outliers.log" 2>&1 || status=1
    tail -6 "$out/gpu-tests-outliers.log"
    timeout "$2" python3 benchmarks/outlier_cost.py --out "$out/$(card_name)-outliers.json" \
        ${3:+--shapes "$3"} > "$out/outlier-cost.log" 2>&1 || status=1
    tail -12 "$out/outlier-cost.log"
}

# fp8_outliers (stop 46): outlier_parts.py (the side tiles checked byte for byte, then each
# launch timed; nothing else runs if the check fails), the outlier GPU tests, outlier_cost.py.
# Arguments: the three timeouts (s), then the cost's shapes (comma-separated; "" for all)
outliers_stage() {
    if timeout "$1" python3 benchmarks/outlier_parts.py --out "$out/$(card_name)-outlier-parts.json" \
            > "$out/outlier-parts.log" 2>&1; then
        tail -13 "$out/outlier-parts.log"
        outlier_tests_and_cost "$2" "$3" "$4"
    else
        status=1
        tail -30 "$out/outlier-parts.log"
    fi
}

ncu_phase1() {
    local shape=$1 limit=$2 suffix=$3 pattern=$4 who name
    shift 4
    for who in gluon fa3; do
        name=$([ $who = fa3 ] && echo device_kernel || echo mla_prefill)
        timeout "$limit" ncu "$@" --kernel-name "regex:$name" --launch-skip 2 --launch-count 1 \
            python3 benchmarks/profile_phase1.py --kernel $who --shape "$shape" ${PROFILE_ARGS:-} \
            > "$out/ncu-$who$suffix.txt" 2>&1 || status=1
        grep -E "$pattern" "$out/ncu-$who$suffix.txt" | head -30
    done
}
# one line per row of prefill.py --variants' log $1 (default variants.log): shape, variant,
# error, GPU-time TFLOP/s
summarize_variants() {
    python3 - "${1:-$out/variants.log}" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        print(r["shape"], "|", r["variant"], "| err", r.get("err"), "| attn", r.get("attn_graph_tflops"),
              "| e2e", r.get("e2e_graph_tflops"), r.get("error", ""))
PY
}
case "$stage" in
    check)
        timeout 270 python3 -m pytest tests/gpu tests/core/test_torch_kernel.py tests/core/test_plan.py -q --maxfail=20 \
            -p no:cacheprovider > "$out/gpu-tests.log" 2>&1; tail -40 "$out/gpu-tests.log"
        python3 -m mla_plugins.cli doctor 2>&1 | tee "$out/doctor.log" || status=1
        python3 -m mla_plugins.cli check 2>&1 | tee "$out/check.log" || status=1
        timeout 60 python3 benchmarks/quant_bench.py > "$out/quant-bench.log" 2>&1; tail -25 "$out/quant-bench.log"
        timeout 150 python3 benchmarks/prefill.py --shapes B1-S1024-H16,chunked-q512-k8192-H16 \
            --no-serving --no-accuracy --out "$out/h200-smoke.json" > "$out/prefill-smoke.log" 2>&1
        tail -25 "$out/prefill-smoke.log"
        ;;
    bench)
        card=$(card_name)
        python3 benchmarks/prefill.py --out "$out/$card.json" \
            --dispatch-out "mla_plugins/core/dispatch_$card.json" 2>&1 | tee "$out/prefill.log" || status=1
        cp "mla_plugins/core/dispatch_$card.json" "$out/" || status=1
        ;;
    final)
        # the benchmark without its serving section (bounded), then the serving section merged
        # into the same file (prefill.py --serving-only); the GPU tests are `verify`'s. Results
        # and table named for the card: h100.json and dispatch_h100.json on an H100
        card=$(card_name)
        timeout 440 python3 benchmarks/prefill.py --no-serving --out "$out/$card.json" \
            --dispatch-out "mla_plugins/core/dispatch_$card.json" > "$out/prefill.log" 2>&1 || status=1
        cp "mla_plugins/core/dispatch_$card.json" "$out/" 2>/dev/null
        tail -45 "$out/prefill.log"
        timeout 140 python3 benchmarks/prefill.py --serving-only --out "$out/$card.json" \
            > "$out/serving.log" 2>&1 || status=1
        tail -3 "$out/serving.log"
        ;;
    auto)
        # kernel='auto' with the committed table and defaults, beside the FA3 peers it is
        # measured against, then the GPU tests the last change touched
        timeout 150 python3 benchmarks/prefill.py --auto-only --out "$out/h200-auto.json" \
            > "$out/prefill-auto.log" 2>&1 || status=1
        tail -12 "$out/prefill-auto.log"
        timeout 50 python3 -m pytest tests/gpu/test_triton.py -k "auto_picks or rotated" \
            tests/gpu/test_flash_attn_gpu.py -q -p no:cacheprovider > "$out/gpu-tests-auto.log" 2>&1
        tail -6 "$out/gpu-tests-auto.log"
        ;;
    host)
        timeout 200 python3 benchmarks/host_fa3.py --out "$out/h200-host-fa3.json" \
            > "$out/host-fa3.log" 2>&1 || status=1
        tail -12 "$out/host-fa3.log"
        all_gpu_tests 330 25
        ;;
    rotation)
        rotation_calls rotation "--only heads,qkv --rotate-only" ""
        ;;
    amortized)
        rotation_calls amortized "--amortized" "--rotations dense --heads-stages 2,3 --kv-blocks 2,4"
        ;;
    kernel)
        # the Gluon kernel's GPU tests, its variants at five shapes, the rotation's end-to-end
        # cost with the defaults
        timeout 110 python3 -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider -k "gluon and not longest" \
            -x > "$out/gpu-tests-kernel.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-kernel.log"
        timeout 240 python3 benchmarks/prefill.py --variants --out "$out/h200-variants.json" \
            --shapes B1-S8192-H128,B1-S16384-H16,B8-S2048-H128,B4-S4096-H16,B16-S512-H16 \
            --variant-filter "gluon 128x128 s4,gluon 128x128 s4 persistent" \
            > "$out/variants.log" 2>&1 || status=1
        summarize_variants
        timeout 230 python3 benchmarks/rotation_cost.py --rotations dense --out "$out/h200-rotation.json" \
            > "$out/rotation-cost.log" 2>&1 || status=1
        tail -16 "$out/rotation-cost.log"
        ;;
    verify)
        # the rotation's end-to-end cost at the three small shapes (where the q/k/v blocks a
        # program follow the grid), then every GPU test
        timeout 100 python3 benchmarks/rotation_cost.py --rotations dense --kernels flash_attn,triton \
            --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 --out "$out/h200-rotation-small.json" \
            > "$out/rotation-cost-small.log" 2>&1 || status=1
        tail -7 "$out/rotation-cost-small.log"
        all_gpu_tests 300 25
        ;;
    profile)
        ncu_phase1 B1-S8192-H128 200 "" \
            "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Stall|Warp Cycles Per Issued" \
            --set full
        ;;
    last)
        timeout 210 python3 benchmarks/prefill.py --auto-only --out "$out/h200-auto.json" \
            > "$out/prefill-auto.log" 2>&1 || status=1
        tail -12 "$out/prefill-auto.log"
        timeout 110 python3 benchmarks/host_fa3.py --out "$out/h200-host-fa3.json" \
            > "$out/host-fa3.log" 2>&1 || status=1
        all_gpu_tests 170 6
        timeout 60 ncu --kernel-name regex:_head_cast_kernel --launch-skip 3 --launch-count 3 \
            --section SpeedOfLight --section Occupancy --section WarpStateStats \
            --section InstructionStats --section MemoryWorkloadAnalysis \
            python3 benchmarks/profile_rotation.py > "$out/ncu-rotation.txt" 2>&1
        grep -E "Duration|Throughput|Registers|Achieved Occupancy|Stall|Executed Ipc|Issue Slots" \
            "$out/ncu-rotation.txt" | head -40
        ;;
    gluon16)
        # the Gluon kernel in 16-bit (stop 28): its GPU tests (every bf16 test of test_triton.py
        # through each phase-1 kernel), then its variants at every shape beside FA3 bf16
        timeout 200 python3 -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider --maxfail=10 \
            -k "bf16" > "$out/gpu-tests-gluon16.log" 2>&1 || status=1
        tail -12 "$out/gpu-tests-gluon16.log"
        timeout 330 python3 benchmarks/prefill.py --variants --bf16 --out "$out/h200-variants-bf16.json" \
            --shapes B1-S8192-H128,B4-S4096-H16,B1-S16384-H16,B8-S2048-H128,B1-S1024-H16,B1-S2048-H8,B16-S512-H16,chunked-q512-k8192-H16,chunked-q512-k8192-H128,chunked-q2048-k18432-H16 \
            > "$out/variants.log" 2>&1 || status=1
        summarize_variants
        ;;
    dev28)
        # stop 28's second call: every GPU test on the tree (FA3 scheduler metadata, the Gluon
        # 16-bit kernel, q by TMA, the Gluon rotation cast), the q_tma variants in fp8 and
        # 16-bit, the Gluon rotation cast's rate (quant_bench --gluon) and its end-to-end cost
        # through FA3 at the large shapes
        all_gpu_tests 260 30
        timeout 80 python3 benchmarks/prefill.py --variants --out "$out/h200-variants-qtma.json" \
            --shapes B1-S8192-H128,B4-S4096-H16,B8-S2048-H128,B16-S512-H16 \
            > "$out/variants-fp8.log" 2>&1 || status=1
        summarize_variants "$out/variants-fp8.log"
        timeout 70 python3 benchmarks/prefill.py --variants --bf16 --out "$out/h200-variants-bf16-qtma.json" \
            --shapes B1-S8192-H128,B8-S2048-H128,B1-S1024-H16,B1-S2048-H8,B16-S512-H16,chunked-q512-k8192-H128 \
            > "$out/variants-bf16.log" 2>&1 || status=1
        summarize_variants "$out/variants-bf16.log"
        timeout 60 python3 benchmarks/quant_bench.py --gluon > "$out/quant-bench-gluon.log" 2>&1 || status=1
        grep -E "TB/s|differing" "$out/quant-bench-gluon.log" | tail -30
        timeout 90 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations dense,gluon \
            --shapes B1-S8192-H128,B4-S4096-H16,B1-S16384-H16,B8-S2048-H128 \
            --out "$out/h200-rotation-gluon.json" > "$out/rotation-cost-gluon.log" 2>&1 || status=1
        tail -12 "$out/rotation-cost-gluon.log"
        ;;
    dev29)
        # stop 29's third call (its first two ran fcd33ec and 0068591's `dev29` and `dev29b`:
        # the rescale_late and unit_prefetch variants, NOTES): every GPU test with the
        # accumulator rescaled after the next q k^T issue by default (fp8), FA3's batched call
        # against its varlen call on equal lengths (fa3_batched.py), then Nsight Compute of
        # the Gluon kernel and of FA3's FP8 forward at B8-S2048-H128 (no full set: the
        # schedule's sections)
        all_gpu_tests 330 25
        timeout 80 python3 benchmarks/fa3_batched.py --out "$out/h200-fa3-batched.json" \
            > "$out/fa3-batched.log" 2>&1 || status=1
        cut -c1-220 "$out/fa3-batched.log"
        ncu_phase1 B8-S2048-H128 100 -b8 \
            "Duration|Registers Per|Grid Size|Achieved Occupancy|Issue Slots Busy|Issued Warp|No Eligible|Executed Ipc A|Warp Cycles Per Issued|Executed Instructions  " \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
            --section InstructionStats --section Occupancy --section LaunchStats
        ;;
    dev30)
        # stop 30's first call: the GPU tests of the FA3 provider (the equal-length graph
        # replay with the rotation had not run) and of the Gluon cast (its new knobs), then
        # the cast's rates with each knob and its cost end to end through FA3
        timeout 120 python3 -m pytest tests/gpu/test_flash_attn_gpu.py tests/gpu/test_gluon_rotation.py \
            -q -p no:cacheprovider --maxfail=10 > "$out/gpu-tests-dev30.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-dev30.log"
        timeout 170 python3 benchmarks/quant_bench.py --gluon > "$out/quant-bench-dev30.log" 2>&1 || status=1
        grep -E "TB/s|differing|done|timed" "$out/quant-bench-dev30.log" | cut -c1-200 | tail -120
        timeout 200 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --gluon-variants prefetch,paired,prefetch+paired --out "$out/h200-rotation-dev30.json" \
            > "$out/rotation-cost-dev30.log" 2>&1 || status=1
        python3 - "$out/h200-rotation-dev30.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], {k: round(v, 4) for k, v in r.items() if k.endswith("_cost") or k.endswith("graph_ms") or k.startswith("err_")}, r.get("error", ""))
PY
        ;;
    dev30b)
        # stop 30's second call: the GPU tests of the FA3 provider and the Gluon cast with the
        # cast's loads a step ahead and paired stores on by default and the provider taking
        # the Gluon cast (triton_heads.HEAD_ROTATION); the rotation's cost through FA3 at
        # every shape; FA3's host time with our part of it timed interleaved
        timeout 120 python3 -m pytest tests/gpu/test_flash_attn_gpu.py tests/gpu/test_gluon_rotation.py \
            -q -p no:cacheprovider --maxfail=10 > "$out/gpu-tests-dev30b.log" 2>&1 || status=1
        tail -3 "$out/gpu-tests-dev30b.log"
        timeout 230 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations dense,gluon \
            --gluon-variants none --out "$out/h200-rotation-dev30b.json" \
            > "$out/rotation-cost-dev30b.log" 2>&1 || status=1
        python3 - "$out/h200-rotation-dev30b.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["env"])
for r in d["rows"]:
    print(r["shape"], {k: round(v, 4) for k, v in r.items() if k.endswith("_cost") or k.startswith("err_")}, r.get("error", ""))
PY
        timeout 200 python3 benchmarks/host_fa3.py --out "$out/h200-host-fa3.json" \
            > "$out/host-fa3.log" 2>&1 || status=1
        python3 - "$out/h200-host-fa3.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], "fp8" if r["fp8"] else "bf16", {k: r.get(k) for k in ("raw_us", "raw_sched_us", "provider_us", "provider_lse_us", "il_op_us", "il_op_min_us", "il_provider_us", "il_provider_min_us", "il_provider_lse_us", "ours_us", "ours_lse_us", "public_us")})
PY
        ;;
    final30)
        # stop 30's last call: every GPU test on the final tree, then the rotation's cost at the
        # small shapes with the Gluon cast's warps, rows per warp and blocks (its other knobs timed in
        # dev30/dev30b)
        all_gpu_tests 290 6
        timeout 120 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --gluon-variants w8,w2,r16,b1 --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 \
            --out "$out/h200-rotation-small-knobs.json" > "$out/rotation-cost-small.log" 2>&1 || status=1
        python3 - "$out/h200-rotation-small-knobs.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["env"])
for r in d["rows"]:
    print(r["shape"], {k: round(v, 4) for k, v in r.items() if k.endswith("_cost") or k.startswith("err_") or k.endswith("graph_ms")}, r.get("error", ""))
PY
        ;;
    final30b)
        # final30 cut to the device time left: the knobs at the small shapes first, then the
        # GPU tests that reach the quantization (per-head casts, rotation)
        timeout 110 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --gluon-variants w8,w2,r16,b1 --min-chunks 64 --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 \
            --out "$out/h200-rotation-small-knobs.json" > "$out/rotation-cost-small.log" 2>&1 || status=1
        tail -3 "$out/rotation-cost-small.log" | cut -c1-900
        timeout 80 python3 -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider \
            -k "quant or rotat or kron or heads or isolat" > "$out/gpu-tests-final30b.log" 2>&1 || status=1
        tail -3 "$out/gpu-tests-final30b.log"
        ;;
    dev31b)
        # the GPU suite's second half (dev31's first call ran out at 60%), then the rotation's
        # cost through FA3 at the small shapes with whole-tile chunks of MIN_CHUNK 64, beside 256
        # (the large shapes' splits are the same with either)
        all_gpu_tests 270 8 -2of2
        timeout 110 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --min-chunks 256 --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 --out "$out/h200-rotation-stop31.json" > "$out/rotation-cost-stop31.log" 2>&1 || status=1
        python3 - "$out/h200-rotation-stop31.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["env"])
for r in d["rows"]:
    print(r["shape"], {k: round(v, 4) for k, v in r.items() if k.endswith("_cost") or k.startswith("err_") or k.endswith("graph_ms")}, r.get("error", ""))
PY
        timeout 90 python3 benchmarks/head_passes.py --out "$out/h200-head-passes.json" \
            > "$out/head-passes.log" 2>&1 || status=1
        cut -c1-700 "$out/head-passes.log" | tail -6
        # the FA3 provider's tests again on this tree (the first half ran before the chunk change)
        timeout 110 python3 -m pytest tests/gpu/test_flash_attn_gpu.py -q -p no:cacheprovider \
            --maxfail=10 > "$out/gpu-tests-fa3.log" 2>&1 || status=1
        tail -3 "$out/gpu-tests-fa3.log"
        ;;
    dev32a)
        # stop 32's first call: PDL's tests (the per-head quantization's pass 2 launched as pass
        # 1's programmatic dependent: every byte as with two ordinary launches), the rotation's
        # cost through FA3 at every shape with and without PDL, the two passes timed apart,
        # then the GPU suite's first half on this tree
        timeout 150 python3 -m pytest tests/gpu/test_triton.py tests/gpu/test_gluon_rotation.py -q \
            -p no:cacheprovider -k "pdl or knobs_leave" > "$out/gpu-tests-pdl.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-pdl.log"
        timeout 200 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --pdl-off --out "$out/h200-rotation-stop32.json" > "$out/rotation-cost-stop32.log" 2>&1 || status=1
        rotation_summary "$out/h200-rotation-stop32.json"
        timeout 100 python3 benchmarks/head_passes.py --out "$out/h200-head-passes.json" \
            > "$out/head-passes.log" 2>&1 || status=1
        cut -c1-900 "$out/head-passes.log" | tail -8
        all_gpu_tests 240 8 -1of2
        ;;
    dev33)
        # stop 33: Nsight Compute (full set) of the per-head quantization's cast, unrotated and
        # the Gluon cast, one launch each at B1-S1024-H16 (head_passes.py: the Gluon cast is
        # 10.3 us against 5.7 there, the rotation's whole cost at the small shapes)
        timeout 150 ncu --set full --kernel-name "regex:_head_cast_kernel|_gluon_cast_kernel" \
            --launch-skip 2 --launch-count 2 python3 benchmarks/profile_rotation.py --tokens 1024 \
            --heads 16 --rotations plain,gluon > "$out/ncu-casts-small.txt" 2>&1 || status=1
        grep -E "_cast_kernel|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Executed Ipc A|Issue Slots Busy|Memory Throughput|L2 Hit|DRAM Throughput|Block Limit Reg|Waves Per SM|Executed Instructions  |Est. Speedup|Grid Size|Block Size" \
            "$out/ncu-casts-small.txt" | head -70
        ;;
    dev33b)
        # stop 33: the Gluon cast's programs in one dimension, q and k first (gluon_rotate
        # "Program order"): its GPU tests and the FA3 provider's, ncu of the cast again (the
        # SMs' active cycles), the passes apart and the rotation's cost through FA3 with the
        # old order beside (QK_FIRST False: grid3)
        timeout 200 python3 -m pytest tests/gpu/test_gluon_rotation.py tests/gpu/test_flash_attn_gpu.py \
            -q -p no:cacheprovider > "$out/gpu-tests-order.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-order.log"
        timeout 90 ncu --set full --kernel-name "regex:_gluon_cast_kernel" --launch-skip 1 \
            --launch-count 1 python3 benchmarks/profile_rotation.py --tokens 1024 --heads 16 \
            --rotations gluon > "$out/ncu-gluon-cast-order.txt" 2>&1 || status=1
        grep -E "Duration|Elapsed Cycles  |Average SM Active|Maximum instance|Achieved Occupancy" \
            "$out/ncu-gluon-cast-order.txt" | head -12
        timeout 120 python3 benchmarks/head_passes.py --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 \
            --variants plain,gluon,gluon_grid3 --out "$out/head-passes-stop33.json" \
            > "$out/head-passes-stop33.log" 2>&1 || status=1
        cut -c1-600 "$out/head-passes-stop33.log" | tail -4
        timeout 200 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --gluon-variants grid3 --out "$out/rotation-stop33.json" > "$out/rotation-cost-stop33.log" 2>&1 || status=1
        rotation_summary "$out/rotation-stop33.json"
        ;;
    dev33c)
        # stop 33: where pass 1 triggers pass 2 (PDL_EARLY) beside no PDL, with the Gluon
        # cast's q and k programs first and without (dev33b: first alone -2 us, with PDL's
        # early trigger nothing), at the small shapes
        timeout 120 python3 -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider -k pdl \
            > "$out/gpu-tests-pdl-late.log" 2>&1 || status=1
        tail -2 "$out/gpu-tests-pdl-late.log"
        timeout 150 python3 benchmarks/head_passes.py --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 \
            --variants plain,plain_late,plain_nopdl,gluon,gluon_late,gluon_nopdl,gluon_grid3,gluon_grid3_nopdl \
            --out "$out/head-passes-stop33c.json" > "$out/head-passes-stop33c.log" 2>&1 || status=1
        head_passes_summary "$out/head-passes-stop33c.json" _both_us,pass2_us
        timeout 150 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 --pdl-off --gluon-variants grid3 \
            --out "$out/rotation-stop33c.json" > "$out/rotation-cost-stop33c.log" 2>&1 || status=1
        rotation_summary "$out/rotation-stop33c.json"
        ;;
    dev34)
        # stop 34, the final tree (PDL_GLUON False): the rotation's cost through FA3 at every
        # shape with the Gluon cast's PDL and two ordinary launches beside, and without its
        # loads a step ahead (paired: PREFETCH off, 127 registers, 4 programs an SM against
        # 3), the two passes apart at the small shapes, the GPU suite's first half. It ran on
        # 2dcce49, which also had gluon_rotate.OPERANDS_SHARED (the operands in shared memory)
        # measured as --gluon-variants shared,shared_noprefetch and head_passes gluon_shared;
        # slower, so removed (NOTES, stop 34)
        timeout 220 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --pdl-off --gluon-variants paired --out "$out/h100-rotation-stop34.json" > "$out/rotation-cost-stop34.log" 2>&1 || status=1
        rotation_summary "$out/h100-rotation-stop34.json"
        timeout 100 python3 benchmarks/head_passes.py --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 \
            --variants plain,plain_nopdl,gluon,gluon_pdl --out "$out/h100-head-passes-stop34.json" \
            > "$out/head-passes-stop34.log" 2>&1 || status=1
        head_passes_summary "$out/h100-head-passes-stop34.json"
        all_gpu_tests 230 8 -1of2
        ;;
    dev34b)
        # stop 34: kernel='auto' on the final tree with the committed (H200) table, beside
        # the FA3 peers, named by the card in the JSON's env (AUTO_SHAPES: some shapes only,
        # AUTO_LIMIT: its time limit in seconds)
        timeout ${AUTO_LIMIT:-240} python3 benchmarks/prefill.py --auto-only ${AUTO_SHAPES:+--shapes "$AUTO_SHAPES"} \
            --out "$out/auto-stop34.json" \
            > "$out/prefill-auto-stop34.log" 2>&1 || status=1
        tail -12 "$out/prefill-auto-stop34.log"
        ;;
    dev35)
        # stop 35 (it ran once, on an H100, with BOUND_WARPS_ROTATED 16 the default and 8
        # the variant; 8 was kept, so the variants now name 16): the GPU tests of the
        # per-head quantization and the rotation, the passes apart at four shapes, the
        # rotation's cost through FA3 at every shape
        timeout 170 python3 -m pytest tests/gpu/test_gluon_rotation.py tests/gpu/test_flash_attn_gpu.py \
            tests/gpu/test_triton.py -q -p no:cacheprovider \
            -k "gluon_rotation or flash_attn_gpu or quant or rotat or kron or pipelined or isolat or bad_values" \
            > "$out/gpu-tests-stop35.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-stop35.log"
        timeout 110 python3 benchmarks/head_passes.py --shapes B16-S512-H16,B8-S2048-H128,B1-S8192-H128,B1-S1024-H16 \
            --variants plain,gluon,gluon_p1w16 --out "$out/h200-head-passes-stop35.json" \
            > "$out/head-passes-stop35.log" 2>&1 || status=1
        head_passes_summary "$out/h200-head-passes-stop35.json"
        timeout 230 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --gluon-variants p1w16 --out "$out/h200-rotation-stop35.json" \
            > "$out/rotation-cost-stop35.log" 2>&1 || status=1
        rotation_summary "$out/h200-rotation-stop35.json"
        ;;
    dev36)
        # stop 36 (ran once, on an H100, on ef834a1): the Gluon fp8 softmax with one
        # exponential in 2, 4 or 8 on the FMA pipe (TileConfig.exp2_poly, FA4's polynomial)
        # beside its default, the attention alone and end to end, at the four large shapes,
        # chunked H16 and B1-S1024-H16; then the Gluon cast at 128 registers
        # (gluon_rotate.MAXNREG: its GPU tests, the passes apart and the rotation's cost
        # through FA3 at the three small shapes). Both lost and were removed (NOTES); what is
        # left of the call runs the defaults alone (the removed variants' names would fail)
        timeout 300 python3 benchmarks/prefill.py --variants \
            --variant-filter "gluon 128x128 s4 q_tma late" \
            --shapes B1-S8192-H128,B8-S2048-H128,B1-S16384-H16,B4-S4096-H16,chunked-q512-k8192-H16,B1-S1024-H16 \
            --out "$out/variants-stop36.json" > "$out/variants-stop36.log" 2>&1 || status=1
        summarize_variants "$out/variants-stop36.log"
        timeout 60 python3 -m pytest tests/gpu/test_gluon_rotation.py -q -p no:cacheprovider \
            -k knobs > "$out/gpu-tests-gluon-stop36.log" 2>&1 || status=1
        tail -2 "$out/gpu-tests-gluon-stop36.log"
        timeout 60 python3 benchmarks/head_passes.py --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 \
            --variants plain,gluon --out "$out/head-passes-stop36.json" \
            > "$out/head-passes-stop36.log" 2>&1 || status=1
        head_passes_summary "$out/head-passes-stop36.json" pass1_us,pass2_us
        timeout 110 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 \
            --out "$out/rotation-stop36.json" > "$out/rotation-cost-stop36.log" 2>&1 || status=1
        rotation_summary "$out/rotation-stop36.json"
        ;;
    dev36c)
        # stop 36: the Gluon fp8 kernel's row sums by the tensor cores (TileConfig.sum_mma:
        # P @ ones beside each P @ V in place of 64 FADD a thread a key block): its GPU tests
        # (every phase-1 test through it), then each default beside it (one CTA per unit with
        # the late rescale, with the early one, persistent) at seven shapes
        timeout 200 python3 -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider -k "gluon-sum-mma" \
            > "$out/gpu-tests-sum-mma.log" 2>&1 || status=1
        tail -3 "$out/gpu-tests-sum-mma.log"
        timeout 330 python3 benchmarks/prefill.py --variants \
            --variant-filter "gluon 128x128 s4 q_tma late,gluon 128x128 s4 q_tma late sum_mma,gluon 128x128 s4 q_tma,gluon 128x128 s4 q_tma sum_mma,gluon 128x128 s4 persistent,gluon 128x128 s4 persistent sum_mma" \
            --shapes B1-S8192-H128,B8-S2048-H128,B1-S16384-H16,B4-S4096-H16,chunked-q512-k8192-H16,B1-S1024-H16,B16-S512-H16 \
            --out "$out/variants-sum-mma.json" > "$out/variants-sum-mma.log" 2>&1 || status=1
        summarize_variants "$out/variants-sum-mma.log"
        ;;
    dev37)
        # stop 39/40: why sum_mma's sums are wrong in the kernel while the 64xN product alone
        # is right (onehot modes 0-2, stop 39): the diagnostic (onehot modes 0-4, uniform and
        # spread P; chain, pair, the kernel's l per row), the kernel's l per row with the sums
        # reading a copy of P's registers (copy=1), sum_mma's GPU tests (xfail run as plain
        # tests). Its timing beside the defaults: stop 39's (results/logs/*-stop39-h100.log)
        timeout 200 python3 benchmarks/diag_sum_mma.py > "$out/diag-sum-mma.log" 2>&1 || status=1
        TRITON_CACHE_DIR=/tmp/tc-copy timeout 90 python3 benchmarks/diag_sum_mma.py copy=1 \
            >> "$out/diag-sum-mma.log" 2>&1 || status=1
        cat "$out/diag-sum-mma.log"
        timeout 130 python3 -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider --runxfail \
            -k "gluon-sum-mma" > "$out/gpu-tests-sum-mma.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-sum-mma.log"
        ;;
    dev40a)
        # dev40 cut to little device time: both fills read back, the kernel's l per row with
        # sum_mma against without it, then sum_mma's GPU tests
        DIAG_PARTS=splat,rows timeout 100 python3 benchmarks/diag_sum_mma.py > "$out/diag-sum-mma.log" 2>&1 || status=1
        cat "$out/diag-sum-mma.log"
        timeout 150 python3 -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider --runxfail \
            -k "gluon-sum-mma" > "$out/gpu-tests-sum-mma.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-sum-mma.log"
        ;;
    dev40)
        # stop 40: sum_mma with the ones bitcast (ptxas had filled half of each word from a
        # register never written): both fills read back (splat), its GPU tests (xfail run as
        # plain tests), the late and early forms with and without it at five shapes beside FA3
        # FP8 alone and e2e (and the persistent form with and without it), then, if the tests
        # failed, the rest of the diagnostic (chain, pair, the kernel's l per row)
        DIAG_PARTS=splat timeout 60 python3 benchmarks/diag_sum_mma.py > "$out/diag-sum-mma.log" 2>&1 || status=1
        cat "$out/diag-sum-mma.log"
        sum_ok=1
        timeout 150 python3 -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider --runxfail \
            -k "gluon-sum-mma" > "$out/gpu-tests-sum-mma.log" 2>&1 || { status=1; sum_ok=0; }
        tail -4 "$out/gpu-tests-sum-mma.log"
        timeout 300 python3 benchmarks/prefill.py --variants \
            --variant-filter "gluon 128x128 s4 q_tma late,gluon 128x128 s4 q_tma late sum_mma,gluon 128x128 s4 q_tma,gluon 128x128 s4 q_tma sum_mma,gluon 128x128 s4 persistent,gluon 128x128 s4 persistent sum_mma" \
            --shapes B1-S8192-H128,B8-S2048-H128,B4-S4096-H16,chunked-q512-k8192-H16,B16-S512-H16 \
            --out "$out/variants-sum-mma.json" > "$out/variants-sum-mma.log" 2>&1 || status=1
        summarize_variants "$out/variants-sum-mma.log"
        if [ $sum_ok = 0 ]; then
            DIAG_PARTS=chain,pair,rows timeout 100 python3 benchmarks/diag_sum_mma.py \
                >> "$out/diag-sum-mma.log" 2>&1 || status=1
            tail -12 "$out/diag-sum-mma.log"
        fi
        ;;
    dev41)
        # stop 41 (run with sum_mma the default, since reverted): the whole GPU suite, then
        # the one-CTA form with and without sum_mma beside FA3 FP8 at the shapes dev40 left out
        all_gpu_tests 380 8
        timeout 180 python3 benchmarks/prefill.py --variants \
            --variant-filter "gluon 128x128 s4 q_tma late sum_mma,gluon 128x128 s4 q_tma late" \
            --shapes B1-S16384-H16,B1-S1024-H16,B1-S2048-H8,varlen-H16 \
            --out "$out/variants-dev41.json" > "$out/variants-dev41.log" 2>&1 || status=1
        summarize_variants "$out/variants-dev41.log"
        ;;
    dev42)
        # stop 41's leads for adopting sum_mma: the isolation test's split case measured (lse
        # and out against the sequence alone and float64, each form with and without it), the
        # persistent form against one CTA per unit with it at the several-sequence shapes
        # (batch_config's choice there), then sum_mma's GPU tests with failures named
        DIAG_PARTS=split timeout 120 python3 benchmarks/diag_sum_mma.py > "$out/diag-split.log" 2>&1 || status=1
        cat "$out/diag-split.log"
        timeout 200 python3 benchmarks/prefill.py --variants \
            --variant-filter "gluon 128x128 s4 q_tma late,gluon 128x128 s4 q_tma late sum_mma,gluon 128x128 s4 persistent,gluon 128x128 s4 persistent sum_mma" \
            --shapes B8-S2048-H128,B4-S4096-H16,B16-S512-H16,varlen-H16 \
            --out "$out/variants-dev42.json" > "$out/variants-dev42.log" 2>&1 || status=1
        summarize_variants "$out/variants-dev42.log"
        timeout -s INT -k 20 150 python3 -m pytest tests/gpu/test_triton.py -q -rfE -p no:cacheprovider \
            --runxfail -k "gluon-sum-mma" > "$out/gpu-tests-sum-mma.log" 2>&1 || status=1
        tail -16 "$out/gpu-tests-sum-mma.log"
        ;;
    dev42b)
        # stop 42: sum_mma the fp8 default and one CTA per unit for several sequences (the
        # persistent form off): every Triton/Gluon GPU test under the new defaults, then the
        # several-sequence shape nearest the threshold (mean keys ~1100) in each form
        timeout -s INT -k 20 330 python3 -m pytest tests/gpu/test_triton.py -q -rfE -p no:cacheprovider \
            --maxfail=20 > "$out/gpu-tests-triton.log" 2>&1 || status=1
        tail -16 "$out/gpu-tests-triton.log"
        timeout 100 python3 benchmarks/prefill.py --variants \
            --variant-filter "triton 64x64 w4 s4,gluon 128x128 s4 q_tma late sum_mma,gluon 128x128 s4 persistent" \
            --shapes B8-S2048-H128 --out "$out/variants-dev42b.json" > "$out/variants-dev42b.log" 2>&1 || status=1
        summarize_variants "$out/variants-dev42b.log"
        ;;
    dev43)
        # stop 42's threshold change for one sequence (3072 -> 1024 mean keys per slice),
        # measured on both sides: B1-S1024-H16 (~580 keys, stays portable), B1-S2048-H8 and
        # B1-S2048-H16 (~1090, now Gluon), each in both kernels with its own split plan
        timeout 200 python3 benchmarks/prefill.py --variants \
            --variant-filter "triton 64x64 w4 s4,gluon 128x128 s4 q_tma late sum_mma" \
            --shapes B1-S1024-H16,B1-S2048-H8 --out "$out/variants-dev43.json" \
            > "$out/variants-dev43.log" 2>&1 || status=1
        summarize_variants "$out/variants-dev43.log"
        ;;
    dev43b)
        # stop 43: 16-bit 128-key steps over two stages with k and v on barriers of their own
        # (split_kv): their GPU tests (the phase-1 param), then the 16-bit variants beside FA3
        # bf16 at two large shapes (cut to fit the device time left). As run in stop 43 the
        # tests were -k "gluon-bf16-n128", the param for that form before it became the default
        # (every Gluon param now runs it)
        timeout -s INT -k 10 90 python3 -m pytest tests/gpu/test_triton.py -q -rfE -p no:cacheprovider \
            --maxfail=5 -k "gluon" > "$out/gpu-tests-split.log" 2>&1 || status=1
        tail -8 "$out/gpu-tests-split.log"
        timeout 150 python3 benchmarks/prefill.py --variants --bf16 \
            --variant-filter "gluon 128x64 s4 pingpong q_tma,gluon 128x128 s2 pingpong q_tma split_kv,gluon 128x128 s2 q_tma split_kv" \
            --shapes B1-S8192-H128,B8-S2048-H128 \
            --out "$out/variants-bf16-dev43b.json" > "$out/variants-bf16-dev43b.log" 2>&1 || status=1
        summarize_variants "$out/variants-bf16-dev43b.log"
        ;;
    dev43c)
        # stop 43, after dev43b (run then as inline commands, the 16-bit default patched in
        # the copy): the 16-bit default against stop 28's at five more shapes, every 16-bit
        # Gluon GPU test, fp8 with and without split_kv at two large shapes
        timeout 200 python3 benchmarks/prefill.py --variants --bf16 \
            --variant-filter "gluon 128x64 s4 pingpong q_tma,gluon 128x128 s2 q_tma split_kv" \
            --shapes B1-S16384-H16,B4-S4096-H16,B1-S1024-H16,B16-S512-H16,chunked-q512-k8192-H16 \
            --out "$out/variants-bf16-dev43c.json" > "$out/variants-bf16-dev43c.log" 2>&1 || status=1
        summarize_variants "$out/variants-bf16-dev43c.log"
        timeout -s INT -k 10 130 python3 -m pytest tests/gpu/test_triton.py -q -rfE -p no:cacheprovider \
            --maxfail=5 -k "bf16 and gluon" > "$out/gpu-tests-bf16.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-bf16.log"
        timeout 100 python3 benchmarks/prefill.py --variants \
            --variant-filter "gluon 128x128 s4 q_tma late sum_mma,gluon 128x128 s4 q_tma late sum_mma split_kv" \
            --shapes B1-S8192-H128,B8-S2048-H128 \
            --out "$out/variants-fp8-dev43c.json" > "$out/variants-fp8-dev43c.log" 2>&1 || status=1
        summarize_variants "$out/variants-fp8-dev43c.log"
        ;;
    dev44)
        # stop 44: the Gluon kernel's PTX without the warpgroup barriers Triton puts before its
        # mbarrier arrives and waits (TileConfig.lean_sync, gluon_sync): every test through
        # it (the phase-1 param), then fp8 and 16-bit with it beside each default and FA3
        timeout -s INT -k 10 110 python3 -m pytest tests/gpu/test_triton.py -q -rfE -p no:cacheprovider \
            --maxfail=5 -k "gluon-lean-sync" > "$out/gpu-tests-lean.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-lean.log"
        timeout 200 python3 benchmarks/prefill.py --variants \
            --variant-filter "gluon 128x128 s4 q_tma late sum_mma,gluon 128x128 s4 q_tma late sum_mma lean,gluon 128x128 s4 q_tma late sum_mma split_kv lean" \
            --shapes B1-S8192-H128,B8-S2048-H128,B1-S16384-H16,B4-S4096-H16 \
            --out "$out/variants-fp8-dev44.json" > "$out/variants-fp8-dev44.log" 2>&1 || status=1
        summarize_variants "$out/variants-fp8-dev44.log"
        timeout 240 python3 benchmarks/prefill.py --variants --bf16 \
            --variant-filter "gluon 128x128 s2 q_tma split_kv,gluon 128x128 s2 q_tma split_kv lean,gluon 128x128 s2 pingpong q_tma split_kv lean,gluon 128x128 s2 q_tma late split_kv lean" \
            --shapes B1-S8192-H128,B8-S2048-H128,B1-S16384-H16,B4-S4096-H16 \
            --out "$out/variants-bf16-dev44.json" > "$out/variants-bf16-dev44.log" 2>&1 || status=1
        summarize_variants "$out/variants-bf16-dev44.log"
        ;;
    dev45o)
        # for stop 45: fp8_outliers through the Triton provider (issue 22): its GPU tests (the
        # portable and the Gluon kernel's side product) and the persistent param's 16-bit
        # isolation tests (stop 44's fixture fix), then what it costs at every shape of
        # prefill.py beside plain fp8 and the rotation (outlier_cost.py: with the Gluon
        # kernel's too), then the accuracy section (ours with the outliers kept out beside the
        # rotation and the peers)
        timeout -s INT -k 10 170 python3 -m pytest tests/gpu/test_fp8_outliers_gpu.py tests/gpu/test_triton.py \
            -q -rfE -p no:cacheprovider -k "outliers or gluon-persistent" \
            > "$out/gpu-tests-outliers.log" 2>&1 || status=1
        tail -6 "$out/gpu-tests-outliers.log"
        timeout 270 python3 benchmarks/outlier_cost.py --out "$out/$(card_name)-outliers.json" \
            > "$out/outlier-cost.log" 2>&1 || status=1
        tail -13 "$out/outlier-cost.log"
        timeout 110 python3 benchmarks/accuracy.py > "$out/accuracy.log" 2>&1 || status=1
        tail -9 "$out/accuracy.log"
        ;;
    dev46)
        # for stop 46: fp8_outliers' second rule (the fp8 rounding of the selected features
        # corrected by fp8 hi/lo side tiles chained in the fp8 product; the maxima published
        # by the quantization): its GPU tests and the isolation test's outliers mode, its cost
        # (outlier_cost.py) and the accuracy section
        outlier_tests_and_cost 110 280 ""
        timeout 110 python3 benchmarks/accuracy.py > "$out/accuracy.log" 2>&1 || status=1
        tail -9 "$out/accuracy.log"
        ;;
    dev46b)
        # for stop 46, after dev46 found NaN bytes in the side tiles' zero group: the side
        # tiles against the rule and each launch's time, the GPU tests and the cost at every
        # shape (the accuracy section: `dev46`)
        outliers_stage 100 100 240 ""
        ;;
    dev46d)
        # dev46b in ~6 minutes of device time: the cost at two shapes
        outliers_stage 100 90 80 B8-S2048-H128,B1-S1024-H16
        ;;
    dev45)
        # for stop 45: the two tests stop 44's GPU suite failed in its fixture (the persistent
        # param's 16-bit isolation tests; the fixture since gives the one-CTA form the
        # persistent form's numerics), every persistent-param test, then Nsight Compute (full
        # set) of the 16-bit default and of FA3's bf16 forward at B8-S2048-H128 (the large
        # shape furthest behind: 0.86x in stop 44's final)
        timeout -s INT -k 10 150 python3 -m pytest tests/gpu/test_triton.py -q -rfE -p no:cacheprovider \
            -k "gluon-persistent" > "$out/gpu-tests-persistent.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-persistent.log"
        PROFILE_ARGS=--bf16 ncu_phase1 B8-S2048-H128 200 "-bf16" \
            "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Stall|Warp Cycles Per Issued" \
            --set full
        ;;
    dev36b)
        # stop 36: the whole GPU suite in one call (a warm machine runs it in ~5 minutes)
        all_gpu_tests 540 8
        ;;
    dev32b)
        # the GPU suite's second half
        all_gpu_tests 560 8 -2of2
        ;;
    dev31)
        all_gpu_tests 290 6
        timeout 110 python3 benchmarks/rotation_cost.py --kernels flash_attn --rotations gluon \
            --gluon-variants w8,w2,r16,b1 --min-chunks 64 --shapes B1-S1024-H16,B1-S2048-H8,B16-S512-H16 \
            --out "$out/h200-rotation-small-knobs.json" > "$out/rotation-cost-small.log" 2>&1 || status=1
        tail -3 "$out/rotation-cost-small.log" | cut -c1-1500
        ;;
    final29)
        # stop 29's final run: the FA3 provider's GPU tests (equal-length batches in FA3's
        # batched layout among them), then the benchmark without its serving section (every
        # shape and peer, the dispatch table, auto measured again with it, accuracy)
        timeout 110 python3 -m pytest tests/gpu/test_flash_attn_gpu.py -q -p no:cacheprovider \
            --maxfail=10 > "$out/gpu-tests-fa3.log" 2>&1 || status=1
        tail -4 "$out/gpu-tests-fa3.log"
        timeout 440 python3 benchmarks/prefill.py --no-serving --out "$out/h200.json" \
            --dispatch-out mla_plugins/core/dispatch_h200.json > "$out/prefill.log" 2>&1 || status=1
        cp mla_plugins/core/dispatch_h200.json "$out/" 2>/dev/null
        tail -40 "$out/prefill.log"
        ;;
    final29b)
        # after final29, one sequence back on FA3's varlen call (the batched layout was 8% slower
        # at B1-S2048-H8): the equal-length GPU tests, then the four one-sequence shapes the
        # change touches (their rows and dispatch entries replace final29's; the other rows
        # ran the same code)
        timeout 60 python3 -m pytest tests/gpu/test_flash_attn_gpu.py -q -p no:cacheprovider \
            -k "equal_lengths or long" > "$out/gpu-tests-fa3.log" 2>&1 || status=1
        tail -3 "$out/gpu-tests-fa3.log"
        timeout 330 python3 benchmarks/prefill.py --no-serving --no-accuracy --out "$out/h200-b1.json" \
            --shapes B1-S8192-H128,B1-S16384-H16,B1-S2048-H8,B1-S1024-H16 \
            --dispatch-out "$out/dispatch-b1.json" > "$out/prefill-b1.log" 2>&1 || status=1
        tail -8 "$out/prefill-b1.log"
        ;;
    variants)
        python3 benchmarks/unit_cost.py --out "$out/h200-unit-cost.json" \
            2>&1 | tee "$out/unit-cost.log" || status=1
        python3 benchmarks/prefill.py --variants --out "$out/h200-variants.json" \
            2>&1 | tee "$out/variants.log" || status=1
        ;;
    *)
        echo "unknown stage $stage (check, bench, final, auto, host, rotation, amortized, kernel, gluon16, dev28, dev29, dev30, dev30b, final30, final30b, dev31, dev31b, dev32a, dev32b, dev33, dev33b, dev33c, dev34, dev34b, dev35, dev36, dev36b, dev36c, dev40, dev40a, dev41, dev42, dev42b, dev43, dev43b, dev43c, final29, final29b, verify, profile, last or variants)" >&2
        exit 2
        ;;
esac
exit $status
