# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
NOX_VENV := .nox-runner
NOX := $(NOX_VENV)/bin/nox

.PHONY: demo test lint clean

$(NOX):
	$(PYTHON) -m venv $(NOX_VENV)
	$(NOX_VENV)/bin/pip install -q "nox>=2024.4"

## Run the main job: check every available kernel against float64, then the framework demos.
demo: $(NOX)
	$(NOX) -s core -- demo
	$(NOX) -s vllm -- demo
	$(NOX) -s sglang -- demo

## Run every test session (lint, core, triton, vllm, sglang), each in its own virtual environment.
test: $(NOX)
	$(NOX)

lint: $(NOX)
	$(NOX) -s lint

clean:
	rm -rf $(NOX_VENV) .nox
