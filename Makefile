# The two README commands: `make demo` (main job) and `make test` (test suite).
# Each creates its own virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel on this machine's local disk; GPU users: make TORCH_SPEC='torch>=2.9' ...
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

# Docker: a local Debian base (no image registry needed) and the image; GPU users: compose.gpu.yaml.
DOCKER_BASE ?= mapl-swarm-base:bookworm
IMAGE ?= mapl-swarm:latest
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

.PHONY: setup demo test bench-quality sweep-cpu clean docker-base docker-wheels docker-image compose-demo

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/mapl-swarm launch --config peers/demo.toml

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

bench-quality: $(VENV)/.installed
	$(BIN)/python bench/quality.py

sweep-cpu: $(VENV)/.installed   # ~1 h on 2 cores; resumable (re-run to continue)
	$(BIN)/mapl-swarm sweep --grid bench/grids/cpu.toml --publish bench/results/sweep-cpu --benchmarks BENCHMARKS.md

docker-base:   # the local base image, unless it exists (root, debootstrap, a running Docker engine)
	docker image inspect $(DOCKER_BASE) >/dev/null 2>&1 || docker/build-base.sh $(DOCKER_BASE)

docker-wheels: $(VENV)/.installed   # the torch this machine's pip resolves, into the build context
	$(BIN)/pip download -q --no-deps -d docker/wheels "$(TORCH_SPEC)"

docker-image: docker-base docker-wheels
	docker build -f docker/Dockerfile --build-arg BASE=$(DOCKER_BASE) --build-arg TORCH_SPEC="$(TORCH_SPEC)" \
		--build-arg TORCH_INDEX= -t $(IMAGE) .

compose-demo: docker-image   # the compose swarm to its end; `$(COMPOSE) up -d` again resumes a stopped one
	docker/compose-demo.sh $(COMPOSE)

clean:
	rm -rf $(VENV)
