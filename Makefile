# Two entry points for a fresh machine (Python >= 3.10 and make are all it needs):
#   make verify   set up .venv, then run `streamkl verify` (GPU if present, else the Triton interpreter on CPU)
#   make test     set up .venv, then run the whole test suite (tests/ and proofs/)
PY ?= python3
VENV ?= .venv
# The torch wheel to install. The default is the CPU build that the CI machines carry on disk;
# on a GPU machine that already has torch, use `make TORCH=torch ...` (or your own CUDA build).
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.streamkl-installed

.PHONY: verify test docs bench-plots clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[gpu,test,docs]"
	touch $@

verify: $(STAMP)
	$(BIN)/streamkl verify

# two pytest-xdist workers (CI's 2 cores: 7 min instead of 9); `make test TEST_WORKERS=0` runs serially
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site
