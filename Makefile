# Two entry points (README quick start): `make train` and `make test`.
# Each creates .venv on first use; torch is pinned by constraints.txt (CPU build on local disk).
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test lint docs setup clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,docs]'
	touch $(STAMP)

setup: $(STAMP)

# The main job is a demo: each `make train` starts it afresh in runs/default.
train: $(STAMP)
	$(BIN)/zerotrain train --config configs/default.yaml --nproc 2 --logging.overwrite true

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(MKDOCS)
	$(BIN)/python -m pytest -q

# The manual (docs/, mkdocs.yml) built in strict mode: a broken link, anchor or API
# reference fails. Seconds; the site goes to build/site (git-ignored).
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
docs: $(STAMP)
	$(MKDOCS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

clean:
	rm -rf runs .pytest_cache .ruff_cache build/site
