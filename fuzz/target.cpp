// One libFuzzer target; FUZZ_READER names the reader ("weights", "idx_images", ...).
#include <stddef.h>
#include <stdint.h>

int fuzz_reader_index(const char* name);
int fuzz_one(int reader, const uint8_t* data, size_t size);

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const int reader = fuzz_reader_index(FUZZ_READER);
    return fuzz_one(reader, data, size);
}
