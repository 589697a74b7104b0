#!/usr/bin/env python3
"""
Prepares everything vae.cu reads, with PyTorch as the reference implementation.

  data/vae_weights.bin           the pretrained weights in vae.cu's binary format
  data/t10k-images-idx3-ubyte    MNIST test images (standard idx3, uncompressed)
  data/t10k-labels-idx1-ubyte    MNIST test labels (standard idx1, uncompressed)
  data/vae_debug_state.bin       reference activations for test_vae.cu
  data/vae_iwae_state.bin        reference importance-weighted log-likelihoods for test_vae.cu

Inputs come from --src DIR (a folder holding vae_epoch_25.pth and the two t10k .gz files)
or, without --src, are downloaded; either way their MD5s are checked.

  python3 prepare_weights.py --src ../shared/data
  python3 prepare_weights.py --reference-loss     # also print full-test-set float64 losses

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
import gzip
import hashlib
import math
import os
import shutil
import sys
import urllib.request

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

INPUT_DIM, HIDDEN_DIM, LATENT_DIM = 784, 400, 20
WEIGHTS_MAGIC, DEBUG_MAGIC, IWAE_MAGIC, VERSION = 0x31454156, 0x44454156, 0x49454156, 1
DTYPE_FLOAT32 = 1
HEADER_INTS = 256
TENSOR_ORDER = ["fc1.weight", "fc1.bias", "fc21.weight", "fc21.bias", "fc22.weight",
                "fc22.bias", "fc3.weight", "fc3.bias", "fc4.weight", "fc4.bias"]
# (batch size, first test image): a batch that is no tile multiple, and a single image
DEBUG_CASES = [(37, 0), (1, 9999)]
DEBUG_SEED = 1234
IWAE_CASE = (4, 37, 0)  # images, samples per image (not a multiple of a warp), first image

# name -> (download URL, MD5 of the file as published)
SOURCES = {
    "vae_epoch_25.pth": (
        "https://github.com/csinva/gan-vae-pretrained-pytorch/raw/master/mnist_vae/weights/vae_epoch_25.pth",
        "170d7720f7d98109540d6ee88d1c6898"),
    "t10k-images-idx3-ubyte.gz": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/t10k-images-idx3-ubyte.gz",
        "9fb629c4189551a2d022fa330f9573f3"),
    "t10k-labels-idx1-ubyte.gz": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/t10k-labels-idx1-ubyte.gz",
        "ec29112dd5afa0611ce80d1b7f02629c"),
}


def fail(msg):
    print(f"prepare_weights.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


class VAE(nn.Module):
    """The model exactly as it was trained (the PyTorch examples VAE)."""

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
            fail(f"{path} has MD5 {got}, expected {want}: the file is corrupt or not the "
                 f"published one. HINT: delete it and run again")
        paths[name] = path
    return paths


def load_model(path):
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except TypeError:  # torch older than 1.13 has no weights_only
        state = torch.load(path, map_location="cpu")
    model = VAE()
    model.load_state_dict(state)
    return model.eval()


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

def header(magic, extra):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[0], h[1] = magic, VERSION
    h[2], h[3], h[4] = INPUT_DIM, HIDDEN_DIM, LATENT_DIM
    for i, v in extra.items():
        h[i] = v
    return h


def write_weights(model, path):
    state = model.state_dict()
    tensors = [state[k].detach().cpu().numpy().astype("<f4").ravel() for k in TENSOR_ORDER]
    total = sum(t.size for t in tensors)
    h = header(WEIGHTS_MAGIC, {5: DTYPE_FLOAT32, 6: len(tensors), 7: total})
    with open(path, "wb") as f:
        f.write(h.tobytes())
        for t in tensors:
            f.write(t.tobytes())
    # reload and compare bit for bit with the checkpoint
    blob = np.fromfile(path, dtype="<i4")
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


def forward(model, x, eps):
    """Every activation of one forward pass plus per-image BCE and KL."""
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


def write_debug_state(model, images, path):
    extra = {5: len(DEBUG_CASES)}
    for c, (b, first) in enumerate(DEBUG_CASES):
        extra[8 + 2 * c], extra[9 + 2 * c] = b, first
    gen = torch.Generator().manual_seed(DEBUG_SEED)
    model64 = VAE().double()
    model64.load_state_dict(model.state_dict())
    with open(path, "wb") as f:
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


def write_iwae_state(model, images, path):
    n, k, first = IWAE_CASE
    gen = torch.Generator().manual_seed(DEBUG_SEED + 1)
    eps32 = torch.randn(n, k, LATENT_DIM, generator=gen, dtype=torch.float32)
    model64 = VAE().double()
    model64.load_state_dict(model.state_dict())
    pixels = torch.from_numpy(images[first:first + n].reshape(n, -1).astype(np.float64))
    with torch.no_grad():
        ref64 = iwae_log_px(model64, pixels / 255.0, eps32.double())
        ref32 = iwae_log_px(model, pixels.float() / 255.0, eps32)
    with open(path, "wb") as f:
        f.write(header(IWAE_MAGIC, {5: n, 6: k, 7: first}).tobytes())
        f.write(eps32.numpy().astype("<f4").tobytes())
        f.write(ref64.numpy().astype("<f8").tobytes())
        f.write(ref32.numpy().astype("<f4").tobytes())
    print(f"wrote {path}: log p(x) of images {first}..{first + n - 1}, K = {k}: "
          + " ".join(f"{v:.4f}" for v in ref64.tolist()))


def reference_loss(model, images):
    """Full-test-set float64 losses with z = mu, and with eps drawn by PyTorch."""
    model64 = VAE().double()
    model64.load_state_dict(model.state_dict())
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", help="folder holding vae_epoch_25.pth and the t10k .gz files "
                                 "(default: download them)")
    p.add_argument("--out", default="data", help="output folder (default: data)")
    p.add_argument("--reference-loss", action="store_true",
                   help="also print the float64 mean losses over the whole test set")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    os.makedirs(args.out, exist_ok=True)
    inputs = fetch_inputs(args.src, os.path.join(args.out, "downloads"))
    model = load_model(inputs["vae_epoch_25.pth"])
    write_weights(model, os.path.join(args.out, "vae_weights.bin"))

    raw_images, images = read_idx(inputs["t10k-images-idx3-ubyte.gz"])
    raw_labels, labels = read_idx(inputs["t10k-labels-idx1-ubyte.gz"])
    if images.shape[1:] != (28, 28) or labels.shape[0] != images.shape[0]:
        fail(f"unexpected MNIST shapes: images {images.shape}, labels {labels.shape}")
    for name, raw in (("t10k-images-idx3-ubyte", raw_images), ("t10k-labels-idx1-ubyte", raw_labels)):
        with open(os.path.join(args.out, name), "wb") as f:
            f.write(raw)
    print(f"wrote {args.out}/t10k-images-idx3-ubyte, {args.out}/t10k-labels-idx1-ubyte: "
          f"{images.shape[0]} images")

    write_debug_state(model, images, os.path.join(args.out, "vae_debug_state.bin"))
    write_iwae_state(model, images, os.path.join(args.out, "vae_iwae_state.bin"))
    if args.reference_loss:
        reference_loss(model, images)


if __name__ == "__main__":
    main()
