# Two commands do everything on a fresh machine:
#   make demo   install, then train the demo model on 2 ranks with backend="graphcomp"
#   make test   install, then run the CPU test suite (what CI runs)
#   make check  install, then the fast tier (tests/cpu/unit) for the inner loop
PY ?= python3
PYTEST_ARGS ?=

.PHONY: install demo check test test-gpu clean

# torch: a torch that is already installed is never replaced (the GPU machines bring
# their own CUDA build); graphcomp needs >= 2.11 and stops with a message when the one
# present is older. Without torch, the pinned CPU build is installed (constraints/cpu.txt).
install:
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  $(PY) -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); \
	    sys.exit(0 if v >= (2, 11) else f'[install] torch {torch.__version__} is installed, graphcomp needs >= 2.11: upgrade it for your device (CUDA or CPU build); make install does not replace an installed torch')" \
	  && $(PY) -c "import torch; print(f'[install] keeping the installed torch {torch.__version__} (CUDA {torch.version.cuda})')"; \
	else \
	  echo "[install] no torch found: installing the CPU build torch==2.13.0 (constraints/cpu.txt)"; \
	  $(PY) -m pip install -q -c constraints/cpu.txt torch==2.13.0; \
	fi
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@$(PY) -m pip install -q -c constraints/cpu.txt pytest pytest-timeout hypothesis numpy transformers accelerate
	@$(PY) -m pip install -q -c constraints/cpu.txt pytest-xdist 2>/dev/null || echo "[install] pytest-xdist not installable here (offline?): make test runs in one process"
	@$(PY) -m pip install -q -c constraints/cpu.txt depyf 2>/dev/null || echo "[install] depyf not installable here (offline?): tests/cpu/distributed/test_debug_tools.py skips its depyf test"
	@$(PY) -c "import torch, graphcomp; print(f'[install] torch {torch.__version__}, graphcomp {graphcomp.__version__} (editable, from this checkout)')"

demo: install
	$(PY) -m graphcomp.tools.cli demo

# 2 pytest-xdist workers, each taking whole files (--dist loadfile: module- and
# session-scoped fixtures stay within one worker). In one process the suite kept 1.34
# of CI's 2 cores busy on average (CPU time over wall time, measured, empty Inductor
# cache); the second worker fills the idle share. XDIST=0 runs it in one process.
# Without pytest-xdist installed it runs in one process too.
XDIST ?= 2
test: install
	$(PY) -m pytest -q $$($(PY) -c "import xdist" 2>/dev/null && [ "$(XDIST)" != 0 ] && echo "-n $(XDIST) --dist loadfile") tests/cpu $(PYTEST_ARGS)

# the inner loop: tests/cpu/unit (passes on hand-built graphs, config, docs, the
# runtime on the CPU stand-in device; in-process, no rank processes)
check: install
	$(PY) -m pytest -q $$($(PY) -c "import xdist" 2>/dev/null && [ "$(XDIST)" != 0 ] && echo "-n $(XDIST) --dist loadfile") tests/cpu/unit $(PYTEST_ARGS)

# on a GPU machine (see tests/gpu/README.md)
test-gpu: install
	$(PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

clean:
	rm -rf graphcomp_dumps build *.egg-info .pytest_cache
