#!/usr/bin/env bash
# The prepared GPU check (one H200, no network): installs the wheels the image lacks, then runs, each under its
# own time limit, writing logs and JSON to $OUT (default ./gpu_out). In order of priority:
#   1. generation benchmark:   the SDAR-4B rollout table (issue 13's targets)   -> generation.log
#   1b. the same with fused kernels (set_fused_kernels), batch 1 and 128      -> generation_fused.log
#   1c. training, SDPA, eager and fused kernels side by side (MFU)            -> training_fused.json
#   2. training benchmark:     SDAR-4B shapes, flex and SDPA side by side (MFU) -> training_sdar4b.json
#   2b. generation profile:    the kernels of an eager cached SDAR-4B step, batch 1 and 128 -> generation_profile.log
#   3. the GPU tests:          pytest -m gpu, CUDA-graph decoding first, then every other gpu-marked test; -v, so a
#                              log cut by its limit still names each result -> gpu_graph_tests.log, gpu_tests.log
#   4. generation benchmark:   the LLaDA-1.6B table (no cache, prefix, dual)    -> generation_llada.log
#   5. flex-attention probe:   which head sizes / dtypes compile                -> flex_probe.json
#   6. scoring memory:         LLaDA full-attention rows, layer checkpointing vs recompute_scoring_forwards
#                                                                            -> memory_recompute.json
# A step that would start with under 30 s of the budget (GPU_CHECK_BUDGET, default 570 s) left is skipped, and each
# step's limit is cut to what is left. Measured on 2026-12-04 (one H200): step 1 took 136 s; step 2's flex
# configuration did not finish its first (compiling) step within 60 s, SDPA took ~35 s; the CUDA-graph tests 18 s;
# the other gpu tests 215 s (72 s of it compiling flex for the first test); steps 4-6 needed more than 40 / 25 /
# 40 s. Steps 1b and 1c (added after that run) are unmeasured; their limits guess a minute of compiling. Not all
# steps fit one 10-minute device call: run them as two calls on the same warm machine, e.g.
#   GPU_CHECK_STEPS="generation generation_fused training_fused generation_profile gpu_graph_tests" bash ...
#   GPU_CHECK_STEPS="gpu_tests generation_llada flex_probe memory_recompute" bash ...
# (the second with GPU_CHECK_BUDGET=220 and GPU_CHECK_PYTEST_K="fused or compiled_flex or example or launches", see
# below; training_sdar4b, flex beside SDPA, then waits for a session with more device time)
# (GPU_CHECK_STEPS: the steps to run, by name; default all). GPU_CHECK_PYTEST_K="expression" runs only the gpu
# tests pytest's -k selects (e.g. "compiled_flex"). A session's 15 minutes of device time (the machine's start
# included) hold the first call and about 4 minutes of the second: give that one GPU_CHECK_BUDGET=220, or select
# fewer steps or tests.
#
# Before (on a machine with network, in the project root): bash <shared>/gpu/wheels.sh .whl
# (the wheels of transformers / trl / datasets the project pins; keep .whl/ out of git), plus the pure-Python wheels
# the gpu tests and the math reward need in case the image lacks them:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl \
#       pytest pluggy iniconfig math-verify==0.9.0 latex2sympy2_extended antlr4-python3-runtime==4.13.2
# and send .whl along (the device tool's carry: [".whl"]). Then, from the project root:  bash scripts/gpu_check.sh
#
# GPU_CHECK_LOGS=DIR writes the logs to DIR and packs them into $OUT/gpu_check.tar.gz after every step: a run cut
# short still brings back what it measured, and the device tool returns at most 8 files (use it there:
# GPU_CHECK_LOGS=/tmp/gpu_logs bash scripts/gpu_check.sh). The step lines and the measured tables also go to stdout.
# GPU_CHECK_TINY=1 runs the same steps on the CPU with the tiny presets (a dry run of this script, e.g. with
# GPU_CHECK_BUDGET=300, and GPU_CHECK_LIMIT_SCALE=4 (or 1.5) to multiply every step's limit on a slow or busy CPU;
# the gpu tests skip there). The pytest steps continue past a test module that fails to import (a package the GPU
# image lacks), so the gpu tests still run. GPU_CHECK_PRINT=1 runs nothing: it prints each selected step's command as bash
# expands it ("NAME: ARG ARG ...", each argument shell-quoted), which the test suite runs in its own process.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
LOGS="${GPU_CHECK_LOGS:-$OUT}"  # where the logs go; a folder other than $OUT is packed into $OUT after each step
mkdir -p "$OUT" "$LOGS"
START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-570}  # seconds; a step that would start after this is skipped

if [ "${GPU_CHECK_PRINT:-0}" = 1 ]; then
    :  # only the commands: nothing installed, nothing imported
elif compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        > "$LOGS/install.log" 2>&1 || echo "wheel install failed (see install.log)"
    export PYTHONPATH="/tmp/site:$PWD"
else
    echo "no .whl/ folder: using the image's packages" | tee "$LOGS/install.log"
    export PYTHONPATH="$PWD"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${GPU_CHECK_PRINT:-0}" != 1 ]; then
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'trl', trl.__version__)"
        python3 -c "import pytest, math_verify; print('pytest', pytest.__version__, 'math_verify ok')"
    } > "$LOGS/environment.txt" 2>&1
    cat "$LOGS/environment.txt"
fi

