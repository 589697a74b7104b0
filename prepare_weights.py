#!/usr/bin/env python3
"""
Prepares everything vae.cu reads: the inputs with numpy alone, the reference dumps with PyTorch.

  data/vae_weights.bin          the pretrained weights in vae.cu's binary format      numpy
  data/t10k-images-idx3-ubyte   MNIST test images (standard idx3, uncompressed)        numpy
  data/t10k-labels-idx1-ubyte   MNIST test labels (standard idx1, uncompressed)        numpy
  data/vae_debug_state.bin      reference activations for test_vae.cu                  torch
  data/vae_iwae_state.bin       reference IWAE log-likelihoods for test_vae.cu         torch

Checkpoints are read without torch, by readers of PyTorch's zip format (torch.save's default since
PyTorch 1.6), its legacy format and safetensors. The pickle formats go through an unpickler that
builds inert records of tensors and refuses every other class or function, so nothing in the file
can run code. PyTorch is the reference implementation behind the two dumps, which only 'make test'
needs.

Inputs come from --src DIR (a folder holding vae_epoch_25.pth and the two t10k .gz files)
or, without --src, are downloaded; either way their MD5s are checked.

  python3 prepare_weights.py --src ../shared/data                      # all; the inputs alone without torch
  python3 prepare_weights.py --src ../shared/data --only inputs        # numpy only
  python3 prepare_weights.py --src ../shared/data --only references    # torch (Debian's: /usr/bin/python3)
  python3 prepare_weights.py --reference-loss     # also print full-test-set float64 losses (torch)
  python3 prepare_weights.py --checkpoint my_vae.pt [--out data/my_vae.bin]    # one weights file, numpy only
  python3 prepare_weights.py --family [--out data/family]   # test models of other sizes and their dumps (torch)

--checkpoint converts a VAE of any size of the family, x (784) -> fc1 -> H1 -> fc21, fc22 -> Z;
z -> fc3 -> H3 -> fc4 -> 784, with 1 <= H1, H3 <= 4096 and 1 <= Z <= 64, from a state_dict that is
the file's object itself or its entry 'state_dict' or 'model' (a dict beside other entries: epoch,
optimizer, ...), its keys perhaps prefixed 'module.' (DataParallel), its tensors float32, float16,
bfloat16 or float64 (rounded to float32; the line that reports the conversion says by how much). The
file is judged by its keys, shapes and finite values (an MD5 checks only the published checkpoint), and
only the weights file is written: to --out, by default data/<the checkpoint's name without its suffix>.bin.

--family makes the test models of other sizes (FAMILY_DIMS: 784-512-2-512, 784-256-64-256,
784-300-10-500 and 784-97-33-101), each trained from torch.manual_seed(FAMILY_SEED) for FAMILY_EPOCHS
epoch of Adam on the MNIST test images that 'make data' writes (data/t10k-images-idx3-ubyte), on the
CPU. For each, in --out (default data/family), with NAME = vae_784_H1_Z_H3:
  NAME.pth                  torch.save(model.state_dict()) in the zip format
  NAME.bin                  its weights file, converted from NAME.pth as --checkpoint converts
  NAME_debug_state.bin      its reference activations (the debug state format below)
  NAME_iwae_state.bin       its reference IWAE log-likelihoods (the IWAE state format below)
All twelve files take their places only once every one is complete.

Each output is written to a temporary file beside it and renamed into place once complete, so a
failure leaves the earlier file as it was; a folder that --checkpoint's output needs is created
only for a write that succeeds.

Weights file, version 2: a header of 256 int32 then the tensors as little-endian float32, in the
PyTorch Linear layout (weight[out][in] row-major, then bias[out]):
  header[0] magic 0x31454156 ("VAE1")  header[1] version 2
  header[2] input dim 784  header[3] H1 (fc1's outputs)  header[4] Z (latent dim)
  header[5] dtype (1 = float32)  header[6] tensor count (10)  header[7] total floats
  header[8] H3 (fc3's outputs)  header[9..255] zero
  tensors: fc1.w [H1][784] fc1.b [H1] fc21.w [Z][H1] fc21.b [Z] fc22.w [Z][H1] fc22.b [Z]
           fc3.w [H3][Z] fc3.b [H3] fc4.w [784][H3] fc4.b [784]
The published checkpoint gives H1 = H3 = 400, Z = 20.

Debug state file: a header of 256 int32 then, for each case, tensors as float64 and float32:
  header[0] magic 0x44454156 ("VAED")  header[1] version 1
  header[2..4] dims 784/H1/Z  header[5] case count C  header[6] H3
  header[8 + 2c] batch size B of case c, header[9 + 2c] index of its first test image
  per case, for each tensor t of x eps h1 mu logvar z h3 logits recon bce kl (B rows each;
  widths 784 Z H1 Z Z Z H3 784 784 1 1): t in float64, then t in float32.
  The float64 values come from a float64 forward pass, the float32 values from PyTorch's own
  float32 forward pass; both use the same eps (drawn in float32, so it is exact in both).

IWAE state file: a header of 256 int32 then eps, then log p(x) in float64 and in float32:
  header[0] magic 0x49454156 ("VAEI")  header[1] version 1  header[2..4] dims 784/H1/Z
  header[5] image count N  header[6] samples per image K  header[7] index of the first image  header[8] H3
  eps float32 [N][K][Z]; log p(x) float64 [N]; log p(x) float32 [N], where
  log p(x) = logsumexp_k [log p(x|z_k) + log N(z_k; 0, I) - log N(z_k; mu, sigma^2)] - log K,
  z_k = mu + sigma eps_k, log p(x|z) = -BCE, each Gaussian with its -1/2 log(2 pi).
Both dumps of the published checkpoint have dims 784/400/20 and H3 = 400. (Dumps written before H3 joined
the header hold 0 in its place: read it as H1.) The rest of each header is zero.
"""
import argparse
import collections
import contextlib
import functools
import gzip
import hashlib
import importlib.util
import io
import json
import math
import os
import pickle
import pickletools
import shlex
import shutil
import subprocess
import sys
import urllib.request
import zipfile

try:
    import numpy as np
except ImportError:
    np = None  # main() says so after parsing the arguments, so that --help works without numpy
# where the Makefile looks for a Python with numpy (and one with torch), in its order
PYTHON_CANDIDATES = ("python3", "/usr/bin/python3", "python")

INPUT_DIM = 784  # 28x28 images
MAX_HIDDEN, MAX_LATENT = 4096, 64  # the sizes of the family that vae.cu takes: 1 <= H1, H3 <= 4096, 1 <= Z <= 64
Dims = collections.namedtuple("Dims", "h1 z h3")
PUBLISHED_DIMS = Dims(400, 20, 400)
WEIGHTS_MAGIC, DEBUG_MAGIC, IWAE_MAGIC = 0x31454156, 0x44454156, 0x49454156
WEIGHTS_VERSION = 2  # version 1 had no header[8]: H3 was H1
STATE_VERSION = 1  # the debug and IWAE dumps
DTYPE_FLOAT32 = 1
HEADER_INTS = 256
# each tensor's shape in PyTorch's Linear layout (weight[out][in], bias[out]), in vae_weights.bin's order;
# H1, Z and H3 are taken from the shapes, the first tensor holding each (in SHAPE_ORDER) giving it
VAE_LAYOUT = {
    "fc1.weight": ("H1", INPUT_DIM), "fc1.bias": ("H1",),
    "fc21.weight": ("Z", "H1"), "fc21.bias": ("Z",),
    "fc22.weight": ("Z", "H1"), "fc22.bias": ("Z",),
    "fc3.weight": ("H3", "Z"), "fc3.bias": ("H3",),
    "fc4.weight": (INPUT_DIM, "H3"), "fc4.bias": (INPUT_DIM,),
}
TENSOR_ORDER = list(VAE_LAYOUT)
SHAPE_ORDER = ["fc1.weight", "fc21.weight", "fc3.weight"] + [n for n in TENSOR_ORDER
                                                             if n not in ("fc1.weight", "fc21.weight", "fc3.weight")]
