#!/usr/bin/env python3
"""
Prepares everything vae.cu reads: the inputs with numpy alone, the reference dumps with PyTorch.

  data/vae_weights.bin          the pretrained weights in vae.cu's binary format      numpy
  data/t10k-images-idx3-ubyte   MNIST test images (standard idx3, uncompressed)        numpy
  data/t10k-labels-idx1-ubyte   MNIST test labels (standard idx1, uncompressed)        numpy
  data/vae_debug_state.bin      reference activations for test_vae.cu                  torch
  data/vae_iwae_state.bin       reference IWAE log-likelihoods for test_vae.cu         torch

The checkpoint is read without torch, by a reader of PyTorch's legacy (non-zip) format that takes
float32 tensors and refuses any other object, so nothing in the file can run code. PyTorch is the
reference implementation behind the two dumps, which only 'make test' needs.

Inputs come from --src DIR (a folder holding vae_epoch_25.pth and the two t10k .gz files)
or, without --src, are downloaded; either way their MD5s are checked.

  python3 prepare_weights.py --src ../shared/data                      # all; the inputs alone without torch
  python3 prepare_weights.py --src ../shared/data --only inputs        # numpy only
  python3 prepare_weights.py --src ../shared/data --only references    # torch (Debian's: /usr/bin/python3)
  python3 prepare_weights.py --reference-loss     # also print full-test-set float64 losses (torch)

Each output is written to a temporary file beside it and renamed into place once complete, so a
failure leaves the earlier file as it was.

Weights file: a header of 256 int32 then the tensors as little-endian float32, in the
PyTorch Linear layout (weight[out][in] row-major, then bias[out]):
  header[0] magic 0x31454156 ("VAE1")  header[1] version 1
  header[2] input dim 784  header[3] hidden dim 400  header[4] latent dim 20
  header[5] dtype (1 = float32)  header[6] tensor count (10)  header[7] total floats
  tensors: fc1.w fc1.b fc21.w fc21.b fc22.w fc22.b fc3.w fc3.b fc4.w fc4.b

Debug state file: a header of 256 int32 then, for each case, tensors as float64 and float32:
  header[0] magic 0x44454156 ("VAED")  header[1] version 1
  header[2..4] dims 784/400/20  header[5] case count C
  header[8 + 2c] batch size B of case c, header[9 + 2c] index of its first test image
  per case, for each tensor t of x eps h1 mu logvar z h3 logits recon bce kl (B rows each;
  widths 784 20 400 20 20 20 400 784 784 1 1): t in float64, then t in float32.
  The float64 values come from a float64 forward pass, the float32 values from PyTorch's own
  float32 forward pass; both use the same eps (drawn in float32, so it is exact in both).

IWAE state file: a header of 256 int32 then eps, then log p(x) in float64 and in float32:
  header[0] magic 0x49454156 ("VAEI")  header[1] version 1  header[2..4] dims 784/400/20
  header[5] image count N  header[6] samples per image K  header[7] index of the first image
  eps float32 [N][K][20]; log p(x) float64 [N]; log p(x) float32 [N], where
  log p(x) = logsumexp_k [log p(x|z_k) + log N(z_k; 0, I) - log N(z_k; mu, sigma^2)] - log K,
  z_k = mu + sigma eps_k, log p(x|z) = -BCE, each Gaussian with its -1/2 log(2 pi).
"""
import argparse
import collections
import contextlib
import functools
import gzip
import hashlib
import importlib
import io
import math
import os
import pickle
import pickletools
import shutil
import sys
import urllib.request

try:
    import numpy as np
except ImportError:
    sys.exit("prepare_weights.py: error: numpy is missing. "
             "HINT: apt-get install -y python3-numpy, or python3 -m pip install numpy")

