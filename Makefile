# Spillway: `make run` trains on the bundled corpus under a spilling budget;
# `make test` builds and runs every test. Both install what is missing first.
# `make test-sanitize` runs the tests under ASan+UBSan (build-sanitize); `make fuzz`
# runs each libFuzzer target of fuzz/ for FUZZ_SECONDS (build-fuzz, clang).
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release

.PHONY: deps configure build run test test-sanitize fuzz crash-test bench clean

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

# Issue 11's crash test at full count: a training run killed with SIGKILL 50 times at
# random moments and resumed each time ends with the uninterrupted run's weights.
CRASH_KILLS ?= 50
crash-test: build
	SPILLWAY_CRASH_KILLS=$(CRASH_KILLS) $(BUILD)/test_cli --gtest_filter='CheckpointCli.Killed*'

# The CPU code with AddressSanitizer and UndefinedBehaviorSanitizer (CMake option
# SPILLWAY_SANITIZE), all tests but the timing ones (sanitizers change the times).
SANITIZE_BUILD ?= build-sanitize
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1 \
               UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
test-sanitize: deps
	@cmake -S . -B $(SANITIZE_BUILD) -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_CUDA=OFF -DSPILLWAY_SANITIZE=ON >/dev/null
	@cmake --build $(SANITIZE_BUILD) -j $(JOBS)
	cd $(SANITIZE_BUILD) && $(SANITIZE_ENV) ctest --output-on-failure -j $(JOBS) -LE timing

# libFuzzer targets of fuzz/ (CMake option SPILLWAY_FUZZ, clang), FUZZ_SECONDS each,
# from the seed corpus fuzz/corpus/<target>/ (read only; new inputs go to
# $(FUZZ_BUILD)/corpus/<target>/). A crash stops the run and leaves the input in
# $(FUZZ_BUILD)/crashes/; reproduce with `$(FUZZ_BUILD)/fuzz/fuzz_<target> FILE`.
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 30
FUZZ_TARGETS ?= $(notdir $(wildcard fuzz/corpus/*))
fuzz: deps
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_CUDA=OFF -DSPILLWAY_FUZZ=ON \
	       -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
	@cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_targets
	@mkdir -p $(FUZZ_BUILD)/crashes
	@for t in $(FUZZ_TARGETS); do \
	  echo "fuzz: $$t for $(FUZZ_SECONDS) s"; \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t; \
	  dict=""; [ -f fuzz/$$t.dict ] && dict="-dict=fuzz/$$t.dict"; \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
	    $(FUZZ_BUILD)/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
	      -artifact_prefix=$(FUZZ_BUILD)/crashes/$$t- $$dict $(FUZZ_BUILD)/corpus/$$t fuzz/corpus/$$t \
	      2>$(FUZZ_BUILD)/fuzz-$$t.log || { tail -n 60 $(FUZZ_BUILD)/fuzz-$$t.log; echo "fuzz: $$t failed; input in $(FUZZ_BUILD)/crashes/"; exit 1; }; \
	  grep -E '^stat::number_of_executed_units|^Done' $(FUZZ_BUILD)/fuzz-$$t.log | tr '\n' ' '; echo; \
	done

clean:
	rm -rf $(BUILD) $(SANITIZE_BUILD) $(FUZZ_BUILD)
