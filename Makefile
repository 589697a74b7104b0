# vae.cu: make vae | make test | make dev | make data | make fuzz | make sanitize | make clean
NVCC ?= nvcc
# GPU architecture: the first GPU's compute capability (e.g. 9.0 -> 90), sm_90 without a GPU.
GPU_ARCH ?= $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '.[:space:]')
ifeq ($(GPU_ARCH),)
GPU_ARCH := 90
endif
# Hopper builds for sm_90a, the architecture-specific target that has wgmma (fc4's kernel there);
# -gencode because the -arch=sm_90a shorthand also runs a plain sm_90 pass. Other GPUs run the
# mma.sync kernels.
ifeq ($(GPU_ARCH),90)
ARCH_FLAGS := -gencode arch=compute_90a,code=sm_90a
$(info vae.cu: building for sm_90a)
else
ARCH_FLAGS := -arch=sm_$(GPU_ARCH)
$(info vae.cu: building for sm_$(GPU_ARCH))
endif
NVCCFLAGS ?= -O3 -std=c++17 -lineinfo $(ARCH_FLAGS) -Xcompiler -Wall,-Wextra -Werror all-warnings
LDLIBS = -lcublas -lcublasLt

# A Python that can import torch, for prepare_weights.py (Debian's python3-torch lives in /usr/bin).
PYTHON ?= $(firstword $(foreach p,python3 /usr/bin/python3 python,$(shell $(p) -c 'import torch' >/dev/null 2>&1 && echo $(p))))
# Inputs for prepare_weights.py: a local folder when there is one, else it downloads them.
DATA_SRC ?= $(wildcard ../shared/data)
DATA = data/vae_weights.bin data/t10k-images-idx3-ubyte data/t10k-labels-idx1-ubyte data/vae_debug_state.bin \
       data/vae_iwae_state.bin

.PHONY: all test dev data fuzz fuzz-build sanitize clean
all: vae test_vae dev

vae: vae.cu
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(LDLIBS)

test_vae: test_vae.cu vae.cu
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(LDLIBS)

test: test_vae $(DATA)
	./test_vae

dev:
	$(MAKE) -C dev all GPU_ARCH=$(GPU_ARCH)

data: $(DATA)
$(DATA) &: prepare_weights.py
	@test -n "$(PYTHON)" || { echo "error: no python with torch found. HINT: apt-get install -y python3-torch python3-numpy, or make PYTHON=/path/to/python"; exit 1; }
	$(PYTHON) prepare_weights.py $(if $(DATA_SRC),--src $(DATA_SRC))

# libFuzzer on each file reader, FUZZ_SECONDS each (fuzz/run.sh). Needs clang and its libFuzzer
# runtime (Debian: apt-get install clang libclang-rt-dev); nvcc compiles the host code with clang
# so that vae.cu and test_vae.cu are fuzzed unchanged, with AddressSanitizer and UBSan.
FUZZ_CXX ?= clang++
FUZZ_SECONDS ?= 60
FUZZ_READERS = weights idx_images idx_labels debug_state iwae_state
FUZZ_FLAGS = -std=c++17 -g -O1 -arch=sm_$(GPU_ARCH) -ccbin $(FUZZ_CXX) -Xcompiler -fno-omit-frame-pointer \
             -Xcompiler -fsanitize=address -Xcompiler -fsanitize=undefined -Xcompiler -fno-sanitize-recover=all

fuzz: fuzz-build fuzz/build/seeds/.made
	bash fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_READERS)

fuzz-build: $(addprefix fuzz/build/fuzz_,$(FUZZ_READERS))

fuzz/build/readers.o: fuzz/readers.cu test_vae.cu vae.cu
	@mkdir -p fuzz/build
	$(NVCC) $(FUZZ_FLAGS) -Xcompiler -fsanitize=fuzzer-no-link -c $< -o $@

fuzz/build/fuzz_%: fuzz/target.cpp fuzz/build/readers.o
	$(NVCC) $(FUZZ_FLAGS) -Xcompiler -fsanitize=fuzzer -DFUZZ_READER='"$*"' $^ -o $@

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
	rm -f vae test_vae
	-$(MAKE) -C dev clean