SIZE_BOUNDS = {"H1": (1, MAX_HIDDEN), "Z": (1, MAX_LATENT), "H3": (1, MAX_HIDDEN)}
SIZE_LIMITS = f"1 <= H1, H3 <= {MAX_HIDDEN} and 1 <= Z <= {MAX_LATENT}"
# (batch size, first test image): a batch that is no tile multiple, and a single image
DEBUG_CASES = [(37, 0), (1, 9999)]
DEBUG_SEED = 1234
IWAE_CASE = (4, 37, 0)  # images, samples per image (not a multiple of a warp), first image

CHECKPOINT = "vae_epoch_25.pth"
# name -> (download URL, MD5 of the file as published)
SOURCES = {
    CHECKPOINT: (
        "https://github.com/csinva/gan-vae-pretrained-pytorch/raw/master/mnist_vae/weights/vae_epoch_25.pth",
        "170d7720f7d98109540d6ee88d1c6898"),
    "t10k-images-idx3-ubyte.gz": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/t10k-images-idx3-ubyte.gz",
        "9fb629c4189551a2d022fa330f9573f3"),
    "t10k-labels-idx1-ubyte.gz": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/t10k-labels-idx1-ubyte.gz",
        "ec29112dd5afa0611ce80d1b7f02629c"),
}
REFERENCE_FILES = ["vae_debug_state.bin", "vae_iwae_state.bin"]
# --family: the test models of other sizes (H1 != H3 in the last), trained briefly so that their numbers mean
# something; one epoch of the 10,000 test images takes 6-11 s a model on one CPU core
# the last: odd sizes (H1 and H3 not multiples of four, Z odd and above 32) for the plain path's edge cases
FAMILY_DIMS = [Dims(512, 2, 512), Dims(256, 64, 256), Dims(300, 10, 500), Dims(97, 33, 101)]
FAMILY_SEED = 0
FAMILY_EPOCHS, FAMILY_BATCH, FAMILY_LR = 1, 128, 1e-3
FAMILY_SUFFIXES = [".pth", ".bin", "_debug_state.bin", "_iwae_state.bin"]
TORCH_HINT = "apt-get install -y python3-torch python3-numpy (Debian's torch, for /usr/bin/python3)"


def fail(msg):
    print(f"prepare_weights.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


def other_python_with(module, probe="import {}"):
    """The first of PYTHON_CANDIDATES, as named there, that runs probe of module; None if none does. This
    interpreter is left out: the caller knows that it lacks module."""
    for name in PYTHON_CANDIDATES:
        where = shutil.which(name)
        if where is None or os.path.abspath(where) == os.path.abspath(sys.executable):
            continue
        try:
            found = subprocess.run([where, "-c", probe.format(module)], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            continue
        if found:
            return name
    return None


def numpy_missing():
    """The error for a Python without numpy: the same command with a Python that has it, else how to install it."""
    found = other_python_with("numpy")
    hint = (f"{found} has numpy: {shlex.join([found, *sys.argv])}" if found else
            f"{sys.executable} -m pip install numpy, or apt-get install -y python3-numpy")
    return f"prepare_weights.py: error: {sys.executable} has no numpy. HINT: {hint}"


def vae_shapes(dims):
    """{name: shape} of a VAE of the family with these dims, in vae_weights.bin's order."""
    sizes = dict(H1=dims.h1, Z=dims.z, H3=dims.h3)
    return {name: tuple(sizes.get(d, d) for d in layout) for name, layout in VAE_LAYOUT.items()}


# ----------------------------------------------------------------------------
# checkpoints, without torch
#
# PyTorch's legacy format (torch.save(..., _use_new_zipfile_serialization=False)) is five pickles
# in a row: a magic number, the format's protocol version, the saving machine's sys_info, the
# state_dict (its tensors refer to storages through persistent ids), and the list of storage keys.
# Then, for each key in that order, the storage's element count as int64 and its raw bytes.
#
# PyTorch's zip format (torch.save's default) is an uncompressed zip archive whose records share one
# folder, named after the file or 'archive': <folder>/data.pkl is the pickle, with the same persistent
# ids, and <folder>/data/<key> holds each storage's raw bytes; small records beside them (version,
# byteorder, ...) describe the archive.
#
# safetensors: a little-endian u64 N, N bytes of JSON mapping each tensor's name to its dtype, shape and
# data_offsets [begin, end) into the data that follows (plus an optional "__metadata__" of strings),
# then the data, every byte of it belonging to exactly one tensor.

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
PICKLE_PROTOCOL = 2  # what torch.save pickles with, by default, in both of its formats
ZIP_MAGIC = b"PK\x03\x04"
MAX_PICKLE_BYTES = 64 << 20  # a state_dict's pickle, tensors' data aside, is small: a few kB for the VAE
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit
PUBLISHED_HINT = f"use the published checkpoint, {SOURCES[CHECKPOINT][0]}"
STATE_HINT = ("save the VAE's state_dict with torch.save(model.state_dict(), path) or safetensors; "
              "or use the published checkpoint")
DAMAGED_HINT = "save the checkpoint again, with torch.save or safetensors"
# the weights cannot be cut down to size: only a model trained within the limits fits
SIZE_HINT = (f"train the VAE with {SIZE_LIMITS} (the published one is 784-{PUBLISHED_DIMS.h1}-{PUBLISHED_DIMS.z}-"
             f"{PUBLISHED_DIMS.h3}), or {PUBLISHED_HINT}")

# dtype name -> bytes per element, for every dtype the formats can name; the first four are converted
ELEMENT_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# the converted dtypes' raw values as numpy reads them; numpy has no bfloat16, so its 16 bits are read as uint16
RAW_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "float64": "<f8"}
STORAGE_DTYPES = {  # the torch.*Storage classes that the pickles name
    "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16", "DoubleStorage": "float64",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
SAFETENSORS_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
WRAPPER_KEYS = ("state_dict", "model")  # where training scripts keep the state_dict beside epoch, optimizer, ...
DATA_PARALLEL_PREFIX = "module."


class CheckpointError(Exception):
    """A checkpoint that the reader refuses; str() is the one-line message."""

    def __init__(self, path, what, hint=STATE_HINT):
        msg = f"{path}: {what}. HINT: {hint}"
        # names from the file may hold newlines or control characters: escaped, the message stays one line
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in msg))


# What the pickles refer to, as inert records: nothing in the file is ever called.
StorageType = collections.namedtuple("StorageType", "name")  # a torch.*Storage class
StorageRef = collections.namedtuple("StorageRef", "key dtype numel")  # a persistent id of a storage
TensorRef = collections.namedtuple("TensorRef", "storage offset size stride")
# a tensor of any format, once its view is checked: dtype (an ELEMENT_SIZES name), shape, and read(), which gives
# its raw values (RAW_DTYPES) as a numpy array of that shape; only called once names and shapes are checked
Tensor = collections.namedtuple("Tensor", "dtype shape read")


class Weights(dict):
    """A checkpoint's VAE tensors, {name: float32 array} in vae_weights.bin's order, and what becoming float32 did
    to them: dtypes {name: the checkpoint's dtype} and rounded {name: largest absolute change} of the float64
    tensors whose values float32 does not hold exactly (the other dtypes convert exactly)."""

    def __init__(self, tensors, dtypes, rounded):
        super().__init__(tensors)
        self.dtypes, self.rounded = dtypes, rounded


