export CPU_TESTS=tests/test_tokenizer_load.py PYTEST_WORKERS=14 TEST_TIMEOUT=260 SKIP_BENCH=1 JOB=1 START=1
export JOB_ARGS='--profile --budgets= --baseline-docs 0 --prefill-docs='
bash benchmarks/device_run.sh
