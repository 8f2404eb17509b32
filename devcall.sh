export PYTEST_WORKERS=14 TEST_TIMEOUT=240 JOB=1 START=1
export JOB_ARGS='--budgets= --baseline-docs 0 --prefill-docs='
export BENCH_ARGS='--model kev-4b --q-len 85 --hf-reps 0 --json '"$OUT"'/score85.json'
bash benchmarks/device_run.sh
