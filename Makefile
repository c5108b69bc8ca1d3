# `make test` and `make demo` work on a fresh machine with only Python 3.11: they build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-faults test-zoo test-hf demo lint bench clean

$(STAMP): requirements.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# The main suite (< 10 min on 2 cores). Long fault-injection suites are marked `faults` and run by
# `make test-faults`; the zoo of Hugging Face architectures (~2 min) is marked `zoo` and run by
# `make test-zoo`; `make test-hf` runs the long ort_trainer.hf comparisons (CI runs all four).
test: $(STAMP)
	$(PY) -m pytest -q -m "not faults and not zoo and not hf_long" tests

test-faults: $(STAMP)
	$(PY) -m pytest -q -m faults tests

test-zoo: $(STAMP)
	$(PY) -m pytest -q -m zoo tests

# ort_trainer.hf.Trainer against transformers.Trainer: 2 ranks, the sample, more LR schedules (a few minutes)
test-hf: $(STAMP)
	$(PY) -m pytest -q -m hf_long tests

demo: $(STAMP)
	$(PY) samples/train_lm.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/train_step.py

clean:
	rm -rf $(VENV) build *.egg-info out
