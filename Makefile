# `make test` and `make demo` work on a fresh machine with only Python 3.11: they build .venv first.
# Two environments, never mixed (both runtime packages provide the `onnxruntime` module):
#   .venv            requirements.txt: the stock onnxruntime (what `pip install .` gives): the autograd engine
#   .venv-onnxblock  requirements-onnxblock.txt: onnxruntime-training 1.19.2: both engines
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OB_VENV := .venv-onnxblock
OB_PY := $(OB_VENV)/bin/python
OB_STAMP := $(OB_VENV)/.installed
LATEST_VENV := .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
# the stock venv has no onnxruntime-training: tests that mean the onnxblock engine run in .venv-onnxblock (the folder
# tests/onnxblock/, whose files import it, and the onnxblock parametrizations of tests that run on both engines)
STOCK := not onnxblock
STOCK_TREE := --ignore=tests/onnxblock
# pytest-xdist workers: one per core, at most 4 (each imports torch, transformers and a runtime: ~1 GB). Most tests
# spend their time in one Python thread (export, graph building, HDF5), so 2 workers on 2 cores take ~0.7x the
# wall time of one. `make test WORKERS=0` runs in one process (pytest's own output, pdb).
WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
XDIST := -n $(WORKERS) --dist worksteal
LONG := (slow or faults or zoo or hf_long)
# the JS driver's tests (tests/js) need node, npm's packages and Chromium: they run in `make test-js` only
NOT_JS := not js

.PHONY: test test-long test-slow test-faults test-zoo test-hf test-onnxblock test-install test-latest test-js demo lint bench clean

# A venv is rebuilt from scratch when its lock changes: installing one runtime over the other is never an upgrade.
$(STAMP): requirements.txt setup.py
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(OB_STAMP): requirements-onnxblock.txt setup.py
	rm -rf $(OB_VENV)
	$(PYTHON) -m venv $(OB_VENV)
	$(OB_PY) -m pip install --quiet --upgrade pip
	$(OB_PY) -m pip install --quiet -r requirements-onnxblock.txt
	$(OB_PY) -m pip install --quiet --no-deps -e .
	touch $(OB_STAMP)

# The main suite (< 10 min on 2 cores) on the stock runtime. Long fault-injection suites are marked `faults`
# and run by `make test-faults`; the zoo of Hugging Face architectures is marked `zoo` (`make test-zoo`);
# `make test-hf` runs the long ort_trainer.hf comparisons; `make test-onnxblock` runs the suite and the zoo
# in the onnxruntime-training venv (CI runs all five).
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=15 -m "not slow and not faults and not zoo and not hf_long and not install and $(NOT_JS) and $(STOCK)" $(STOCK_TREE) tests

# CI's one session for the four long targets below (one collection; workers stay busy to the end)
test-long: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25 -m "$(LONG) and not install and $(NOT_JS) and $(STOCK)" $(STOCK_TREE) tests

# the tests of the main suite that take over ~10 s each (tests/conftest.py SLOW_TESTS)
test-slow: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "slow and not faults and not zoo and not hf_long and not install and $(NOT_JS) and $(STOCK)" $(STOCK_TREE) tests

test-faults: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "faults and $(STOCK)" $(STOCK_TREE) tests

test-zoo: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "zoo and $(STOCK)" $(STOCK_TREE) tests

# ort_trainer.hf.Trainer against transformers.Trainer: 2 ranks, the sample, more LR schedules; ORTModule on 4 ranks
# and samples/custom_loop.py killed and resumed (a few minutes)
test-hf: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "hf_long and $(STOCK)" $(STOCK_TREE) tests

# onnxruntime-training: the main suite (its default engine there is onnxblock), the onnxblock zoo (the autograd zoo
# runs in `make test-zoo`) and every test that means the onnxblock engine, fault suites included (Megatron runs:
# the stock venv cannot run them). tests/checkpoint (files, sets, storage: no graph) runs in
# `make test` only, and the slow tests (multi-rank runs, samples, fresh-process resumes) in `make test-slow` only,
# unless they mean the onnxblock engine.
test-onnxblock: $(OB_STAMP)
	$(OB_PY) -m pytest -q $(XDIST) -m "onnxblock or not (faults or hf_long or install or zoo or slow or checkpoint_package or js)" tests

# `pip install .` from clean venvs against the package index: stock only, onnxruntime-training only, switching
test-install: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "install and $(STOCK)" $(STOCK_TREE) tests

# The newest releases the declared ranges admit, as a user's plain `pip install ".[dev]"` gets them today (no lock,
# a fresh venv every time): the representative selection marked `latest` (tests/conftest.py LATEST_TESTS), so that
# an upstream release that breaks us turns CI red before a user's first run does. `python -m ort_trainer` prints
# the versions it ran and names any newer than ort_trainer/_package/versions.py's NEWEST_TESTED record.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install --quiet --upgrade pip
	$(LATEST_PY) -m pip install --quiet ".[dev]"
	$(LATEST_PY) -m ort_trainer
	$(LATEST_PY) -m pytest -q $(XDIST) -m "latest and $(STOCK)" $(STOCK_TREE) tests

# The JS driver (js/): its npm packages from js/package-lock.json (onnxruntime-node's install script would download
# CUDA files: skipped), then tests/js in Node.js (onnxruntime-node) and headless Chromium (onnxruntime-web, Debian's
# /usr/bin/chromium or $$CHROMIUM) against Python onnxruntime on the same artifacts. Needs node >= 20 and npm.
JS_STAMP := js/node_modules/.installed
$(JS_STAMP): js/package-lock.json
	cd js && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund --loglevel=error
	touch $(JS_STAMP)

# --dist loadfile: a file's tests share their module fixtures (each exports its artifacts once) on one worker
test-js: $(STAMP) $(JS_STAMP)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --durations=10 -m "js and $(STOCK)" $(STOCK_TREE) tests

demo: $(STAMP)
	$(PY) samples/train_lm.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/train_step.py

clean:
	rm -rf $(VENV) $(OB_VENV) $(LATEST_VENV) build *.egg-info out js/node_modules