def rebuild_tensor(storage, offset, size, stride, *_):
    """Stands in for torch._utils._rebuild_tensor_v2; requires_grad, backward hooks and (newer PyTorch)
    metadata do not matter for the weights. The view is checked once the storages are known."""
    return TensorRef(storage, offset, size, stride)


class StateDictUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint's pickles, allowing only the globals that a state_dict of tensors needs."""

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path
        self.storages = {}  # key -> StorageRef

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return rebuild_tensor
        if module == "torch" and name.endswith("Storage") and name.isidentifier():
            return StorageType(name)
        raise CheckpointError(self.path, f"its pickle asks for {module}.{name}, which a state_dict of tensors "
                                         f"never needs; refused without running it",
                              "save the model's state_dict, not the model or other objects, with "
                              "torch.save(model.state_dict(), path)")

    def persistent_load(self, pid):
        # ('storage', storage type, key, location, element count[, view metadata]); location is ignored (all CPU)
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"
                and isinstance(pid[1], StorageType) and isinstance(pid[2], str)
                and type(pid[4]) is int and pid[4] >= 0 and pid[5:] in ((), (None,))):
            raise CheckpointError(self.path, f"its pickle holds a reference this reader does not know: "
                                             f"{repr(pid)[:80]}", DAMAGED_HINT)
        storage_type, key, numel = pid[1], pid[2], pid[4]
        dtype = STORAGE_DTYPES.get(storage_type.name)
        if dtype is None:
            raise CheckpointError(self.path, f"its pickle holds a torch.{storage_type.name[:40]}, a storage this "
                                             f"reader does not know", "save a state_dict of float32 tensors")
        ref = self.storages.setdefault(key, StorageRef(key, dtype, numel))
        if ref != (key, dtype, numel):
            raise CheckpointError(self.path, f"storage {key[:40]} is given as {ref.numel} {ref.dtype} and as "
                                             f"{numel} {dtype} elements", DAMAGED_HINT)
        return ref


@functools.lru_cache(maxsize=None)
def python_with_torch():
    """A Python that has torch, for a command in a hint: this one, else the first of PYTHON_CANDIDATES; None if none
    has it. Each is asked whether it would find torch, not made to import it, which takes seconds."""
    try:
        if importlib.util.find_spec("torch") is not None:
            return sys.executable
    except (ImportError, ValueError):  # ValueError: a torch in sys.modules without a __spec__
        pass
    return other_python_with("torch", "import importlib.util, sys; sys.exit(importlib.util.find_spec({!r}) is None)")


def protocol_error(path, protocol):
    """The refusal of a pickle newer than PICKLE_PROTOCOL, with the command that saves the file again in it:
    torch.save's default protocol, in the zip format, beside the file."""
    out = os.path.splitext(path)[0] + f"_protocol{PICKLE_PROTOCOL}.pth"
    # JSON's strings are Python's too, and their double quotes leave the single ones to the shell
    # weights_only=False: from PyTorch 2.6 torch.load defaults to weights_only=True, whose unpickler refuses protocol 4
    code = (f'import torch; torch.save(torch.load({json.dumps(path)}, map_location="cpu", weights_only=False), '
            f'{json.dumps(out)})')
    python = python_with_torch()
    command = shlex.join([python or "/usr/bin/python3", "-c", code])
    return CheckpointError(path, f"it was saved with pickle protocol {protocol}, and this converter reads only "
                                 f"protocol {PICKLE_PROTOCOL}, torch.save's default",
                           ("" if python else f"install torch, {TORCH_HINT}; then ")
                           + f"save it again with that default: {command}; then convert {shlex.quote(out)}")


def load_pickle(stream, unpickler, path, what, kind):
    """The next pickle in stream, read by unpickler; raises CheckpointError if it is damaged or too new."""
    start = stream.tell()
    try:
        # Walk the opcodes first, in pure Python: it finds a truncated pickle, and refuses opcodes that
        # the unpickler would trust to size an allocation (a bytearray8 of 2**60 bytes, a memo slot
        # of 2**32) before it could tell that the file is too short for them.
        ops = list(pickletools.genops(stream))
        declared = ops[0][1] if ops and ops[0][0].name == "PROTO" else 0
        for opcode, arg, pos in ops:
            if opcode.proto > PICKLE_PROTOCOL:
                raise protocol_error(path, max(declared, opcode.proto))
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg >= len(ops):
                raise CheckpointError(path, f"its {what} stores to pickle memo slot {arg} at byte {pos}, "
                                            f"beyond its {len(ops)} opcodes", DAMAGED_HINT)
        stream.seek(start)
        return unpickler.load()
    except CheckpointError:
        raise
    except Exception as e:  # a damaged pickle fails in many ways (ValueError, UnpicklingError, ...)
        raise CheckpointError(path, f"cannot read its {what} at byte {start} ({type(e).__name__}: "
                                    f"{str(e)[:100]}); the file is truncated or is no {kind}", DAMAGED_HINT) from None


def read_legacy(path, data):
    """The object in a legacy-format checkpoint, and {storage key: raw values} of its float storages."""
    stream = io.BytesIO(data)
    unpickler = StateDictUnpickler(stream, path)

    def load(what):
        return load_pickle(stream, unpickler, path, what, "PyTorch legacy checkpoint")

    if load("magic number") != LEGACY_MAGIC:
        raise CheckpointError(path, "it does not start with the magic number of PyTorch's legacy format",
                              DAMAGED_HINT)
    protocol = load("protocol version")
    if protocol != LEGACY_PROTOCOL:
        raise CheckpointError(path, f"its protocol version is {short(protocol)}, expected {LEGACY_PROTOCOL}",
                              DAMAGED_HINT)
    sys_info = load("sys_info")
    if not (isinstance(sys_info, dict) and sys_info.get("little_endian") is True):
        raise CheckpointError(path, "it was not saved on a little-endian machine (or its sys_info is damaged)",
                              DAMAGED_HINT)
    obj = load("state_dict")
    keys = load("storage key list")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise CheckpointError(path, "its storage key list is no list of strings", DAMAGED_HINT)

    storages, seen = {}, set()
    pos = stream.tell()
    for key in keys:
        if key not in unpickler.storages:
            raise CheckpointError(path, f"its storage key list names {short(key)!r}, which no tensor uses",
                                  DAMAGED_HINT)
        if key in seen:
            raise CheckpointError(path, f"its storage key list names {short(key)!r} twice", DAMAGED_HINT)
        seen.add(key)
        ref, name = unpickler.storages[key], short(key)
        if pos + 8 > len(data):
            raise CheckpointError(path, f"it is truncated: it ends at byte {len(data)}, inside the element count "
                                        f"of storage {name}", DAMAGED_HINT)
        count = int.from_bytes(data[pos:pos + 8], "little", signed=True)
        if count != ref.numel:
            raise CheckpointError(path, f"storage {name} holds {count} elements where its tensors say {ref.numel}",
                                  DAMAGED_HINT)
        pos += 8
        size = ELEMENT_SIZES[ref.dtype] * count
        if pos + size > len(data):
            raise CheckpointError(path, f"it is truncated: storage {name} needs bytes {pos}..{pos + size - 1} "
                                        f"but the file ends at byte {len(data)}", DAMAGED_HINT)
        if ref.dtype in RAW_DTYPES:  # other dtypes are never read: a VAE tensor of one is refused by name
            storages[key] = np.frombuffer(data, dtype=RAW_DTYPES[ref.dtype], count=count, offset=pos)
        pos += size
    if pos != len(data):
        raise CheckpointError(path, f"it has {len(data) - pos} bytes after its last storage", DAMAGED_HINT)
    missing = sorted(set(unpickler.storages) - set(keys))
    if missing:
        raise CheckpointError(path, f"the data of storage {short(missing[0])} is missing", DAMAGED_HINT)
    return obj, storages


