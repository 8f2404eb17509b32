TEST_TIMEOUT=330 PYTEST_WORKERS=14 SKIP_BENCH=1 bash benchmarks/device_run.sh 2>&1 | grep -vE "PytestBenchmarkWarning|^$" | tail -25
export PYTHONPATH="/tmp/site:$PWD" TRITON_CACHE_DIR=$PWD/.triton-cache
for spec in "0 85" "1 85" "1 64"; do set -- $spec
  timeout 120 python3 benchmarks/bench_score.py --model kev-4b --q-len $2 --hf-reps 0 $([ "$1" = 0 ] && echo --fla wy) --json $OUT/score$2-wy$1.json > $OUT/score$2-wy$1.log 2>&1
  echo "wy=$1 q=$2 rc=$?"; grep -E "^(indexed|gathered) |max \|dp\|" $OUT/score$2-wy$1.log
done
