#!/usr/bin/env bash
# Quartet on a GPU, in one command: the environment, the device-sensitive tests on CUDA, SFT / PPO (GAE) / GRPO on
# tiny models on CUDA and on the CPU with their outputs compared, and PPO on a SmolLM2-135M-shaped model against
# TRL 1.12 on the same workload. Writes $OUT/gpu_check.md and $OUT/gpu_check.json (and the parts beside them).
#
#   OUT=/tmp/gpu bash scripts/gpu_check.sh            # on the GPU machine (or, slower, on a CPU with tiny models)
#
# Python: $PYTHON, else .venv/bin/python where there is one, else python3. Wheels in .whl/ (trl, datasets, gguf,
# ...: what that machine lacks) and Quartet itself are installed into that Python's environment first where
# Quartet is not importable yet (a bare GPU machine). The
# SmolLM2-shaped benchmark (GPU_CHECK_PROFILE=1: and one more iteration per Quartet side under torch.profiler,
# over a minute each on an H200) needs .gpu/smollm2-shape (config + tokenizer, no weights: scripts/gpu_assets.py) and
# TRL importable; without them that step is skipped and says so. Each step has its own time limit (GPU_CHECK_*_S),
# so the whole check ends inside 10 minutes on an H100; a step that fails is recorded and the next one runs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
: >"$OUT/steps.txt"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -d .whl ] && ! "$PY" -c "import quartet" 2>/dev/null; then  # a bare machine: what it lacks, and Quartet
    # into the interpreter's own environment, so the tests' `python -m quartet.cli` subprocesses find it too
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
        && "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir . \
        || { echo "error: installing the carried wheels and Quartet failed"; exit 2; }
fi

step() {  # step NAME LIMIT_S COMMAND...: run it under a time limit; record rc and seconds in steps.txt
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "=== $name (limit ${limit}s): $*" >&2
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "$name: rc $rc, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt" >&2
    return $rc
}

step env 60 "$PY" scripts/gpu_check.py env >"$OUT/env.json"
cat "$OUT/env.json"
command -v nvidia-smi >/dev/null && nvidia-smi

# the device-sensitive tests (marked gpu), on CUDA where there is one; -n: one worker per 2 cores, at most 8
WORKERS=$(( $(nproc) / 2 )); [ "$WORKERS" -gt 8 ] && WORKERS=8; [ "$WORKERS" -lt 1 ] && WORKERS=1
TIMEOUT_ARG=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=240")
step tests "${GPU_CHECK_TESTS_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -m gpu -n "$WORKERS" $TIMEOUT_ARG \
    --tb=short --junitxml="$OUT/junit.xml" ${GPU_CHECK_PYTEST_ARGS:-} tests

# the same fp32 tiny runs on the GPU and on the CPU, then compared (one torch thread each; both at once)
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    step runs 240 bash -c "QUARTET_DEVICE=cuda $PY scripts/gpu_check.py runs --out '$OUT/runs/cuda' >'$OUT/runs-cuda.log' 2>&1 &
        pid=\$!; QUARTET_DEVICE=cpu OMP_NUM_THREADS=1 $PY scripts/gpu_check.py runs --out '$OUT/runs/cpu' >'$OUT/runs-cpu.log' 2>&1;
        a=\$?; wait \$pid; b=\$?; exit \$(( a | b ))"
    cp "$OUT/runs/cuda/reached.json" "$OUT/reached_cuda.json" 2>/dev/null
    cp "$OUT/runs/cpu/reached.json" "$OUT/reached_cpu.json" 2>/dev/null
    step compare 60 "$PY" scripts/gpu_check.py compare "$OUT/runs/cpu" "$OUT/runs/cuda" --json "$OUT/compare.json" >/dev/null
else
    echo "no GPU: the CPU-vs-GPU comparison is skipped" | tee -a "$OUT/steps.txt"
fi

# PPO on a SmolLM2-135M-shaped model with random weights, Quartet against TRL 1.12 (benchmarks/vs_trl.py)
if [ -d .gpu/smollm2-shape ] && "$PY" -c "import trl" 2>/dev/null; then
    step vs_trl "${GPU_CHECK_BENCH_S:-240}" "$PY" benchmarks/vs_trl.py --model .gpu/smollm2-shape --random-init \
        --trl-python current --sequential --iterations 3 --threads 4 --json "$OUT/vs_trl.json" \
        $( [ "${GPU_CHECK_PROFILE:-0}" = 1 ] && echo --profile "$OUT/profile" ) ${GPU_CHECK_BENCH_ARGS:-}
else
    echo "vs_trl: skipped (needs .gpu/smollm2-shape from scripts/gpu_assets.py and trl importable)" | tee -a "$OUT/steps.txt"
fi

"$PY" scripts/gpu_check.py summary --out "$OUT" >/dev/null
find "$OUT/runs" \( -name model -o -name tb -o -name best \) -type d -prune -exec rm -rf {} + 2>/dev/null  # keep the
# metrics and samples (`gpu_check.py compare` can be rerun on them), not the models
cat "$OUT/gpu_check.md"
