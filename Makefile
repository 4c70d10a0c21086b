# make demo: set up .venv, prepare the default model, chat with it.
# make test: set up .venv with the test dependencies, run the default test suite.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
MODEL := checkpoints/smollm2-135m
# test files run side by side (pytest-xdist, each file in one worker): many tests wait on servers,
# torchrun jobs and command lines, so two workers on 2 cores take about two thirds of the time;
# each worker runs torch on its share of the cores (tests/conftest.py)
TEST_WORKERS ?= 2
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: demo serve test test-slow bench setup setup-test clean

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

$(VENV)/.installed: requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, so that nothing below resolves it to a multi-GB CUDA build; no wheel cache: a
	# fresh machine would only keep a second copy of every package on its disk
	$(BIN)/pip install -q --no-cache-dir $(TORCH)
	$(BIN)/pip install -q --no-cache-dir -r requirements.txt
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(BIN)/pip install -q --no-cache-dir -r requirements-test.txt
	# the chat page's test drives Debian's headless Chromium; without root or apt-get it skips
	command -v chromedriver >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; }; }; } || \
	  echo "Chromium not installed: the chat page's browser test will skip"
	touch $@

# lm-evaluation-harness for the slow test that scores serve.py's echo against eval.py
$(VENV)/.installed-slow: $(VENV)/.installed-test requirements-slow.txt
	$(BIN)/pip install -q --no-cache-dir -r requirements-slow.txt
	touch $@

$(MODEL)/config.json: $(VENV)/.installed
	$(BIN)/python download.py smollm2-135m

demo: $(MODEL)/config.json
	$(BIN)/python generate.py --checkpoint $(MODEL) --chat --prompt "$(PROMPT)" --max_new_tokens 200

# an OpenAI-compatible server on http://127.0.0.1:8000/v1 (serve.py --help for its options)
serve: $(MODEL)/config.json
	$(BIN)/python serve.py --checkpoint $(MODEL)

test: $(VENV)/.installed-test $(MODEL)/config.json
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

test-slow: $(VENV)/.installed-slow $(MODEL)/config.json
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile

bench: $(VENV)/.installed-test $(MODEL)/config.json
	$(BIN)/python -m scripts.bench

clean:
	rm -rf $(VENV) checkpoints