if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
    DEVICE=cpu SDAR=tiny LLADA=llada-tiny TRAIN=tiny PROBE=(--head_dims 16 --dtypes float32 --lengths 40 56)
    FUSED_BATCHES=(1 8)
    MEMORY=(--lengths 32 --hidden 64 --layers 1 --vocab 512 --prompt 16)
else
    DEVICE=cuda SDAR=sdar-4b LLADA=llada-1.6b TRAIN=sdar-4b PROBE=()
    FUSED_BATCHES=(1 128)  # the two targets
    MEMORY=(--lengths 256 --hidden 2048 --layers 8 --vocab 126464 --dtype bfloat16 --prompt 128)
fi

left() { echo $((BUDGET - (SECONDS - START))); }
step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit unless the budget is spent
    local name=$1 limit
    limit=$(awk -v seconds="$2" -v scale="${GPU_CHECK_LIMIT_SCALE:-1}" 'BEGIN { printf "%d", seconds * scale }')
    shift 2
    case " ${GPU_CHECK_STEPS:-all} " in *" all "*|*" $name "*) ;; *) return ;; esac
    if [ "${GPU_CHECK_PRINT:-0}" = 1 ]; then
        printf '%s:' "$name"; printf ' %q' "$@"; echo
        return
    fi
    if [ "$(left)" -lt 30 ]; then
        echo "$name: skipped (budget spent)" | tee -a "$LOGS/summary.txt"
        return
    fi
    [ "$limit" -gt "$(left)" ] && limit=$(left)
    local begin=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - begin)) s (limit $limit s)" | tee -a "$LOGS/summary.txt"
    pack
}
pack() {  # with GPU_CHECK_LOGS set: one archive and the summary in $OUT (the device tool brings back at most 8 files)
    [ "$LOGS" = "$OUT" ] && return
    tar czf "$OUT/gpu_check.tar.gz.part" -C "$LOGS" . && mv "$OUT/gpu_check.tar.gz.part" "$OUT/gpu_check.tar.gz"
    cp "$LOGS/summary.txt" "$OUT/summary.txt" 2>/dev/null
}

step generation 150 python3 benchmarks/generation.py --device $DEVICE --preset $SDAR
step generation_fused 180 python3 benchmarks/generation.py --device $DEVICE --preset $SDAR --fused_kernels \
    --batch_sizes_table "${FUSED_BATCHES[@]}"
step training_fused 200 python3 benchmarks/training.py --preset $TRAIN --device $DEVICE --timeout 120 \
    --backends sdpa --kernels eager fused --output "$LOGS/training_fused.json"
step training_sdar4b 300 python3 benchmarks/training.py --preset $TRAIN --device $DEVICE --timeout 200 \
    --profile --output "$LOGS/training_sdar4b.json"
step generation_profile 60 python3 benchmarks/generation.py --device $DEVICE --preset $SDAR --profile
step gpu_graph_tests 40 python3 -m pytest -v -m gpu tests/test_static_cache.py -p no:cacheprovider \
    --junitxml="$LOGS/gpu_graph_tests.xml"
# the other modules with gpu-marked tests (collecting the whole suite only to skip it cost ~10 s of the budget)
GPU_TEST_FILES=$(grep -l "mark.gpu" tests/test_*.py | grep -v "tests/test_static_cache.py")
PYTEST_K=()
[ -n "${GPU_CHECK_PYTEST_K:-}" ] && PYTEST_K=(-k "$GPU_CHECK_PYTEST_K")
# shellcheck disable=SC2086
step gpu_tests 240 python3 -m pytest -v -m gpu $GPU_TEST_FILES ${PYTEST_K[@]+"${PYTEST_K[@]}"} -p no:cacheprovider \
    --continue-on-collection-errors --durations=20 --junitxml="$LOGS/gpu_tests.xml"
step generation_llada 60 python3 benchmarks/generation.py --device $DEVICE --preset $LLADA
step flex_probe 45 python3 scripts/flex_probe.py --device $DEVICE ${PROBE[@]+"${PROBE[@]}"} --output "$LOGS/flex_probe.json"
step memory_recompute 60 python3 benchmarks/memory.py --device $DEVICE --family llada --shrinkage 8 --batch 1 \
    "${MEMORY[@]}" --variants checkpointing budget_2048_recompute \
    --output "$LOGS/memory_recompute.json"
[ "${GPU_CHECK_PRINT:-0}" = 1 ] && exit 0
tail -n 3 "$LOGS/gpu_graph_tests.log" "$LOGS/gpu_tests.log" >> "$LOGS/summary.txt" 2>/dev/null
echo "total: $((SECONDS - START)) s" | tee -a "$LOGS/summary.txt"
pack
# the measured tables on stdout too (the device tool returns the output's tail even when files do not come back)
for log in generation generation_fused generation_llada generation_profile; do
    echo "== $log"; grep -h '^{"' "$LOGS/$log.log" 2>/dev/null | cut -c1-400
done
for table in training_sdar4b training_fused; do
    echo "== $table"
    python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1])).get('table'), indent=0))" \
        "$LOGS/$table.json" 2>/dev/null | cut -c1-600
done
echo "== gpu tests not passed"
grep -h -E " (FAILED|ERROR)" "$LOGS/gpu_graph_tests.log" "$LOGS/gpu_tests.log" 2>/dev/null | cut -c1-300
cat "$LOGS/summary.txt"