def read_zip(path, data):
    """The object in a zip-format checkpoint, and {storage key: raw values} of its float storages."""
    def damaged(e):
        return CheckpointError(path, f"it starts as a zip archive but cannot be read as one ({type(e).__name__}: "
                                     f"{str(e)[:100]}); the file is truncated or damaged", DAMAGED_HINT)

    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except Exception as e:  # zipfile fails in many ways on a damaged archive (BadZipFile, ValueError, ...)
        raise damaged(e) from None
    records = {info.filename: info for info in infos}
    if len(records) != len(infos):
        raise CheckpointError(path, "its zip archive holds two records of one name", DAMAGED_HINT)
    pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointError(path, f"its zip archive holds {len(pickles)} records <folder>/data.pkl, where torch.save "
                                    f"writes one", DAMAGED_HINT)
    folder = pickles[0][:-len("data.pkl")]
    strays = [name for name in records if not name.startswith(folder)]
    if strays:
        raise CheckpointError(path, f"its zip archive holds {strays[0][:60]!r} outside the folder {folder[:60]!r} "
                                    f"of its data.pkl", DAMAGED_HINT)

    def read_record(name, size=None, limit=None):
        info = records[folder + name]
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(path, f"its record {info.filename[:60]} is compressed (zip method "
                                        f"{info.compress_type}), where torch.save stores every record as it is",
                                  DAMAGED_HINT)
        # checked before reading, so that a damaged size never makes the reader allocate it
        if size is not None and info.file_size != size:
            raise CheckpointError(path, f"its record {info.filename[:60]} holds {info.file_size} bytes, expected "
                                        f"{size}", DAMAGED_HINT)
        if limit is not None and info.file_size > limit:
            raise CheckpointError(path, f"its record {info.filename[:60]} holds {info.file_size} bytes, more than "
                                        f"the {limit} a state_dict needs", DAMAGED_HINT)
        if info.header_offset + info.file_size > len(data):
            raise CheckpointError(path, f"it is truncated: its record {info.filename[:60]} needs {info.file_size} "
                                        f"bytes from byte {info.header_offset}, but the file ends at byte "
                                        f"{len(data)}", DAMAGED_HINT)
        try:
            return archive.read(info)  # zipfile checks the record's CRC-32
        except Exception as e:
            raise damaged(e) from None

    if folder + "byteorder" in records:  # absent in files of PyTorch before 1.13, which were all little-endian
        order = read_record("byteorder", limit=16)
        if order != b"little":
            raise CheckpointError(path, f"its byteorder record says {order[:16]!r}, but this reader takes only "
                                        f"little-endian files", "save it again on a little-endian machine")
    pkl = read_record("data.pkl", limit=MAX_PICKLE_BYTES)
    stream = io.BytesIO(pkl)
    unpickler = StateDictUnpickler(stream, path)
    obj = load_pickle(stream, unpickler, path, "data.pkl", "PyTorch zip checkpoint")
    if stream.tell() != len(pkl):
        raise CheckpointError(path, f"its data.pkl has {len(pkl) - stream.tell()} bytes after its pickle",
                              DAMAGED_HINT)

    unused = sorted(name for name in records if name.startswith(folder + "data/")
                    and name[len(folder + "data/"):] not in unpickler.storages)
    if unused:
        raise CheckpointError(path, f"its record {unused[0][:60]} is the data of no tensor", DAMAGED_HINT)
    storages = {}
    for key, ref in unpickler.storages.items():
        if folder + "data/" + key not in records:
            raise CheckpointError(path, f"the data of storage {key[:40]} (record {folder}data/{key[:40]}) is "
                                        f"missing", DAMAGED_HINT)
        size = ELEMENT_SIZES[ref.dtype] * ref.numel
        if ref.dtype in RAW_DTYPES:  # other dtypes are never read: a VAE tensor of one is refused by name
            storages[key] = np.frombuffer(read_record("data/" + key, size=size), dtype=RAW_DTYPES[ref.dtype])
        elif records[folder + "data/" + key].file_size != size:
            raise CheckpointError(path, f"its record {folder}data/{key[:40]} holds "
                                        f"{records[folder + 'data/' + key].file_size} bytes, expected {size}",
                                  DAMAGED_HINT)
    return obj, storages


