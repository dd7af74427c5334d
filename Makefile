# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
NOX_VENV := .nox-runner
NOX := $(NOX_VENV)/bin/nox
# nox builds each session's environment with uv (noxfile.py)
UV := $(NOX_VENV)/bin/uv

.PHONY: demo test lint clean

$(NOX) $(UV):
	$(PYTHON) -m venv $(NOX_VENV)
	$(NOX_VENV)/bin/pip install -q "nox>=2024.4" "uv==0.13.9"

## Run the main job: check every available kernel against float64, then the framework demos.
demo: $(NOX) $(UV)
	$(NOX) -s core -- demo
	$(NOX) -s vllm -- demo
	$(NOX) -s sglang -- demo

## Run every test session (lint, core, triton, vllm, sglang, sglang_older), each in its own
## virtual environment, in two lanes at once: the vllm session beside the others. Most of a
## session's time is one Python process on one core (imports, engine start-up, fresh test
## processes), so two lanes keep both cores of a 2-core machine busy. The second lane is shown
## as it runs; the vllm lane's log (LOGS/vllm.log) is printed whole when it ends.
LOGS := .nox-logs
LANE_VLLM := vllm
LANE_REST := lint core triton sglang sglang_older
test: $(NOX) $(UV)
	@mkdir -p $(LOGS); rm -f $(LOGS)/vllm.log $(LOGS)/vllm.rc; \
	echo "make test: lane 1 runs nox -s $(LANE_VLLM) (log: $(LOGS)/vllm.log), lane 2 nox -s $(LANE_REST)"; \
	start=$$(date +%s); \
	( $(NOX) -s $(LANE_VLLM) > $(LOGS)/vllm.log 2>&1; echo $$? > $(LOGS)/vllm.rc; \
	  echo "make test: lane 1 ($(LANE_VLLM)) ended after $$(( $$(date +%s) - start )) s" >> $(LOGS)/vllm.log ) & \
	lane1=$$!; \
	$(NOX) -s $(LANE_REST); rest=$$?; \
	echo "make test: lane 2 ($(LANE_REST)) ended after $$(( $$(date +%s) - start )) s (exit $$rest)"; \
	wait $$lane1; vllm=$$(cat $(LOGS)/vllm.rc); \
	echo "================ lane 1: nox -s $(LANE_VLLM) ================"; cat $(LOGS)/vllm.log; \
	echo "make test: $$(( $$(date +%s) - start )) s; exit lane 1 ($(LANE_VLLM)) $$vllm, lane 2 ($(LANE_REST)) $$rest"; \
	[ "$$vllm" = 0 ] && [ "$$rest" = 0 ]

lint: $(NOX) $(UV)
	$(NOX) -s lint

clean:
	rm -rf $(NOX_VENV) .nox $(LOGS)
