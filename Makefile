# Spillway: `make run` trains on the bundled corpus under a spilling budget;
# `make test` builds and runs every test. Both install what is missing first.
# `make test-sanitize` runs the tests under ASan+UBSan (build-sanitize).
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release

.PHONY: deps configure build run test test-sanitize bench clean

deps:
	@./scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	./scripts/main-job.sh $(BUILD)/spillway

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The CPU code with AddressSanitizer and UndefinedBehaviorSanitizer (CMake option
# SPILLWAY_SANITIZE), all tests but the timing ones (sanitizers change the times).
SANITIZE_BUILD ?= build-sanitize
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1 \
               UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
test-sanitize: deps
	@cmake -S . -B $(SANITIZE_BUILD) -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_CUDA=OFF -DSPILLWAY_SANITIZE=ON >/dev/null
	@cmake --build $(SANITIZE_BUILD) -j $(JOBS)
	cd $(SANITIZE_BUILD) && $(SANITIZE_ENV) ctest --output-on-failure -j $(JOBS) -LE timing

clean:
	rm -rf $(BUILD) $(SANITIZE_BUILD)