def read_safetensors(path, data):
    """{name: Tensor} of a safetensors file, every offset checked."""
    def refuse(what):
        return CheckpointError(path, what, DAMAGED_HINT)

    length = int.from_bytes(data[:8], "little")
    if length > MAX_SAFETENSORS_HEADER or 8 + length > len(data):
        raise refuse(f"its safetensors header length is {length}, but the file holds {len(data)} bytes "
                     f"(and a header is at most {MAX_SAFETENSORS_HEADER}); the file is truncated or damaged")

    def unique(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"a name appears twice in one object: {sorted(k for k in keys if keys.count(k) > 1)[0]}")
        return dict(pairs)

    try:
        header = json.loads(data[8:8 + length].decode("utf-8"), object_pairs_hook=unique)
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, RecursionError for deep nesting, ...
        raise refuse(f"its safetensors header is no valid JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise refuse("its safetensors header is no JSON object")
    metadata = header.pop("__metadata__", None)
    if not (metadata is None or isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise refuse("its safetensors __metadata__ is no object of strings")

    start, size = 8 + length, len(data) - 8 - length  # the data, after the header
    tensors, spans = {}, []
    for name, entry in header.items():
        if not (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}):
            raise refuse(f"its safetensors entry {name[:60]!r} is not an object of dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not (isinstance(dtype, str) and dtype in SAFETENSORS_DTYPES):
            raise refuse(f"its tensor {name[:60]} has dtype {short(dtype)!r}, which safetensors does not define")
        dtype = SAFETENSORS_DTYPES[dtype]
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise refuse(f"its tensor {name[:60]} has shape {short(shape)}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise refuse(f"its tensor {name[:60]} has data_offsets {short(offsets)}, not [begin, end] with "
                         f"0 <= begin <= end")
        begin, end = offsets
        numel = math.prod(shape)
        if end - begin != numel * ELEMENT_SIZES[dtype]:
            raise refuse(f"its tensor {name[:60]} of shape {shape} spans {end - begin} bytes, where its "
                         f"{numel} {dtype} values need {numel * ELEMENT_SIZES[dtype]}")
        if end > size:
            raise refuse(f"it is truncated: its tensor {name[:60]} needs bytes {begin}..{end - 1} of the data, "
                         f"which holds {size}")
        spans.append((begin, end, name))
        read = functools.partial(np.frombuffer, data, RAW_DTYPES.get(dtype, "u1"), numel, start + begin)
        tensors[name] = Tensor(dtype, tuple(shape), lambda read=read, shape=tuple(shape): read().reshape(shape))
    # sorted by where they begin, the tensors must tile the data exactly: no overlap, no gap, no bytes after
    last_end, last_name = 0, None
    for begin, end, name in sorted(spans):
        if begin < last_end:
            raise refuse(f"its tensors {last_name[:60]} and {name[:60]} overlap (bytes {begin}..{last_end - 1} "
                         f"of the data)")
        if begin > last_end:
            raise refuse(f"bytes {last_end}..{begin - 1} of its data belong to no tensor")
        last_end, last_name = end, name
    if last_end != size:
        raise refuse(f"bytes {last_end}..{size - 1} of its data belong to no tensor")
    return tensors


def read_checkpoint(path):
    """Reads a VAE checkpoint of any format and size of the family, without torch. Returns {name: float32
    array} in vae_weights.bin's order, each of a shape consistent with the others and finite; raises
    CheckpointError for anything else."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(path, f"cannot be read ({e.strerror})", "check the path and its permissions") from None
    if not data:
        raise CheckpointError(path, "the file is empty", DAMAGED_HINT)
    if data[8:9] == b"{":  # safetensors' header is a JSON object; bytes the pickles and zip never hold there
        return vae_tensors(path, read_safetensors(path, data))
    if data.startswith(ZIP_MAGIC):
        obj, storages = read_zip(path, data)
    elif data.startswith(b"\x80"):  # a pickle's PROTO opcode: the legacy format's first pickle
        obj, storages = read_legacy(path, data)
    else:
        raise CheckpointError(path, "it is none of the formats this reader knows: PyTorch's zip format, its legacy "
                                    "format, or safetensors", STATE_HINT)
    return vae_tensors(path, pickled_state(path, obj, storages))


def describe(value):
    return "a tensor" if isinstance(value, TensorRef) else f"a {type(value).__name__}"


def short(value, limit=40):
    """value's text for a message, cut short: what a damaged pickle holds may be long, or nested too deep to print."""
    try:
        return str(value)[:limit]
    except Exception:  # RecursionError
        return describe(value)


def pickled_state(path, obj, storages):
    """{name: Tensor or other value} of the state_dict in a pickled checkpoint's object: the object itself,
    or its entry 'state_dict' or 'model' when it wraps one beside other entries."""
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"it holds {describe(obj)}, not a state_dict (a dict of tensors)")
    state = obj
    if not any(isinstance(key, str) and key.removeprefix(DATA_PARALLEL_PREFIX) in VAE_LAYOUT for key in obj):
        wrapped = [key for key in WRAPPER_KEYS if isinstance(obj.get(key), dict)]
        if len(wrapped) == 2:
            raise CheckpointError(path, "it holds both a 'state_dict' and a 'model'; which is the VAE's is unclear")
        if wrapped:
            state = obj[wrapped[0]]
        elif not any(isinstance(value, TensorRef) for value in obj.values()):
            raise CheckpointError(path, f"it holds a dict with no tensor, and neither 'state_dict' nor 'model'; "
                                        f"its keys are {short(list(obj), 80)}")
    return {key: tensor_of(path, key, value, storages) if isinstance(value, TensorRef) else value
            for key, value in state.items()}


def tensor_of(path, name, ref, storages):
    """A pickled tensor as a Tensor; refuses a malformed view, or one that leaves its storage."""
    def is_ints(values):
        return isinstance(values, tuple) and all(type(v) is int and v >= 0 for v in values)

    name = short(name, 60)
    if not isinstance(ref.storage, StorageRef):
        raise CheckpointError(path, f"its entry {name} is a tensor without a storage", DAMAGED_HINT)
    if not (type(ref.offset) is int and ref.offset >= 0 and is_ints(ref.size) and is_ints(ref.stride)
            and len(ref.size) == len(ref.stride)):
        raise CheckpointError(path, f"{name} has a malformed view: offset {short(ref.offset)}, "
                                    f"size {short(ref.size)}, stride {short(ref.stride)}", DAMAGED_HINT)
    numel = ref.storage.numel
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))  # the last element it reaches
    if 0 not in ref.size and last >= numel:
        raise CheckpointError(path, f"{name} reaches element {last} of storage {ref.storage.key[:40]}, "
                                    f"which holds {numel}", DAMAGED_HINT)

    def read():
        storage = storages[ref.storage.key]
        # a dimension of one element never steps, so its stride (free in PyTorch, maybe huge) is left out
        strides = [s * storage.itemsize if n > 1 else 0 for n, s in zip(ref.size, ref.stride)]
        return np.lib.stride_tricks.as_strided(storage[min(ref.offset, storage.size):], shape=ref.size,
                                               strides=strides, writeable=False)
    return Tensor(ref.storage.dtype, ref.size, read)


def vae_tensors(path, state):
    """The VAE's tensors in a state_dict ({name: Tensor or other value}) as {name: float32 array}, in
    vae_weights.bin's order (a Weights): the names, then the shapes (so that no claimed size is ever allocated),
    the dtypes, and the values, each checked."""
    names = {}  # name without its DataParallel prefix -> key
    for key in state:
        if not isinstance(key, str):
            raise CheckpointError(path, f"its state_dict has the key {short(key)}, which is no name")
        name = key.removeprefix(DATA_PARALLEL_PREFIX)
        if name in names:
            raise CheckpointError(path, f"its state_dict holds both {names[name][:60]!r} and {key[:60]!r}")
        names[name] = key
    missing = [n for n in TENSOR_ORDER if n not in names]
    extra = [n[:60] for n in names if n not in VAE_LAYOUT]
    if missing or extra:
        raise CheckpointError(path, f"its state_dict is not the VAE's: missing {missing or 'none'}, "
                                    f"unexpected {str(extra[:10]) if extra else 'none'}")
    tensors = {name: state[names[name]] for name in TENSOR_ORDER}
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise CheckpointError(path, f"its entry {short(names[name], 60)} is {describe(tensor)}, not a tensor")
    check_shapes(path, {name: tensor.shape for name, tensor in tensors.items()})
    for name, tensor in tensors.items():
        if tensor.dtype not in RAW_DTYPES:
            raise CheckpointError(path, f"{name} has dtype {tensor.dtype}; the reader converts float32, float16, "
                                        f"bfloat16 and float64", "save the state_dict of a floating-point model")
    weights, rounded = {}, {}
    for name, tensor in tensors.items():
        weights[name], change = to_float32(path, name, tensor)
        if change:
            rounded[name] = change
    return Weights(weights, {name: tensor.dtype for name, tensor in tensors.items()}, rounded)


def check_shapes(path, shapes):
    """Refuses shapes ({name: tuple}) that are not those of one VAE of the family; H1, Z and H3 are taken
    from fc1.weight, fc21.weight and fc3.weight, and every other shape must agree with them."""
    sizes, source = {}, {}  # "H1" -> its value, and the tensor that gave it
    for name in SHAPE_ORDER:
        shape, layout = list(shapes[name]), VAE_LAYOUT[name]
        if len(shape) == len(layout):
            for size, n in zip(layout, shape):
                if isinstance(size, str) and size not in sizes:
                    low, high = SIZE_BOUNDS[size]
                    if not low <= n <= high:
                        raise CheckpointError(path, f"{name} has shape {shape}: {size} = {n} is outside the sizes "
                                                    f"that vae.cu runs ({SIZE_LIMITS})", SIZE_HINT)
                    sizes[size], source[size] = n, name
        expected = [sizes.get(size, size) for size in layout]
        if shape == expected:
            continue
        what = f"{name} has shape {shape}, expected [{', '.join(map(str, layout))}]"
        given = [size for size in layout if isinstance(size, str) and source.get(size, name) != name]
        if given and all(isinstance(n, int) for n in expected):
            what += f" = {expected} (" + ", ".join(f"{size} from {source[size]}" for size in given) + ")"
        if len(shape) == len(layout) and any(size == INPUT_DIM and n != INPUT_DIM for size, n in zip(layout, shape)):
            what += f": the input must be {INPUT_DIM} (28x28 images)"
        raise CheckpointError(path, what)


def dims_of(tensors):
    """H1, Z and H3 of checked VAE tensors."""
    return Dims(tensors["fc1.weight"].shape[0], tensors["fc21.weight"].shape[0], tensors["fc3.weight"].shape[0])


