# Set-up and everyday commands. A fresh machine needs only `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[torch,dev]'
	rm -f $(VENV)/.installed-*; touch $@

demo: $(STAMP)
	$(BIN)/gputrace record -f -o demo.arrow -- $(BIN)/torchrun --standalone --nproc_per_node 2 \
		samples/train_cnn.py --preset case2 --iterations 30
	$(BIN)/gputrace analyze demo.arrow

lint: $(STAMP)
	$(BIN)/ruff check gputrace tests samples bench

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo.arrow build *.egg-info
