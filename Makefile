# Set-up and everyday commands. A fresh machine needs only `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
CHROMIUM := /usr/bin/chromium
APT := DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -q
# PyTorch's compiled extensions (DeepSpeed's CPU comm op) kept with this venv: built once
# when it is installed, never rebuilt because another checkout's venv built its own
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch-extensions

.PHONY: demo test lint docs clean browser screenshot gpu-wheels gpu-check bytecode

# The extras by their ranges, the releases from constraints.txt (the same on every run).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# TensorFlow as tensorflow-cpu (the `tf` extra names `tensorflow`, which users with a GPU want)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[torch,dev,notebook,trainers,docs]' \
		tensorflow-cpu keras
	# tf_keras (Keras 2, TF_USE_LEGACY_KERAS) for its tests: it asks for `tensorflow`, whose
	# module tensorflow-cpu already is (both installed, removing either breaks the other)
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps tf-keras
	# DeepSpeed for its tests, on the CPU (DS_ACCELERATOR=cpu): its sdist builds against the
	# torch installed above (no isolated build: it would fetch another torch); no ops compiled
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -c constraints.txt --no-build-isolation deepspeed
	# its CPU comm op, which a DeepSpeed job on the CPU compiles at its first start (~30 s),
	# compiled here, with the venv, rather than inside the first test that starts one
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.ops.op_builder.cpu import \
		ShareMemCommBuilder; ShareMemCommBuilder().load()" >/dev/null 2>&1 || \
		echo "DeepSpeed's CPU comm op did not compile here: its first test job compiles it"
	rm -f $(VENV)/.installed-*; touch $@

# gputrace's modules compiled once: where PYTHONDONTWRITEBYTECODE is set, as on the machines
# this suite runs on, an editable install's modules are compiled again by every process that
# imports them (an `analyze`: 139 modules, 0.14 s of its 0.69 s of CPU; each recorded
# process and `record` itself too). Up-to-date files are skipped; a changed one is compiled
# again here.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q gputrace tests samples bench

demo: bytecode
	$(BIN)/gputrace record -f -o demo.arrow -- $(BIN)/torchrun --standalone --nproc_per_node 2 \
		samples/train_cnn.py --preset case2 --iterations 30
	$(BIN)/gputrace analyze demo.arrow --report demo-report.html

lint: $(STAMP)
	$(BIN)/ruff check gputrace tests samples bench docs

# The manual: a broken link, a missing anchor or a page left out of the navigation fails it.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --quiet --site-dir build/site

# docs/report.png, the front page's picture: `make demo`'s report in Chromium
screenshot: demo browser
	$(BIN)/python docs/screenshot.py demo-report.html docs/report.png

# The HTML report's tests open it in Debian's Chromium, installed here when run as root.
browser:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (apt-get) for the report's browser tests"; \
		$(APT) install -y --no-install-recommends chromium >/dev/null 2>&1 || \
		{ $(APT) update >/dev/null && $(APT) install -y --no-install-recommends chromium \
			>/dev/null; } || echo "chromium could not be installed: browser tests will skip"; \
	else echo "no $(CHROMIUM) and not root to install it: browser tests will skip"; fi

# Workers, each taking whole test files (a file's recordings are shared by its tests);
# those tests compare timings with the job's own clock, so a busy neighbour does not fail
# them. Tests marked `serial` compare two runs recorded one after the other (a prediction
# with the run it predicts, a diff of two runs): they run afterwards, alone, so that both
# runs see the same machine. Both parts always run; the exit code is the first failure's.
# Three workers on two cores: beside a busy neighbour (CI's: one CPU hog per core) the
# suite holds more of the cores, and it fills the time files wait on their jobs' processes
# (this part in a fresh clone on 2 cores, two workers -> three: beside two hogs 30:24 ->
# 27:11; quiet 20:07 -> 19:48).
TEST_WORKERS ?= 3

test: bytecode lint docs browser
	@rc=0; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not serial" \
		--durations=30 || rc=$$?; \
	$(BIN)/python -m pytest -q -m serial --durations=10 || [ $$rc != 0 ] || rc=$$?; \
	exit $$rc

# The GPU check's wheels, for a GPU machine with Python 3.12 and a CUDA 13 torch but no
# network (docs/gpus.md): cupti-python for torch's CUDA 13.0 (GPU_CUPTI: another minor's),
# its dependencies, the dependencies of gputrace such a machine lacks, and gputrace itself.
GPU_WHEELS ?= build/gpu-wheels
GPU_CUPTI ?= cupti-python==13.0.1 nvidia-cuda-cupti==13.0.85 cuda-bindings~=13.0.0
GPU_PLATFORMS := manylinux2014_x86_64 $(foreach v,17 24 25 27 28,manylinux_2_$(v)_x86_64)

gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		$(addprefix --platform ,$(GPU_PLATFORMS)) -d $(GPU_WHEELS) -c constraints.txt \
		$(GPU_CUPTI) cuda-pathfinder nvtx msgspec
	# gputrace's wheel from its sdist (what a release holds, nothing left over in build/)
	rm -rf build/gpu-dist && $(BIN)/python -m build -q --no-isolation --outdir build/gpu-dist .
	mv build/gpu-dist/gputrace-*.whl $(GPU_WHEELS)/ && rm -rf build/gpu-dist
	@du -sh $(GPU_WHEELS)

# On the GPU machine: tests/gpu/check.sh DIR does the same without make.
OUT ?= build/gpu-check
gpu-check:
	tests/gpu/check.sh $(OUT)

clean:
	rm -rf $(VENV) demo.arrow demo-report.html build *.egg-info