INPUT_DIM, HIDDEN_DIM, LATENT_DIM = 784, 400, 20
WEIGHTS_MAGIC, DEBUG_MAGIC, IWAE_MAGIC, VERSION = 0x31454156, 0x44454156, 0x49454156, 1
DTYPE_FLOAT32 = 1
HEADER_INTS = 256
# the checkpoint's tensors in vae_weights.bin's order, with their shapes (PyTorch Linear: weight[out][in], bias[out])
VAE_SHAPES = {
    "fc1.weight": (HIDDEN_DIM, INPUT_DIM), "fc1.bias": (HIDDEN_DIM,),
    "fc21.weight": (LATENT_DIM, HIDDEN_DIM), "fc21.bias": (LATENT_DIM,),
    "fc22.weight": (LATENT_DIM, HIDDEN_DIM), "fc22.bias": (LATENT_DIM,),
    "fc3.weight": (HIDDEN_DIM, LATENT_DIM), "fc3.bias": (HIDDEN_DIM,),
    "fc4.weight": (INPUT_DIM, HIDDEN_DIM), "fc4.bias": (INPUT_DIM,),
}
TENSOR_ORDER = list(VAE_SHAPES)
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
TORCH_HINT = "apt-get install -y python3-torch python3-numpy (Debian's torch, for /usr/bin/python3)"


def fail(msg):
    print(f"prepare_weights.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


# ----------------------------------------------------------------------------
# the checkpoint, without torch
#
# PyTorch's legacy format (torch.save(..., _use_new_zipfile_serialization=False)) is five pickles
# in a row: a magic number, the format's protocol version, the saving machine's sys_info, the
# state_dict (its tensors refer to storages through persistent ids), and the list of storage keys.
# Then, for each key in that order, the storage's element count as int64 and its raw bytes.

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
LEGACY_PICKLE_PROTOCOL = 2  # what torch.save pickles with, by default
ZIP_MAGIC = b"PK\x03\x04"
PUBLISHED_HINT = f"use the published checkpoint, {SOURCES[CHECKPOINT][0]}"


class CheckpointError(Exception):
    """A checkpoint that the reader refuses; str() is the one-line message."""

    def __init__(self, path, what, hint=PUBLISHED_HINT):
        super().__init__(f"{path}: {what}. HINT: {hint}")


# What the state_dict pickle refers to, as inert records: nothing in the file is ever called.
StorageType = collections.namedtuple("StorageType", "name")  # a torch.*Storage class
StorageRef = collections.namedtuple("StorageRef", "key numel")  # a persistent id of a float32 storage
TensorRef = collections.namedtuple("TensorRef", "storage offset size stride")


def rebuild_tensor(storage, offset, size, stride, *_):
    """Stands in for torch._utils._rebuild_tensor_v2; requires_grad, backward hooks and (newer PyTorch)
    metadata do not matter for the weights. The view is made once the storages' bytes are read."""
    return TensorRef(storage, offset, size, stride)


class StateDictUnpickler(pickle.Unpickler):
    """Unpickles a legacy checkpoint's pickles, allowing only the globals that a state_dict of tensors needs."""

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
                              f"save the model's state_dict, not the model, or {PUBLISHED_HINT}")

    def persistent_load(self, pid):
        # ('storage', storage type, key, location, element count[, view metadata]); location is ignored (all CPU)
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"
                and isinstance(pid[1], StorageType) and isinstance(pid[2], str)
                and type(pid[4]) is int and pid[4] >= 0 and pid[5:] in ((), (None,))):
            raise CheckpointError(self.path, f"its pickle holds a reference this reader does not know: "
                                             f"{repr(pid)[:80]}")
        storage_type, key, numel = pid[1], pid[2], pid[4]
        if storage_type.name != "FloatStorage":
            raise CheckpointError(self.path, f"it holds a torch.{storage_type.name}; only float32 tensors "
                                             f"(torch.FloatStorage) are accepted",
                                  "save the state_dict of a float32 model (model.float())")
        ref = self.storages.setdefault(key, StorageRef(key, numel))
        if ref.numel != numel:
            raise CheckpointError(self.path, f"storage {key} is given as {ref.numel} and as {numel} elements")
        return ref


