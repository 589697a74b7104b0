# vae.cu: make vae | make test | make dev | make data | make family | make fuzz | make sanitize | make clean
NVCC ?= nvcc
# The GPU architecture: GPU_ARCH (90, 9.0, sm_90 and sm_90a all mean Hopper), else the first GPU's compute
# capability from nvidia-smi. With neither, a portable fat binary: sm_75 and sm_80 code, sm_80's PTX (which
# the driver compiles for any newer GPU) and sm_90a, Hopper's architecture-specific target with the fused
# kernels (wgmma); the program picks them at run time where they run, the plain path (cuBLASLt) elsewhere.
# vae.cu needs sm_75 or newer (bf16: sm_80).
MIN_ARCH := 75
normalize_arch = $(shell echo '$(1)' | sed -E 's/^[[:space:]]*(sm_|compute_)?//; s/a?[[:space:]]*$$//; s/\.//')
is_arch = $(shell echo '$(1)' | grep -xE '[0-9]{2,3}')
ifeq ($(origin GPU_ARCH),undefined)
DETECTED_ARCH := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
ARCH := $(call normalize_arch,$(DETECTED_ARCH))
ifeq ($(call is_arch,$(ARCH)),)
ifneq ($(strip $(DETECTED_ARCH)),)
SMI_NOTICE := vae.cu: nvidia-smi gave no compute capability ('$(strip $(DETECTED_ARCH))'); building the portable binary
endif
ARCH :=
endif
else
ARCH := $(call normalize_arch,$(GPU_ARCH))
ifeq ($(call is_arch,$(ARCH)),)
$(error vae.cu: GPU_ARCH=$(GPU_ARCH) is not a compute capability. HINT: GPU_ARCH=90 (or 9.0, sm_90), or leave it unset)
endif
endif
ifeq ($(ARCH),)
ARCH_FLAGS := -gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=[sm_80,compute_80] \
              -gencode arch=compute_90a,code=sm_90a
