#!/usr/bin/env bash
# On the GPU machine: install the carried FLA wheels, run the cuda tests, then the scoring benchmark.
# Usage (repo root): bash benchmarks/device_run.sh [pytest args...]; logs go to $OUT (or ./device-out). The wheels
# (`pip download --no-deps -d .whl fla-core==0.5.2 flash-linear-attention==0.5.2`) are git-ignored: carry `.whl`.
# SKIP_TESTS=1, SKIP_BENCH=1, TEST_TIMEOUT=s, PYTEST_WORKERS=n (default 8: NOTES 98; the suite wants a call of its own),
# BENCH_ARGS='...', AB_FUSED_CONV=1 (bench again with FLA's branch conv: bench_score.py --fla conv),
# KERNELS=1|names (benchmarks/bench_kernels.py: launch configurations of our kernels, before the tests), LONGJOB=rows (a long job of that
# many rows, one document per 10, on Kev-0.8B: issue 7's run; its last --log-json line is the summary),
# NCU=1|'kernel:bench name,...' (Nsight Compute, --clock-control none; default the branch conv and attention),
# JOB=1 (benchmarks/bench_job.py: issue 17's whole job cold and warm, baselines, scoring budgets, prefill alone; JOB_ARGS='...'),
# JOB_AB='NAME=value' and/or JOB_AB_ARGS='--fla solve' (the same job again with that environment or those bench_job
# arguments, e.g. a KEVSCORE_ switch or FLA's ops swapped in: job-ab.json),
# START=1 (benchmarks/bench_start.py: a job's start step by step in fresh processes, cold and warm),
# CPU_TESTS='tests/a.py tests/b.py' (those CPU tests first, on the image's transformers and tokenizers).
# Tests run under pytest-xdist so that a crashing test is reported instead of ending the run.
set -o pipefail
OUT="${OUT:-device-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton-cache}"
python3 -c "import torch, triton, transformers, fla; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__, fla.__version__)"
if [ "${KERNELS:-0}" != 0 ]; then  # KERNELS=1: all of them; KERNELS='conv,kkt solve': those (commas between names)
  only=(); [ "$KERNELS" = 1 ] || { IFS=, read -ra names <<< "$KERNELS"; only=(--only "${names[@]}"); }
  python3 benchmarks/bench_kernels.py "${only[@]}" --json "$OUT/kernels-kev-4b.json" > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"; grep -E "^conv" "$OUT/kernels.log"
  sed -n '/best per kernel/,$p' "$OUT/kernels.log"
fi
if [ -n "${CPU_TESTS:-}" ]; then  # CPU test files on this image's packages (e.g. the tokenizer snapshot on its transformers)
  timeout 300 python3 -m pytest -q -p no:hypothesispytest --tb=line -rfE $CPU_TESTS 2>&1 | tee "$OUT/pytest_cpu.log" | tail -5
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -m cuda -q -n "${PYTEST_WORKERS:-8}" --dist loadgroup -p no:hypothesispytest --tb=line -rfEP --durations=12 "$@" 2>&1 \
    | tee "$OUT/pytest_cuda.log" | grep -E "^(FAILED|ERROR|E |/)|max \||passed|failed|crashed" | tail -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then  # FLA caches autotune results on disk by keys without the token count:
  # configs tuned on the tests' small shapes would be reused at the benchmark's, so the bench tunes afresh
  TRITON_CACHE_DIR="$(mktemp -d)" python3 benchmarks/bench_score.py ${BENCH_ARGS:---model kev-4b --profile --json "$OUT/score-kev-4b.json"} 2>&1 | tee "$OUT/bench.log" | tail -30
fi
if [ "${AB_FUSED_CONV:-0}" = 1 ]; then  # the same benchmark with FLA's branch conv (NOTES.md 6)
  python3 benchmarks/bench_score.py --model kev-4b --profile --hf-reps 0 --fla conv \
    --json "$OUT/score-kev-4b-fla-conv.json" 2>&1 | tee "$OUT/bench-fla-conv.log" | tail -30
fi
if [ "${NCU:-0}" != 0 ]; then  # Nsight Compute on our kernels at the benchmark's shapes: the first launch of each
  # in bench_kernels.py --defaults; NCU=1: the branch conv and attention, else NCU='kernel:bench name,...'
  # (e.g. NCU='_branch_conv_kernel:prefill conv' for prefill's packed conv)
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -1)
  pairs=(_branch_conv_kernel:conv _branch_attn_kernel:attention)
  [ "$NCU" = 1 ] || IFS=, read -ra pairs <<< "$NCU"
  for pair in "${pairs[@]}"; do
    kern=${pair%%:*} bench=${pair#*:}
    name="$kern-${bench// /-}"
    timeout 240 "$NCU_BIN" --clock-control none --set detailed -k "regex:$kern" -c 1 -f -o "$OUT/$name" \
      python3 benchmarks/bench_kernels.py --defaults --only "$bench" > "$OUT/ncu-$name.log" 2>&1
    echo "ncu $name rc=$?"
    "$NCU_BIN" --import "$OUT/$name.ncu-rep" --page details > "$OUT/ncu-$name.txt" 2>&1
    grep -E "^  [a-zA-Z_]|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Block Limit|Local" \
      "$OUT/ncu-$name.txt" | head -24
  done
fi
if [ "${JOB:-0}" = 1 ]; then  # the job benchmark keeps its own Triton cache (its cold start empties it)
  eval "job_args=(${JOB_ARGS:---profile})"  # the shell's words and quotes: JOB_ARGS="--budgets '' --prefill-docs ''"
  python3 benchmarks/bench_job.py "${job_args[@]}" --logs "$OUT" --json "$OUT/job.json" 2>&1 | tee "$OUT/job.log" | tail -14
  if [ -n "${JOB_AB:-}${JOB_AB_ARGS:-}" ]; then  # the A/B's logs stay on the machine: $OUT brings back 8 files at most
    mkdir -p /tmp/job-ab && env ${JOB_AB:+"$JOB_AB"} python3 benchmarks/bench_job.py "${job_args[@]}" ${JOB_AB_ARGS:-} --logs /tmp/job-ab \
      --json "$OUT/job-ab.json" 2>&1 | tee "$OUT/job-ab.log" | tail -14
  fi
fi
if [ "${START:-0}" = 1 ]; then  # imports, CUDA context, the kernels' compile with and without the workers
  python3 benchmarks/bench_start.py --json "$OUT/start.json" 2>&1 | tee "$OUT/start.log" | tail -22
fi
if [ -n "${LONGJOB:-}" ]; then  # issue 7: a long job on the Kev-0.8B shape, summary = last JSON line
  python3 benchmarks/make_long_input.py /tmp/long.parquet --rows "$LONGJOB" --docs $((LONGJOB / 10)) || exit 1
  /usr/bin/time -v python3 -m kevscore run /tmp/long.parquet --model kev-0.8b --device cuda -o /tmp/long.scores.parquet \
    --overwrite --log-json > "$OUT/longjob.jsonl" 2> "$OUT/longjob.err"; echo "longjob rc=$?"
  grep -E "Maximum resident|Elapsed" "$OUT/longjob.err"; tail -c 1500 "$OUT/longjob.jsonl"
fi
