# `make run` and `make test` work on a fresh clone with only Python 3.11 (or python3).
# `install` is idempotent: it reruns only when pyproject.toml is newer than its stamp.
# Set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) to pick a torch build.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rtv-installed
TORCH_INDEX_URL ?=

.PHONY: venv install run test lint board-png bench-pngs

venv: $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(STAMP)

# torch first, unless the venv already has one (GPU machines keep their own CUDA build).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || \
		$(PY) -m pip install $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch==2.13.0
	$(PY) -m pip install -e '.[test,harness,ci,conform-hf]'
	touch $@

run: install
	$(VENV)/bin/rtv run

test: install
	$(VENV)/bin/pytest -n auto

# The tools that keep the tree tidy, configured in pyproject.toml: ruff format (the formatter's check), ruff check
# (its rule set, import order included) and mypy (strict on reference_trainer/ and validation/); all run and report,
# the target fails if any failed. `ruff format . && ruff check --fix .` mends the first two.
lint: install
	@status=0; \
	$(VENV)/bin/ruff format --check . || status=1; \
	$(VENV)/bin/ruff check . || status=1; \
	$(VENV)/bin/mypy || status=1; \
	exit $$status

# The README's picture of the verdict board: the report of the committed fixture evidence,
# its first screen captured by headless Chromium (Debian's chromium package). Committed on purpose.
BOARD_PNG := docs/verdict-board.png
board-png: install
	$(VENV)/bin/rtv report --in tests/fixtures/evidence --out rtv-out/board/index.md
	mkdir -p $(dir $(BOARD_PNG))
	chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,400 \
		--screenshot=$(CURDIR)/$(BOARD_PNG) file://$(CURDIR)/rtv-out/board/index.html
	@echo "wrote $(BOARD_PNG) ($$(wc -c < $(BOARD_PNG)) bytes)"

# The README's throughput pictures, each a plot of a real run on this machine (a few minutes, the machine's noise
# included): the cost-growth sweep's ratio against tokens (`rtv bench --sweep`, the default grid), this commit
# against the previous one (`rtv bench --baseline HEAD~1 --profile quick`) and the history of retain@s0 over the
# last $(HISTORY_COMMITS) commits (`rtv bench --profile quick` in a detached worktree of each, into one store).
# A run whose shown verdict failed (exit 1) still draws its plot; any other failure stops. Committed on purpose.
BENCH_PNGS := rtv-out/bench-pngs
HISTORY_COMMITS ?= 4
shown = || [ $$? -eq 1 ]
bench-pngs: install
	rm -rf $(BENCH_PNGS)
	$(VENV)/bin/rtv bench --sweep --out $(BENCH_PNGS)/sweep $(shown)
	$(VENV)/bin/rtv bench --baseline HEAD~1 --profile quick --out $(BENCH_PNGS)/ab $(shown)
	for rev in $$(git rev-list --reverse -n $(HISTORY_COMMITS) HEAD); do \
		git worktree add --detach $(BENCH_PNGS)/src-$$rev $$rev || exit 2; \
		(cd $(BENCH_PNGS)/src-$$rev && PYTHONPATH=$$PWD $(abspath $(VENV))/bin/rtv bench --profile quick \
			--out $(CURDIR)/$(BENCH_PNGS)/history) $(shown) || exit 2; \
		git worktree remove --force $(BENCH_PNGS)/src-$$rev; \
	done
	$(VENV)/bin/rtv history --store $(BENCH_PNGS)/history/history.sqlite --arm retain@s0 $(shown)
	cp $(BENCH_PNGS)/sweep/bench-*/report/plots/sweep-*-ratios.png docs/bench-sweep.png
	cp $(BENCH_PNGS)/ab/bench-*/report/plots/baseline-*-ratios.png docs/bench-baseline.png
	cp $(BENCH_PNGS)/history/history/plots/history-*.png docs/bench-history.png
	@wc -c docs/bench-sweep.png docs/bench-baseline.png docs/bench-history.png