def to_float32(path, name, tensor):
    """A tensor's values as a contiguous float32 array, and the largest absolute change that rounding made (0 but
    for float64: float16 and bfloat16, float32's upper half, convert exactly)."""
    raw = tensor.read()
    if tensor.dtype == "bfloat16":
        values = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf, refused below
            values = raw.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        index = np.unravel_index(bad[0], values.shape)
        at = f"{name}[{', '.join(map(str, index))}]"
        if tensor.dtype == "float64" and np.isfinite(raw[index]):
            raise CheckpointError(path, f"{at} is {raw[index]}, non-finite as float32 (beyond its range)",
                                  "the weights must be finite float32 values")
        raise CheckpointError(path, f"{at} is {values[index]}, a non-finite value",
                              "the weights must be finite; check the training run that saved them")
    change = float(np.abs(values - raw).max(initial=0.0)) if tensor.dtype == "float64" else 0.0
    return values, change


# ----------------------------------------------------------------------------
# inputs

def md5(path):
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_inputs(src, download_dir):
    """Returns {name: path} of verified input files, from src or downloaded."""
    paths = {}
    for name, (url, want) in SOURCES.items():
        if src is not None:
            path = os.path.join(src, name)
            if not os.path.isfile(path):
                fail(f"{path} not found. HINT: point --src at the folder holding {name}, "
                     f"or drop --src to download it")
        else:
            path = os.path.join(download_dir, name)
            if not (os.path.isfile(path) and md5(path) == want):
                made = not os.path.isdir(download_dir)
                os.makedirs(download_dir, exist_ok=True)
                print(f"downloading {url}")
                try:
                    with urllib.request.urlopen(url, timeout=60) as r, open(path + ".part", "wb") as f:
                        shutil.copyfileobj(r, f)
                except OSError as e:
                    # no partial file, and no downloads/ folder that this run made and left empty
                    with contextlib.suppress(OSError):
                        os.remove(path + ".part")
                    with contextlib.suppress(OSError):
                        if made:
                            os.rmdir(download_dir)
                    fail(f"cannot download {url} ({e}). HINT: when offline, copy the files to a "
                         f"folder and run: {sys.executable} prepare_weights.py --src FOLDER")
                os.replace(path + ".part", path)
        got = md5(path)
        if got != want:
            if src is not None:  # the user's own copy, perhaps their only one: never suggest deleting it
                fail(f"{path} has MD5 {got}, expected {want}: it is not the published {name}. HINT: replace "
                     f"it with a fresh copy from {url}, or drop --src to download it")
            fail(f"{path} has MD5 {got}, expected {want}: the download is corrupt or the published file "
                 f"changed. HINT: run again to download it anew ({path} is only a downloaded copy)")
        paths[name] = path
    return paths


def read_idx(path, gz=True):
    """Reads an idx file; returns (raw bytes, numpy array)."""
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    ndim = magic & 0xFF
    if magic >> 8 != 0x08 or ndim not in (1, 3):
        fail(f"{path}: not an unsigned-byte idx file (magic 0x{magic:08x})")
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        fail(f"{path}: header says {shape} but holds {data.size} bytes of data")
    return raw, data.reshape(shape)


# ----------------------------------------------------------------------------
# outputs

# inside all_or_nothing(): the (temporary, path) pairs of the complete outputs, renamed when the whole block completes
deferred = None


@contextlib.contextmanager
def replace_when_complete(path):
    """A file for path's new contents: a temporary beside it, renamed over path only when the block
    completes (inside all_or_nothing(), when that block completes), so that a failure part way (even
    sys.exit) leaves the earlier path as it was."""
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "wb") as f:
            yield f
        if deferred is None:
            os.replace(part, path)
        else:
            deferred.append((part, path))
    finally:
        if deferred is None and os.path.exists(part):
            os.remove(part)


@contextlib.contextmanager
def all_or_nothing():
    """Holds back every replace_when_complete inside the block until the whole block completes: then each
    output takes its path; if the block fails, none does, and no temporary stays behind."""
    global deferred
    deferred = []
    try:
        yield
        for part, path in deferred:
            os.replace(part, path)
    finally:
        for part, _ in deferred:
            if os.path.exists(part):
                os.remove(part)
        deferred = None


@contextlib.contextmanager
def folders_for(path):
    """Creates the missing folders above path, and removes them again if the block fails, so that a failed
    run leaves no new empty folders behind."""
    missing, folder = [], os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    created = []
    try:
        for folder in reversed(missing):
            os.mkdir(folder)
            created.append(folder)
        yield
    except BaseException:  # fail()'s SystemExit too
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


def header(magic, version, dims, extra):
    """A file's 256-int32 header: magic, version, then 784 and the dims' H1 and Z, then extra {index: value}."""
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[0], h[1] = magic, version
    h[2], h[3], h[4] = INPUT_DIM, dims.h1, dims.z
    for i, v in extra.items():
        h[i] = v
    return h


def write_weights(state, path):
    """Writes vae_weights.bin's version-2 format for checked VAE tensors (a Weights, or {name: float32 array})."""
    dims = dims_of(state)
    tensors = [state[k].astype("<f4").ravel() for k in TENSOR_ORDER]
    total = sum(t.size for t in tensors)
    h = header(WEIGHTS_MAGIC, WEIGHTS_VERSION, dims, {5: DTYPE_FLOAT32, 6: len(tensors), 7: total, 8: dims.h3})
    with folders_for(path), replace_when_complete(path) as f:
        f.write(h.tobytes())
        for t in tensors:
            f.write(t.tobytes())
        f.flush()
        # read back and compare bit for bit with what was written before the file takes path's place
        blob = np.fromfile(f.name, dtype="<i4")
        if not np.array_equal(blob[:HEADER_INTS], h):
            fail(f"{path}: header did not read back")
        floats = blob[HEADER_INTS:].view("<f4")
        if floats.size != total:
            fail(f"{path}: wrote {floats.size} floats, expected {total}")
        offset = 0
        for name, t in zip(TENSOR_ORDER, tensors):
            if not np.array_equal(floats[offset:offset + t.size].view("<u4"), t.view("<u4")):
                fail(f"{path}: {name} did not read back bit for bit as written")
            offset += t.size
    print(f"wrote {path}: H1 = {dims.h1}, Z = {dims.z}, H3 = {dims.h3}; {len(tensors)} tensors, {total} floats, "
          f"{conversion_note(state)}")


def conversion_note(state):
    """How the file written from state compares with the checkpoint that state was read from."""
    rounded = getattr(state, "rounded", {})
    if rounded:
        return (f"{len(rounded)} of {len(state)} tensors rounded from float64 to float32 (largest change "
                f"{max(rounded.values()):.2g}), matches the rounded values bit for bit")
    converted = sorted({dtype for dtype in getattr(state, "dtypes", {}).values() if dtype != "float32"})
    if converted:
        return f"{' and '.join(converted)} converted to float32 exactly, matches the checkpoint's values exactly"
    return "matches the checkpoint bit for bit"


def write_idx_files(raw_images, raw_labels, out, count):
    for name, raw in (("t10k-images-idx3-ubyte", raw_images), ("t10k-labels-idx1-ubyte", raw_labels)):
        with replace_when_complete(os.path.join(out, name)) as f:
            f.write(raw)
    print(f"wrote {out}/t10k-images-idx3-ubyte, {out}/t10k-labels-idx1-ubyte: {count} images")


# ----------------------------------------------------------------------------
# reference dumps, with PyTorch

def torch_missing():
    """Why torch cannot be imported here, or None when it can."""
    try:
        importlib.import_module("torch")
    except ImportError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=None)