def read_legacy_checkpoint(path, shapes=VAE_SHAPES):
    """Reads a state_dict saved in PyTorch's legacy format, without torch. Returns {name: float32 array}
    holding exactly the tensors named in shapes, each of its shape and finite; raises CheckpointError
    for anything else."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(path, f"cannot be read ({e.strerror})", "check the path and its permissions") from None
    if not data:
        raise CheckpointError(path, "the file is empty")
    if data.startswith(ZIP_MAGIC):
        raise CheckpointError(path, "it is in PyTorch's newer zip format, but this reader expects the legacy "
                                    "format that the published checkpoint uses",
                              "use the published checkpoint, or re-save the state_dict with "
                              "torch.save(state_dict, f, _use_new_zipfile_serialization=False)")
    stream = io.BytesIO(data)
    unpickler = StateDictUnpickler(stream, path)

    def load(what):
        start = stream.tell()
        try:
            # Walk the opcodes first, in pure Python: it finds a truncated pickle, and refuses opcodes that
            # the unpickler would trust to size an allocation (a bytearray8 of 2**60 bytes, a memo slot
            # of 2**32) before it could tell that the file is too short for them.
            ops = list(pickletools.genops(stream))
            for opcode, arg, pos in ops:
                if opcode.proto > LEGACY_PICKLE_PROTOCOL:
                    raise CheckpointError(path, f"its {what} holds pickle opcode {opcode.name} at byte {pos}, newer "
                                                f"than the protocol {LEGACY_PICKLE_PROTOCOL} of legacy checkpoints")
                if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg >= len(ops):
                    raise CheckpointError(path, f"its {what} stores to pickle memo slot {arg} at byte {pos}, "
                                                f"beyond its {len(ops)} opcodes")
            stream.seek(start)
            return unpickler.load()
        except CheckpointError:
            raise
        except Exception as e:  # a damaged pickle fails in many ways (ValueError, UnpicklingError, ...)
            raise CheckpointError(path, f"cannot read its {what} at byte {start} ({type(e).__name__}: {e}); "
                                        f"the file is truncated or is no PyTorch legacy checkpoint") from None

    if load("magic number") != LEGACY_MAGIC:
        raise CheckpointError(path, "it does not start with the magic number of PyTorch's legacy format")
    protocol = load("protocol version")
    if protocol != LEGACY_PROTOCOL:
        raise CheckpointError(path, f"its protocol version is {protocol!r}, expected {LEGACY_PROTOCOL}")
    sys_info = load("sys_info")
    if not (isinstance(sys_info, dict) and sys_info.get("little_endian") is True):
        raise CheckpointError(path, "it was not saved on a little-endian machine (or its sys_info is damaged)")
    state = load("state_dict")
    keys = load("storage key list")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise CheckpointError(path, "its storage key list is no list of strings")

    storages = {}
    pos = stream.tell()
    for key in keys:
        if key not in unpickler.storages:
            raise CheckpointError(path, f"its storage key list names {key!r}, which no tensor uses")
        if key in storages:
            raise CheckpointError(path, f"its storage key list names {key!r} twice")
        numel = unpickler.storages[key].numel
        if pos + 8 > len(data):
            raise CheckpointError(path, f"it is truncated: it ends at byte {len(data)}, inside the element count "
                                        f"of storage {key}")
        count = int.from_bytes(data[pos:pos + 8], "little", signed=True)
        if count != numel:
            raise CheckpointError(path, f"storage {key} holds {count} elements where its tensors say {numel}")
        pos += 8
        if pos + 4 * count > len(data):
            raise CheckpointError(path, f"it is truncated: storage {key} needs bytes {pos}..{pos + 4 * count - 1} "
                                        f"but the file ends at byte {len(data)}")
        storages[key] = np.frombuffer(data, dtype="<f4", count=count, offset=pos)
        pos += 4 * count
    if pos != len(data):
        raise CheckpointError(path, f"it has {len(data) - pos} bytes after its last storage")
    missing = sorted(set(unpickler.storages) - set(storages))
    if missing:
        raise CheckpointError(path, f"the data of storage {missing[0]} is missing")

    if not isinstance(state, dict):
        raise CheckpointError(path, f"it holds a {type(state).__name__} object, not a state_dict (a dict of tensors)")
    for name, ref in state.items():
        check_view(path, name, ref, storages)
    # names and shapes before any array is made, so that a view's claimed size is never allocated
    missing = [n for n in shapes if n not in state]
    extra = [n for n in state if n not in shapes]
    if missing or extra:
        raise CheckpointError(path, f"its state_dict is not the VAE's: missing {missing or 'none'}, "
                                    f"unexpected {extra or 'none'}")
    for name, shape in shapes.items():
        if state[name].size != shape:
            raise CheckpointError(path, f"tensor {name!r} has shape {list(state[name].size)}, expected {list(shape)}")
    tensors = {name: tensor_array(ref, storages) for name, ref in state.items()}
    for name, array in tensors.items():
        if not np.isfinite(array).all():
            raise CheckpointError(path, f"tensor {name!r} holds non-finite values")
    return tensors


def check_view(path, name, ref, storages):
    """Refuses a state_dict entry that is no tensor, or whose view (offset, size, stride) leaves its storage."""
    def is_ints(values):
        return isinstance(values, tuple) and all(type(v) is int and v >= 0 for v in values)

    if not (isinstance(ref, TensorRef) and isinstance(ref.storage, StorageRef)):
        raise CheckpointError(path, f"its entry {name!r} is no tensor")
    if not (type(ref.offset) is int and ref.offset >= 0 and is_ints(ref.size) and is_ints(ref.stride)
            and len(ref.size) == len(ref.stride)):
        raise CheckpointError(path, f"tensor {name!r} has a malformed view: offset {ref.offset!r}, "
                                    f"size {ref.size!r}, stride {ref.stride!r}")
    numel = storages[ref.storage.key].size
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))  # the last element it reaches
    if 0 not in ref.size and last >= numel:
        raise CheckpointError(path, f"tensor {name!r} reaches element {last} of storage {ref.storage.key}, "
                                    f"which holds {numel}")


def tensor_array(ref, storages):
    """A checked view's values, copied into a contiguous float32 array."""
    storage = storages[ref.storage.key]
    # a dimension of one element never steps, so its stride (free in PyTorch, maybe huge) is left out
    strides = [s * storage.itemsize if n > 1 else 0 for n, s in zip(ref.size, ref.stride)]
    view = np.lib.stride_tricks.as_strided(storage[min(ref.offset, storage.size):], shape=ref.size,
                                           strides=strides, writeable=False)
    return view.astype(np.float32)  # a contiguous, writable copy in native order


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
                os.makedirs(download_dir, exist_ok=True)
                print(f"downloading {url}")
                try:
                    with urllib.request.urlopen(url, timeout=60) as r, open(path + ".part", "wb") as f:
                        shutil.copyfileobj(r, f)
                except OSError as e:
                    fail(f"cannot download {url} ({e}). HINT: when offline, copy the files to a "
                         f"folder and run: python3 prepare_weights.py --src FOLDER")
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