BUILD_NOTICE := vae.cu: no GPU detected: building for sm_75, sm_80 (+ PTX for newer GPUs) and sm_90a. HINT: GPU_ARCH=86 builds for one GPU
else ifeq ($(shell test $(ARCH) -lt $(MIN_ARCH) && echo old),old)
$(error vae.cu: sm_$(ARCH) is older than sm_$(MIN_ARCH), the oldest GPU vae.cu runs on (the T4; cuBLASLt and the plain path's kernels). HINT: GPU_ARCH=75, or leave it unset for the portable binary)
else ifeq ($(ARCH),90)
# -gencode because the -arch=sm_90a shorthand also runs a plain sm_90 pass
ARCH_FLAGS := -gencode arch=compute_90a,code=sm_90a
BUILD_NOTICE := vae.cu: building for sm_90a
else
ARCH_FLAGS := -arch=sm_$(ARCH)
BUILD_NOTICE := vae.cu: building for sm_$(ARCH)
endif
# what the build is for, said unless make was asked only for help or clean
ifneq ($(filter-out help clean,$(or $(MAKECMDGOALS),all)),)
$(if $(SMI_NOTICE),$(info $(SMI_NOTICE)))
$(if $(BUILD_NOTICE),$(info $(BUILD_NOTICE)))
endif
# the commit --version names, when built from a checkout
GIT_COMMIT := $(shell git rev-parse --short=12 HEAD 2>/dev/null)
VERSION_FLAGS := $(if $(GIT_COMMIT),-DVAE_GIT_COMMIT='"$(GIT_COMMIT)$(shell git diff --quiet HEAD -- vae.cu 2>/dev/null || echo +changes)"')
# What ./vae says of its build (expanded only when a recipe runs): the Python its hints name, the one that runs
# prepare_weights.py here; and the targets --version names, sm_90a with its a (nvcc's own list says 900)
BUILT_FOR = $(shell echo '$(ARCH_FLAGS)' | grep -oE 'code=\[?sm_[0-9]+a?|-arch=sm_[0-9]+a?' | grep -oE 'sm_[0-9]+a?')
INFO_FLAGS = $(if $(PYTHON),-DVAE_PYTHON='"$(PYTHON)"') -DVAE_BUILT_FOR='"$(strip $(BUILT_FOR))"'
NVCCFLAGS ?= -O3 -std=c++17 -lineinfo $(ARCH_FLAGS) -Xcompiler -Wall,-Wextra -Werror all-warnings
# the plain path's matrix products, and zlib for MNIST's gzipped idx files
LDLIBS ?= -lcublasLt -lz

# prepare_weights.py needs numpy for what ./vae reads, and PyTorch for the reference dumps make test
# checks against (Debian: python3-numpy, python3-torch; python3-torch lives in /usr/bin).
# Each is looked for once, when first used: every Python started costs 0.1-2 s, and make test runs make many times.
find_python = $(shell for p in python3 /usr/bin/python3 python; do $$p -c 'import $(1)' >/dev/null 2>&1 && \
                      { echo $$p; break; }; done)
PYTHON ?= $(eval PYTHON := $(call find_python,numpy))$(PYTHON)
PYTHON_TORCH ?= $(eval PYTHON_TORCH := $(call find_python,torch))$(PYTHON_TORCH)
# Inputs for prepare_weights.py: a local folder when there is one, else it downloads them.
DATA_SRC ?= $(wildcard ../shared/data)
INPUTS = data/vae_weights.bin data/t10k-images-idx3-ubyte data/t10k-labels-idx1-ubyte
REFERENCES = data/vae_debug_state.bin data/vae_iwae_state.bin
DATA = $(INPUTS) $(REFERENCES)
# make family: test models of other sizes (prepare_weights.py's FAMILY_DIMS), each a zip checkpoint, its weights
# file and its two reference dumps, trained on the test set that make data writes
FAMILY_NAMES = vae_784_512_2_512 vae_784_256_64_256 vae_784_300_10_500 vae_784_97_33_101
FAMILY = $(foreach n,$(FAMILY_NAMES),$(addprefix data/family/$(n),.pth .bin _debug_state.bin _iwae_state.bin))

.PHONY: all test test-exhaustive dev data family fuzz fuzz-build sanitize clean help
all: vae test_vae dev

# ./vae needs the weights and the test set: a fresh clone gets them with the first build
vae: vae.cu | $(INPUTS)
	$(NVCC) $(NVCCFLAGS) $(VERSION_FLAGS) $(INFO_FLAGS) $< -o $@ $(LDLIBS)

test_vae: test_vae.cu vae.cu cpu_reference.h
	$(NVCC) $(NVCCFLAGS) $(VERSION_FLAGS) $(INFO_FLAGS) $< -o $@ $(LDLIBS)

# The CUDA tests, the converter's tests (against torch.load when PyTorch is there) and the Makefile's choice of GPU
# code, all three at once: test_vae in front, so its progress shows, the other two into logs printed after it. Each ends
# in "N passed, N failed, N skipped"; one line then sums them with the wall time, and the target fails if any program
# failed a check or stopped without its count. make test samples where a sweep is exhaustive (./vae runs on corrupt
# files, the converter's corrupt reads; AIS's and BDMC's T = 1000); make test-exhaustive runs every case.
COUNT_LINE = ^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$$
define run_tests
	@log=$$(mktemp -d); start=$$(date +%s); \
	{ $(or $(PYTHON_TORCH),$(PYTHON)) test_prepare_weights.py $(1) $(if $(DATA_SRC),--src $(DATA_SRC)); \
	  echo $$? > $$log/2.rc; } > $$log/2.out 2>&1 & \
	{ bash test_build.sh; echo $$? > $$log/3.rc; } > $$log/3.out 2>&1 & \
	{ VAE_TEST_PYTHON=$(PYTHON_TORCH) ./test_vae $(1); echo $$? > $$log/1.rc; } 2>&1 | tee $$log/1.out; \
	wait; cat $$log/2.out $$log/3.out; \
	for i in 1 2 3; do grep -E '$(COUNT_LINE)' $$log/$$i.out | tail -n 1; done | \
	awk -v rcs="$$(cat $$log/1.rc $$log/2.rc $$log/3.rc 2>/dev/null | tr -d "\n")" -v s=$$(( $$(date +%s) - start )) \
	    '{ p += $$1; f += $$3; k += $$5; n++ } END { \
	    printf "make $@: %d passed, %d failed, %d skipped in %d s\n", p, f, k, s; \
	    if (n < 3) print "make $@: " 3 - n " of the 3 programs stopped before their count"; \
	    if (rcs != "000") print "make $@: exit statuses " rcs " (test_vae, test_prepare_weights.py, test_build.sh)"; \
	    exit f > 0 || n < 3 || rcs != "000" }'; \
	status=$$?; rm -rf $$log; exit $$status
endef

test: vae test_vae $(DATA) $(FAMILY)
	$(call run_tests)

test-exhaustive: vae test_vae $(DATA) $(FAMILY)
	$(call run_tests,--exhaustive)

dev:
	$(MAKE) -C dev all $(if $(ARCH),GPU_ARCH=$(ARCH))

data: $(DATA)
$(INPUTS) &: prepare_weights.py
	@test -n "$(PYTHON)" || { echo "error: no python with numpy found. HINT: apt-get install -y python3-numpy, or make PYTHON=/path/to/python"; exit 1; }
	$(PYTHON) prepare_weights.py --only inputs $(if $(DATA_SRC),--src $(DATA_SRC))
$(REFERENCES) &: prepare_weights.py | $(INPUTS)
	@test -n "$(PYTHON_TORCH)" || { echo "error: no python with torch found; make test checks against PyTorch's dumps. HINT: apt-get install -y python3-torch python3-numpy, or make PYTHON_TORCH=/path/to/python"; exit 1; }
	$(PYTHON_TORCH) prepare_weights.py --only references $(if $(DATA_SRC),--src $(DATA_SRC))

family: $(FAMILY)
$(FAMILY) &: prepare_weights.py | $(INPUTS)
	@test -n "$(PYTHON_TORCH)" || { echo "error: no python with torch found; make family trains its models with PyTorch. HINT: apt-get install -y python3-torch python3-numpy, or make PYTHON_TORCH=/path/to/python"; exit 1; }
	$(PYTHON_TORCH) prepare_weights.py --family

# libFuzzer on each file reader, FUZZ_SECONDS each (fuzz/run.sh). Needs clang and its libFuzzer
# runtime (Debian: apt-get install clang libclang-rt-dev); nvcc compiles the host code with clang
# so that vae.cu and test_vae.cu are fuzzed unchanged, with AddressSanitizer and UBSan.
FUZZ_CXX ?= clang++
FUZZ_SECONDS ?= 60
FUZZ_READERS = weights idx_images idx_labels debug_state iwae_state pgm idx_gz
FUZZ_FLAGS = -std=c++17 -g -O1 -arch=sm_80 -ccbin $(FUZZ_CXX) -Xcompiler -fno-omit-frame-pointer \
             -Xcompiler -fsanitize=address -Xcompiler -fsanitize=undefined -Xcompiler -fno-sanitize-recover=all

fuzz: fuzz-build fuzz/build/seeds/.made
	bash fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_READERS)

fuzz-build: $(addprefix fuzz/build/fuzz_,$(FUZZ_READERS))

fuzz/build/readers.o: fuzz/readers.cu test_vae.cu vae.cu cpu_reference.h
	@mkdir -p fuzz/build
	$(NVCC) $(FUZZ_FLAGS) -Xcompiler -fsanitize=fuzzer-no-link -c $< -o $@

fuzz/build/fuzz_%: fuzz/target.cpp fuzz/build/readers.o
	$(NVCC) $(FUZZ_FLAGS) -Xcompiler -fsanitize=fuzzer -DFUZZ_READER='"$*"' $^ -o $@ -lz

# the seed corpus comes from the real files in data/, never from the repository
fuzz/build/seeds/.made: fuzz/seed_corpus.py $(DATA)
	rm -rf fuzz/build/seeds
	python3 fuzz/seed_corpus.py data fuzz/build/seeds
	touch $@

# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) on ./vae and test_vae in both
# precisions; needs a GPU. Logs go to $$OUT (default /tmp); one summary line per run.
sanitize: vae test_vae $(DATA)
	bash dev/sanitize.sh

clean:
	rm -rf vae test_vae fuzz/build
	-$(MAKE) -C dev clean

help:
	@echo "make vae        build ./vae (and data/ on first use: the weights and MNIST's test set, numpy only)"
	@echo "make test       test_vae, test_prepare_weights.py and test_build.sh at once, then one summary line"
	@echo "make test-exhaustive  the same with every case of the sampled sweeps (several minutes more)"
	@echo "make data       data/: the weights file, the test set and the reference dumps (those need PyTorch)"
	@echo "make family     data/family/: test models of other sizes, their weights files and dumps (needs PyTorch)"
	@echo "make dev        the kernel studies in dev/ (make -C dev NAME builds one; -j speeds it up)"
	@echo "make fuzz       libFuzzer on each file reader, FUZZ_SECONDS each (default 60)"
	@echo "make sanitize   compute-sanitizer on ./vae and test_vae (needs a GPU)"
	@echo "make clean      remove the binaries and fuzz/build (data/ stays)"
	@echo "GPU_ARCH=90     build for one GPU family (default: this machine's GPU, or a portable binary without one)"