def vae_class():
    """The model as it was trained (the PyTorch examples VAE), of any size of the family; defined on first use,
    as it needs torch."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class VAE(nn.Module):
        def __init__(self, dims=PUBLISHED_DIMS):
            super().__init__()
            self.fc1 = nn.Linear(INPUT_DIM, dims.h1)
            self.fc21 = nn.Linear(dims.h1, dims.z)
            self.fc22 = nn.Linear(dims.h1, dims.z)
            self.fc3 = nn.Linear(dims.z, dims.h3)
            self.fc4 = nn.Linear(dims.h3, INPUT_DIM)

        def encode(self, x):
            h1 = F.relu(self.fc1(x))
            return self.fc21(h1), self.fc22(h1)

        def reparameterize(self, mu, logvar, eps):
            std = torch.exp(0.5 * logvar)
            return mu + eps * std

        def decode(self, z):
            h3 = F.relu(self.fc3(z))
            return torch.sigmoid(self.fc4(h3))

    return VAE


def model_dims(model):
    return Dims(model.fc1.out_features, model.fc21.out_features, model.fc3.out_features)


def torch_models(state):
    """The VAE in float32 and in float64, holding the checkpoint's weights (state, from the reader), its
    size taken from their shapes."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    weights = {name: torch.from_numpy(array) for name, array in state.items()}
    models = []
    for dtype in (torch.float32, torch.float64):
        model = vae_class()(dims_of(state)).to(dtype)
        model.load_state_dict(weights)  # copies, converting float32 to the model's dtype exactly
        models.append(model.eval())
    return models


def forward(model, x, eps):
    """Every activation of one forward pass plus per-image BCE and KL."""
    import torch
    import torch.nn.functional as F
    mu, logvar = model.encode(x)
    h1 = F.relu(model.fc1(x))
    z = model.reparameterize(mu, logvar, eps)
    h3 = F.relu(model.fc3(z))
    logits = model.fc4(h3)
    recon = torch.sigmoid(logits)
    # BCE summed over pixels, from the logits: max(l,0) - x*l + log(1 + exp(-|l|))
    bce = (logits.clamp(min=0) - x * logits + torch.log1p(torch.exp(-logits.abs()))).sum(1)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
    return dict(x=x, eps=eps, h1=h1, mu=mu, logvar=logvar, z=z, h3=h3, logits=logits,
                recon=recon, bce=bce, kl=kl)


DEBUG_TENSORS = ["x", "eps", "h1", "mu", "logvar", "z", "h3", "logits", "recon", "bce", "kl"]


def write_debug_state(model, model64, images, path):
    import torch
    dims = model_dims(model)
    extra = {5: len(DEBUG_CASES), 6: dims.h3}
    for c, (b, first) in enumerate(DEBUG_CASES):
        extra[8 + 2 * c], extra[9 + 2 * c] = b, first
    gen = torch.Generator().manual_seed(DEBUG_SEED)
    with replace_when_complete(path) as f:
        f.write(header(DEBUG_MAGIC, STATE_VERSION, dims, extra).tobytes())
        for b, first in DEBUG_CASES:
            pixels = torch.from_numpy(images[first:first + b].reshape(b, -1).astype(np.float64))
            eps32 = torch.randn(b, dims.z, generator=gen, dtype=torch.float32)
            with torch.no_grad():
                ref64 = forward(model64, pixels / 255.0, eps32.double())
                ref32 = forward(model, pixels.float() / 255.0, eps32)
            for name in DEBUG_TENSORS:
                f.write(ref64[name].numpy().astype("<f8").tobytes())
                f.write(ref32[name].numpy().astype("<f4").tobytes())
            worst = max(((ref32[n].double() - ref64[n]).abs().max().item(), n) for n in DEBUG_TENSORS)
            print(f"debug case B={b} from image {first}: PyTorch float32 vs float64 worst abs "
                  f"difference {worst[0]:.2e} ({worst[1]})")
    print(f"wrote {path}")


def iwae_log_px(model, x, eps):
    """log p(x) of each row of x from K samples each (eps [N, K, Z]), all terms in full."""
    import torch
    import torch.nn.functional as F
    n, k, _ = eps.shape
    mu, logvar = model.encode(x)
    std = torch.exp(0.5 * logvar)
    z = mu[:, None, :] + eps * std[:, None, :]
    logits = model.fc4(F.relu(model.fc3(z)))  # decode() without its sigmoid: BCE from the logits
    xk = x[:, None, :]
    bce = (logits.clamp(min=0) - xk * logits + torch.log1p(torch.exp(-logits.abs()))).sum(2)
    normal = torch.distributions.Normal
    log_pz = normal(torch.zeros_like(z), torch.ones_like(z)).log_prob(z).sum(2)
    log_qz = normal(mu[:, None, :].expand_as(z), std[:, None, :].expand_as(z)).log_prob(z).sum(2)
    return torch.logsumexp(-bce + log_pz - log_qz, dim=1) - math.log(k)


def write_iwae_state(model, model64, images, path):
    import torch
    dims = model_dims(model)
    n, k, first = IWAE_CASE
    gen = torch.Generator().manual_seed(DEBUG_SEED + 1)
    eps32 = torch.randn(n, k, dims.z, generator=gen, dtype=torch.float32)
    pixels = torch.from_numpy(images[first:first + n].reshape(n, -1).astype(np.float64))
    with torch.no_grad():
        ref64 = iwae_log_px(model64, pixels / 255.0, eps32.double())
        ref32 = iwae_log_px(model, pixels.float() / 255.0, eps32)
    with replace_when_complete(path) as f:
        f.write(header(IWAE_MAGIC, STATE_VERSION, dims, {5: n, 6: k, 7: first, 8: dims.h3}).tobytes())
        f.write(eps32.numpy().astype("<f4").tobytes())
        f.write(ref64.numpy().astype("<f8").tobytes())
        f.write(ref32.numpy().astype("<f4").tobytes())
    print(f"wrote {path}: log p(x) of images {first}..{first + n - 1}, K = {k}: "
          + " ".join(f"{v:.4f}" for v in ref64.tolist()))


