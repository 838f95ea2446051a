# `make demo` serves the reference model on a local Ray instance; `make test` runs the test suite.
# Both create .venv and install what they need (a CPU build of torch when none is installed).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0

.PHONY: demo test test-fast test-avx2 bench install clean grpc-stubs lerobot-reference docs clients

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# The clients' venv is installed first, so the suite's time is the tests' own. The sources are compiled
# once here: where PYTHONDONTWRITEBYTECODE is set, every rank process would compile them again.
# After the whole suite, `make test` runs the inline parity and precision tests again on the kernels a
# CPU without AVX-512 gets (test-avx2): tolerances must hold on any CPU, not only on this one's.
test: $(VENV)/.installed
	$(PY) tests/client_venv.py
	$(PY) -m compileall -q -j0 phyai_ray actors placement tests examples benchmarks
	$(PY) -m pytest --durations=30
	$(MAKE) --no-print-directory test-avx2

# The parity and precision tests that run inline (Ray's are skipped there), with torch, MKL and oneDNN capped
# at AVX2.
AVX2 := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
PARITY_INLINE := tests/test_hf_precision.py tests/test_hf_causal_lm.py tests/test_hf_paged.py tests/test_llm_logits.py \
	tests/test_nn.py tests/test_sampler.py tests/test_rtc_batch.py tests/test_stepwise.py tests/test_flow_policy.py \
	tests/test_lerobot_policy.py tests/test_lerobot_policy_batched.py tests/test_diffusers_pipeline.py \
	tests/test_diffusers_cosmos3.py tests/test_minilm.py
test-avx2: $(VENV)/.installed
	$(AVX2) PHYAI_TEST_FAST=1 $(PY) -m pytest -q -p no:cacheprovider -m "not ray and not torchrun" $(PARITY_INLINE)

# The edit loop: pure and inline tests (nothing that starts Ray or torchrun, nothing marked slow), a few
# minutes; `make test` stays the whole suite and is what CI runs.
test-fast: $(VENV)/.installed
	PHYAI_TEST_FAST=1 $(PY) -m pytest -q -m "not ray and not torchrun and not slow"

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link or reference.
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict

# .venv-clients/: the third-party clients whose pins this project cannot take (openpi-client: numpy < 2;
# tritonclient[grpc]: protobuf < 7), for examples/robot_client.py and robot_fleet.py. The same venv the
# tests build on first use (tests/client_venv.py holds the package list); needs the package index once.
clients: $(VENV)/.installed
	$(PY) tests/client_venv.py

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .venv-clients .pytest_cache site

# The Open Inference Protocol's gRPC modules, generated from phyai_ray/serve/grpc_v2/grpc_predict_v2.proto
# with grpcio-tools 1.75 (protobuf 6.31 gencode: loads on protobuf >= 6.31, 7.x included). Never edit them.
grpc-stubs:
	$(PYTHON) -m venv /tmp/phyai-grpc-tools
	/tmp/phyai-grpc-tools/bin/pip install -q "grpcio-tools>=1.75,<1.76"
	/tmp/phyai-grpc-tools/bin/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \
		phyai_ray/serve/grpc_v2/grpc_predict_v2.proto

# tests/data/lerobot/: tiny random SmolVLA / pi0 / pi0.5 folders and LeRobot 0.4.4's action chunks for them,
# made in venvs of their own (Python 3.11, /tmp/lerobot-venv and /tmp/lerobot-openpi-venv). The tests
# never need these venvs; run this only to regenerate the files.
lerobot-reference:
	bash scripts/lerobot_reference/build_venv.sh
	/tmp/lerobot-venv/bin/python scripts/lerobot_reference/make_reference.py --policy smolvla --out tests/data/lerobot
	/tmp/lerobot-openpi-venv/bin/python scripts/lerobot_reference/make_reference.py --policy pi0 --out tests/data/lerobot
	/tmp/lerobot-openpi-venv/bin/python scripts/lerobot_reference/make_reference.py --policy pi05 --out tests/data/lerobot
	/tmp/lerobot-openpi-venv/bin/python scripts/lerobot_reference/full_size_shapes.py --out tests/data/lerobot