@contextlib.contextmanager
def replace_when_complete(path):
    """A file for path's new contents: a temporary beside it, renamed over path only when the block
    completes, so that a failure part way (even sys.exit) leaves the earlier path as it was."""
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "wb") as f:
            yield f
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)


def header(magic, extra):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[0], h[1] = magic, VERSION
    h[2], h[3], h[4] = INPUT_DIM, HIDDEN_DIM, LATENT_DIM
    for i, v in extra.items():
        h[i] = v
    return h


def write_weights(state, path):
    tensors = [state[k].astype("<f4").ravel() for k in TENSOR_ORDER]
    total = sum(t.size for t in tensors)
    h = header(WEIGHTS_MAGIC, {5: DTYPE_FLOAT32, 6: len(tensors), 7: total})
    with replace_when_complete(path) as f:
        f.write(h.tobytes())
        for t in tensors:
            f.write(t.tobytes())
        f.flush()
        # read back and compare bit for bit with the checkpoint before the file takes path's place
        blob = np.fromfile(f.name, dtype="<i4")
        if not np.array_equal(blob[:HEADER_INTS], h):
            fail(f"{path}: header did not read back")
        floats = blob[HEADER_INTS:].view("<f4")
        if floats.size != total:
            fail(f"{path}: wrote {floats.size} floats, expected {total}")
        offset = 0
        for name, t in zip(TENSOR_ORDER, tensors):
            if not np.array_equal(floats[offset:offset + t.size].view("<u4"), t.view("<u4")):
                fail(f"{path}: {name} does not match the checkpoint bit for bit")
            offset += t.size
    print(f"wrote {path}: {len(tensors)} tensors, {total} floats, matches the checkpoint bit for bit")


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
    """The model exactly as it was trained (the PyTorch examples VAE); defined on first use, as it needs torch."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class VAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(784, 400)
            self.fc21 = nn.Linear(400, 20)
            self.fc22 = nn.Linear(400, 20)
            self.fc3 = nn.Linear(20, 400)
            self.fc4 = nn.Linear(400, 784)

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


def torch_models(state):
    """The trained VAE in float32 and in float64, holding the checkpoint's weights (state, from the reader)."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    weights = {name: torch.from_numpy(array) for name, array in state.items()}
    models = []
    for dtype in (torch.float32, torch.float64):
        model = vae_class()().to(dtype)
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
    extra = {5: len(DEBUG_CASES)}
    for c, (b, first) in enumerate(DEBUG_CASES):
        extra[8 + 2 * c], extra[9 + 2 * c] = b, first
    gen = torch.Generator().manual_seed(DEBUG_SEED)
    with replace_when_complete(path) as f:
        f.write(header(DEBUG_MAGIC, extra).tobytes())
        for b, first in DEBUG_CASES:
            pixels = torch.from_numpy(images[first:first + b].reshape(b, -1).astype(np.float64))
            eps32 = torch.randn(b, LATENT_DIM, generator=gen, dtype=torch.float32)
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
    """log p(x) of each row of x from K samples each (eps [N, K, 20]), all terms in full."""
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
    n, k, first = IWAE_CASE
    gen = torch.Generator().manual_seed(DEBUG_SEED + 1)
    eps32 = torch.randn(n, k, LATENT_DIM, generator=gen, dtype=torch.float32)
    pixels = torch.from_numpy(images[first:first + n].reshape(n, -1).astype(np.float64))
    with torch.no_grad():
        ref64 = iwae_log_px(model64, pixels / 255.0, eps32.double())
        ref32 = iwae_log_px(model, pixels.float() / 255.0, eps32)
    with replace_when_complete(path) as f:
        f.write(header(IWAE_MAGIC, {5: n, 6: k, 7: first}).tobytes())
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--src", help="folder holding vae_epoch_25.pth and the t10k .gz files "
                                 "(default: download them)")
    p.add_argument("--out", default="data", help="output folder (default: data)")
    p.add_argument("--only", choices=["inputs", "references"],
                   help="inputs: vae_weights.bin and the two idx files, numpy only; references: "
                        f"{' and '.join(REFERENCE_FILES)}, needs torch (default: both, the references only "
                        "when torch imports)")
    p.add_argument("--reference-loss", action="store_true",
                   help="also print the float64 mean losses over the whole test set (needs torch)")
    args = p.parse_args()

    write_inputs, write_references = args.only != "references", args.only != "inputs"
    # learn whether torch imports before any work, so that a missing torch fails before anything is written
    no_torch = torch_missing() if write_references or args.reference_loss else None
    if no_torch and (args.only == "references" or args.reference_loss):
        what = "--only references" if args.only == "references" else "--reference-loss"
        fail(f"{what} needs torch, which {sys.executable} cannot import ({no_torch}). HINT: {TORCH_HINT}")

    os.makedirs(args.out, exist_ok=True)
    inputs = fetch_inputs(args.src, os.path.join(args.out, "downloads"))
    try:
        state = read_legacy_checkpoint(inputs[CHECKPOINT])
    except CheckpointError as e:
        fail(e)
    raw_images, images = read_idx(inputs["t10k-images-idx3-ubyte.gz"])
    raw_labels, labels = read_idx(inputs["t10k-labels-idx1-ubyte.gz"])
    if images.shape[1:] != (28, 28) or labels.shape[0] != images.shape[0]:
        fail(f"unexpected MNIST shapes: images {images.shape}, labels {labels.shape}")

    if write_inputs:
        write_weights(state, os.path.join(args.out, "vae_weights.bin"))
        write_idx_files(raw_images, raw_labels, args.out, images.shape[0])
    if no_torch:  # only reached without --only, where the references are optional
        print(f"prepare_weights.py: note: skipped {' and '.join(REFERENCE_FILES)}: torch is missing "
              f"({no_torch}), and only 'make test' needs them. HINT: {TORCH_HINT}", file=sys.stderr)
    elif write_references or args.reference_loss:
        model, model64 = torch_models(state)
        if write_references:
            write_debug_state(model, model64, images, os.path.join(args.out, REFERENCE_FILES[0]))
            write_iwae_state(model, model64, images, os.path.join(args.out, REFERENCE_FILES[1]))
        if args.reference_loss:
            reference_loss(model64, images)


if __name__ == "__main__":
    main()