def reference_loss(model64, images):
    """Full-test-set float64 losses with z = mu, and with eps drawn by PyTorch."""
    import torch
    import torch.nn.functional as F
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float64)) / 255.0
    with torch.no_grad():
        mu, logvar = model64.encode(x)
        zmu = forward(model64, x, torch.zeros_like(mu))
        eps = torch.randn(mu.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        sampled = forward(model64, x, eps)
        # the training loss used binary_cross_entropy on the probabilities; equal in float64
        bce_prob = F.binary_cross_entropy(zmu["recon"], x, reduction="none").sum(1)
    print(f"float64, z = mu:   mean BCE {zmu['bce'].mean():.4f}  mean KL {zmu['kl'].mean():.4f}  "
          f"(BCE from probabilities {bce_prob.mean():.4f})")
    print(f"float64, sampled:  mean BCE {sampled['bce'].mean():.4f}  mean KL {sampled['kl'].mean():.4f}  "
          f"loss {(sampled['bce'] + sampled['kl']).mean():.4f}")


def family_name(dims):
    return f"vae_784_{dims.h1}_{dims.z}_{dims.h3}"


def train_family_vae(dims, images, seed=FAMILY_SEED, epochs=None):
    """A float32 VAE of these dims from torch.manual_seed(seed), trained on the CPU for `epochs` (default
    FAMILY_EPOCHS) epochs of Adam on images (uint8 [N][28][28]) as pytorch/examples' vae/main.py trains it:
    x = byte / 255, the BCE summed over pixels (here from the logits) plus the KL, one eps per image and step."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(seed)
    model = vae_class()(dims)
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32)) / 255.0
    optimizer = torch.optim.Adam(model.parameters(), lr=FAMILY_LR)
    epochs = FAMILY_EPOCHS if epochs is None else epochs
    for epoch in range(epochs):
        total = 0.0
        for batch in torch.randperm(len(x)).split(FAMILY_BATCH):
            xb = x[batch]
            mu, logvar = model.encode(xb)
            logits = model.fc4(F.relu(model.fc3(model.reparameterize(mu, logvar, torch.randn_like(mu)))))
            loss = (F.binary_cross_entropy_with_logits(logits, xb, reduction="sum")
                    - 0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        print(f"{family_name(dims)}: epoch {epoch + 1} of {epochs}, mean loss {total / len(x):.4f} (training, "
              f"sampled z)")
    return model.eval()


def write_family_model(dims, images, out):
    """--family's four files of one size in folder out: the zip checkpoint, its weights file as --checkpoint
    converts it, and the two reference dumps of those weights."""
    import torch
    paths = {suffix: os.path.join(out, family_name(dims) + suffix) for suffix in FAMILY_SUFFIXES}
    model = train_family_vae(dims, images)
    with replace_when_complete(paths[".pth"]) as f:
        torch.save(model.state_dict(), f)  # torch.save's default: the zip format
        f.flush()
        try:  # read back from the file, as --checkpoint reads it: the .bin and the dumps hold its weights
            state = read_checkpoint(f.name)
        except CheckpointError as e:
            fail(e)
    print(f"wrote {paths['.pth']}: torch.save(model.state_dict()), zip format")
    write_weights(state, paths[".bin"])
    model, model64 = torch_models(state)
    write_debug_state(model, model64, images, paths["_debug_state.bin"])
    write_iwae_state(model, model64, images, paths["_iwae_state.bin"])


def make_family(out, images_path):
    """--family: the test models of FAMILY_DIMS and their reference dumps in folder out, all or nothing; trained
    on the idx file images_path."""
    no_torch = torch_missing()
    if no_torch:
        fail(f"--family needs torch, which {sys.executable} cannot import ({no_torch}). HINT: {TORCH_HINT}")
    if not os.path.isfile(images_path):
        fail(f"{images_path} not found: --family trains on the MNIST test images. HINT: run 'make data'")
    _, images = read_idx(images_path, gz=False)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or len(images) < max(f + b for b, f in DEBUG_CASES):
        fail(f"{images_path} holds images of shape {images.shape}, expected the 10,000 28x28 MNIST test images. "
             f"HINT: run 'make data'")
    with folders_for(os.path.join(out, family_name(FAMILY_DIMS[0]))), all_or_nothing():
        for dims in FAMILY_DIMS:
            write_family_model(dims, images, out)


def convert_checkpoint(args):
    """--checkpoint: one file of any format and size of the family to one weights file, with numpy alone."""
    if args.src or args.only or args.reference_loss:
        fail("--checkpoint converts one file alone and takes no --src, --only or --reference-loss. HINT: run "
             "those without --checkpoint, for the published checkpoint")
    stem = os.path.splitext(os.path.basename(args.checkpoint))[0]
    out = args.out or os.path.join("data", stem + ".bin")
    if os.path.isdir(out):
        fail(f"--out {out} is a folder; with --checkpoint, --out names the weights file. HINT: --out "
             f"{os.path.join(out, stem + '.bin')}")
    if os.path.exists(out) and os.path.exists(args.checkpoint) and os.path.samefile(out, args.checkpoint):
        fail(f"--out {out} is the checkpoint itself. HINT: name another file, e.g. --out data/{stem}.bin")
    try:
        state = read_checkpoint(args.checkpoint)
    except CheckpointError as e:
        fail(e)
    try:
        write_weights(state, out)
    except OSError as e:
        fail(f"cannot write {out} ({e.strerror}). HINT: check that its folder can be written")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--src", help="folder holding vae_epoch_25.pth and the t10k .gz files "
                                 "(default: download them)")
    p.add_argument("--out", help="output folder (default: data; with --family, data/family); with --checkpoint, "
                                 "the output file (default: data/<FILE's name without its suffix>.bin)")
    p.add_argument("--only", choices=["inputs", "references"],
                   help="inputs: vae_weights.bin and the two idx files, numpy only; references: "
                        f"{' and '.join(REFERENCE_FILES)}, needs torch (default: both, the references only "
                        "when torch imports)")
    p.add_argument("--reference-loss", action="store_true",
                   help="also print the float64 mean losses over the whole test set (needs torch)")
    p.add_argument("--family", action="store_true",
                   help="train the test models of other sizes (" + ", ".join(f"784-{d.h1}-{d.z}-{d.h3}" for d in
                   FAMILY_DIMS) + ") on data/t10k-images-idx3-ubyte and write each as a zip checkpoint, its "
                   "weights file and its two reference dumps to --out (default data/family); needs torch")
    p.add_argument("--checkpoint", metavar="FILE",
                   help="convert FILE alone to a weights file, numpy only: a VAE state_dict of any size of the "
                        f"family (1 <= H1, H3 <= {MAX_HIDDEN}, 1 <= Z <= {MAX_LATENT}) saved by torch.save (zip or "
                        "legacy format) or safetensors; float32, float16, bfloat16 or float64")
    args = p.parse_args()
    if np is None:
        sys.exit(numpy_missing())
    if args.checkpoint and args.family:
        fail("--checkpoint converts one file; --family makes the test models. HINT: pass one of them")
    if args.checkpoint:
        return convert_checkpoint(args)
    if args.family:
        if args.src or args.only or args.reference_loss:
            fail("--family trains on data/t10k-images-idx3-ubyte and takes no --src, --only or --reference-loss. "
                 "HINT: run 'make data' first, then prepare_weights.py --family")
        return make_family(args.out or os.path.join("data", "family"),
                           os.path.join("data", "t10k-images-idx3-ubyte"))
    out = args.out or "data"

    write_inputs, write_references = args.only != "references", args.only != "inputs"
    # learn whether torch imports before any work, so that a missing torch fails before anything is written
    no_torch = torch_missing() if write_references or args.reference_loss else None
    if no_torch and (args.only == "references" or args.reference_loss):
        what = "--only references" if args.only == "references" else "--reference-loss"
        fail(f"{what} needs torch, which {sys.executable} cannot import ({no_torch}). HINT: {TORCH_HINT}")

    # the output folder is made for the run and goes again if the run fails (offline, a bad input)
    with folders_for(os.path.join(out, "vae_weights.bin")):
        inputs = fetch_inputs(args.src, os.path.join(out, "downloads"))
        try:
            state = read_checkpoint(inputs[CHECKPOINT])
        except CheckpointError as e:
            fail(e)
        raw_images, images = read_idx(inputs["t10k-images-idx3-ubyte.gz"])
        raw_labels, labels = read_idx(inputs["t10k-labels-idx1-ubyte.gz"])
        if images.shape[1:] != (28, 28) or labels.shape[0] != images.shape[0]:
            fail(f"unexpected MNIST shapes: images {images.shape}, labels {labels.shape}")

        if write_inputs:
            write_weights(state, os.path.join(out, "vae_weights.bin"))
            write_idx_files(raw_images, raw_labels, out, images.shape[0])
        if no_torch:  # only reached without --only, where the references are optional
            print(f"prepare_weights.py: note: skipped {' and '.join(REFERENCE_FILES)}: torch is missing "
                  f"({no_torch}), and only 'make test' needs them. HINT: {TORCH_HINT}", file=sys.stderr)
        elif write_references or args.reference_loss:
            model, model64 = torch_models(state)
            if write_references:
                write_debug_state(model, model64, images, os.path.join(out, REFERENCE_FILES[0]))
                write_iwae_state(model, model64, images, os.path.join(out, REFERENCE_FILES[1]))
            if args.reference_loss:
                reference_loss(model64, images)


if __name__ == "__main__":
    main()
