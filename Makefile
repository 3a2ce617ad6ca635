# The two commands a new user needs:
#   make run    serve the gateway on the embedded default (real model, no server to install)
#   make test   run the whole test suite
# Both create the virtual environment on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build that lies on this machine's disk
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tiergate serve

# The suite runs in TEST_WORKERS processes (pytest-xdist): one process alone kept 1.2 of 2 CPUs busy, waiting on
# the servers and engines its tests start. The tests that compare a victim's latencies (tests/adversarial), and
# the 1,000-request burst on four gateways and one Redis (tests/quotas/test_replicas.py: beside another worker's
# tests its 50 ms Redis calls time out, and a reservation lost with its undo leaves the rpm window one short), then
# run on their own, with no other test beside them. So do the fleet's quota race (tests/gateway/test_fleet.py, three
# gateways and one Redis: beside the suite 3-6 of its 300 requests were refused as over the limit, in three runs of
# three), and the end-to-end rollout steering test, whose guards compare latencies (beside the suite, its victim's
# own traffic once breached the TTFT guard and rolled the canary back).
TEST_WORKERS ?= 2
ALONE = tests/adversarial tests/quotas/test_replicas.py tests/gateway/test_fleet.py tests/gateway/test_rollout_steering.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(addprefix --ignore=,$(ALONE))
	$(BIN)/python -m pytest -q $(ALONE)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
