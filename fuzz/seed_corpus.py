#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora from the real files in data/ (made by prepare_weights.py).

    python3 fuzz/seed_corpus.py DATA_DIR OUT_DIR

OUT_DIR/<reader>/ gets the real file, its header alone, and for the idx files and the reference
states a small valid file cut from the real one, so that the fuzzer reaches the accepting path
without mutating megabytes. Nothing here is committed: make fuzz rebuilds it from data/.
"""
import gzip
import os
import struct
import sys

HEADER = 1024  # 256 int32
# the debug state's per-image widths, in file order: x eps h1 mu logvar z h3 logits recon bce kl
DEBUG_WIDTHS = [784, 20, 400, 20, 20, 20, 400, 784, 784, 1, 1]


def read(path):
    with open(path, "rb") as f:
        return f.read()


def write(out_dir, reader, name, blob):
    os.makedirs(os.path.join(out_dir, reader), exist_ok=True)
    with open(os.path.join(out_dir, reader, name), "wb") as f:
        f.write(blob)


def small_debug_state(blob):
    """A valid one-case state file: the real file's last case (the smallest batch)."""
    header = list(struct.unpack_from("<256i", blob))
    cases = header[5]
    offset, last = HEADER, None
    for c in range(cases):
        B = header[8 + 2 * c]
        size = B * sum(DEBUG_WIDTHS) * 12  # float64 then float32 of each tensor
        last = (c, offset, size)
        offset += size
    if offset != len(blob):
        sys.exit(f"seed_corpus.py: the debug state holds {len(blob)} bytes, its header promises {offset}")
    c, start, size = last
    small = header[:]
    small[5] = 1
    small[8:8 + 2 * cases] = [header[8 + 2 * c], header[9 + 2 * c]] + [0] * (2 * cases - 2)
    return struct.pack("<256i", *small) + blob[start:start + size]


def small_iwae_state(blob):
    """A valid one-image IWAE state file cut from the real one."""
    header = list(struct.unpack_from("<256i", blob))
    n, k = header[5], header[6]
    eps = blob[HEADER:HEADER + n * k * 80]
    log64 = blob[HEADER + n * k * 80:HEADER + n * k * 80 + 8 * n]
    log32 = blob[HEADER + n * k * 80 + 8 * n:]
    if len(log32) != 4 * n:
        sys.exit(f"seed_corpus.py: the IWAE state holds {len(blob)} bytes, its header promises more or less")
    small = header[:]
    small[5] = 1
    return struct.pack("<256i", *small) + eps[:k * 80] + log64[:8] + log32[:4]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    data, out = sys.argv[1], sys.argv[2]
    weights = read(os.path.join(data, "vae_weights.bin"))
    images = read(os.path.join(data, "t10k-images-idx3-ubyte"))
    labels = read(os.path.join(data, "t10k-labels-idx1-ubyte"))
    debug = read(os.path.join(data, "vae_debug_state.bin"))
    iwae = read(os.path.join(data, "vae_iwae_state.bin"))

    write(out, "weights", "real", weights)
    write(out, "weights", "header", weights[:HEADER])
    # the smallest model of the family, 784-1-1-1 (header[3], [4] and [8]), all weights zero
    floats = 784 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 784 + 784
    tiny = list(struct.unpack("<256i", weights[:HEADER]))
    tiny[3], tiny[4], tiny[8], tiny[7] = 1, 1, 1, floats
    write(out, "weights", "tiny", struct.pack("<256i", *tiny) + bytes(4 * floats))
    write(out, "idx_images", "real", images)
    write(out, "idx_images", "header", images[:16])
    write(out, "idx_images", "two_images", images[:4] + struct.pack(">I", 2) + images[8:16] + images[16:16 + 2 * 784])
    # MNIST as shipped: gzip of the idx files (whole, and its first two images)
    two_images = images[:4] + struct.pack(">I", 2) + images[8:16] + images[16:16 + 2 * 784]
    write(out, "idx_gz", "real", gzip.compress(images, mtime=0))
    write(out, "idx_gz", "two_images", gzip.compress(two_images, mtime=0))
    write(out, "idx_labels", "real", labels)
    write(out, "idx_labels", "header", labels[:8])
    write(out, "idx_labels", "two_labels", labels[:4] + struct.pack(">I", 2) + labels[8:10])
    write(out, "debug_state", "real", debug)
    write(out, "debug_state", "header", debug[:HEADER])
    write(out, "debug_state", "one_case", small_debug_state(debug))
    write(out, "iwae_state", "real", iwae)
    write(out, "iwae_state", "header", iwae[:HEADER])
    write(out, "iwae_state", "one_image", small_iwae_state(iwae))
    # greymaps of test image 0: binary, 16-bit, and ASCII with a comment
    pixels = images[16:16 + 784]
    write(out, "pgm", "p5", b"P5\n28 28\n255\n" + pixels)
    write(out, "pgm", "p5_16bit", b"P5\n28 28\n65535\n" + b"".join(struct.pack(">H", p * 257) for p in pixels))
    rows = [" ".join(str(p) for p in pixels[r * 28:(r + 1) * 28]) for r in range(28)]
    write(out, "pgm", "p2", ("P2\n# a digit\n28 28\n255\n" + "\n".join(rows) + "\n").encode())


if __name__ == "__main__":
    main()
