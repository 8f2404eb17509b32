export CPU_TESTS=tests/test_tokenizer_load.py PYTEST_WORKERS=14 TEST_TIMEOUT=240 SKIP_BENCH=1 JOB=1
export JOB_ARGS='--budgets= --prefill-docs='
bash benchmarks/device_run.sh
