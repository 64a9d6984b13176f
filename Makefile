# `make run` and `make test` work on a fresh clone with only Python 3.11 (or python3).
# `install` is idempotent: it reruns only when pyproject.toml is newer than its stamp.
# Set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) to pick a torch build.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rtv-installed
TORCH_INDEX_URL ?=

.PHONY: venv install run test board-png

venv: $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(STAMP)

# torch first, unless the venv already has one (GPU machines keep their own CUDA build).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || \
		$(PY) -m pip install $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch==2.13.0
	$(PY) -m pip install -e '.[test,harness,ci]'
	touch $@

run: install
	$(VENV)/bin/rtv run

test: install
	$(VENV)/bin/pytest -n auto

# The README's picture of the verdict board: the report of the committed fixture evidence,
# its first screen captured by headless Chromium (Debian's chromium package). Committed on purpose.
BOARD_PNG := docs/verdict-board.png
board-png: install
	$(VENV)/bin/rtv report --in tests/fixtures/evidence --out rtv-out/board/index.md
	mkdir -p $(dir $(BOARD_PNG))
	chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,400 \
		--screenshot=$(CURDIR)/$(BOARD_PNG) file://$(CURDIR)/rtv-out/board/index.html
	@echo "wrote $(BOARD_PNG) ($$(wc -c < $(BOARD_PNG)) bytes)"
