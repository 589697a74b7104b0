#!/usr/bin/env python3
"""
Times the same model and loss in PyTorch, the way ./vae --bench times vae.cu: one whole
forward+loss (uint8 pixels in, per-image BCE and KL out, z sampled) per timing, CUDA events
around each call, 20 warm-up calls, median of 200.

  python3 dev/bench_pytorch.py                       PyTorch table
  python3 dev/bench_pytorch.py --vae-bench LOG       also the ratio to ./vae --bench's table in LOG
  python3 dev/bench_pytorch.py --iwae 5000           IWAE log-likelihood of the test set instead

Modes: eager fp32, eager bf16 (autocast), CUDA graph fp32, CUDA graph bf16 (model in bf16),
and eager fp32 on the host CPU with all cores (timed with a wall clock, median of 10).
Reads data/vae_weights.bin and data/t10k-images-idx3-ubyte (make data writes them).
"""
import argparse
import os
import re
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCHES = [1024, 2048, 4096, 10000]
FLOPS_PER_IMAGE = 2 * (784 * 400 + 400 * 40 + 20 * 400 + 400 * 784)


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)


def load_weights(path):
    blob = np.fromfile(path, dtype="<i4")
    if blob.size < 256 or blob[0] != 0x31454156:
        sys.exit(f"{path}: not a vae.cu weights file. HINT: make data")
    floats = blob[256:].view("<f4")
    model, offset = VAE(), 0
    for name in ["fc1", "fc21", "fc22", "fc3", "fc4"]:
        layer = getattr(model, name)
        for p in (layer.weight, layer.bias):
            p.data.copy_(torch.from_numpy(floats[offset:offset + p.numel()].copy()).view_as(p))
            offset += p.numel()
    return model


def load_images(path):
    raw = np.fromfile(path, dtype=np.uint8)
    return torch.from_numpy(raw[16:].reshape(-1, 784).copy())


def forward_loss(model, pixels, dtype):
    """Per-image BCE and KL, exactly as vae.cu computes them."""
    x = pixels.to(dtype) / 255.0
    h1 = F.relu(model.fc1(x))
    mu, logvar = model.fc21(h1), model.fc22(h1)
    z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
    logits = model.fc4(F.relu(model.fc3(z)))
    bce = F.binary_cross_entropy_with_logits(logits.float(), x.float(), reduction="none").sum(1)
    kl = -0.5 * (1 + logvar.float() - mu.float().pow(2) - logvar.float().exp()).sum(1)
    return bce, kl


def iwae_log_px(model, pixels, k, chunk, dtype):
    """log p(x) of each image from k importance samples, chunk images at a time; Gaussian terms
    with their -1/2 log(2 pi), log p(x|z) = -BCE from the logits."""
    out = []
    half_log_2pi = 0.5 * np.log(2 * np.pi)
    for first in range(0, len(pixels), chunk):
        x = pixels[first:first + chunk].to(dtype) / 255.0
        h1 = F.relu(model.fc1(x))
        mu, logvar = model.fc21(h1).float(), model.fc22(h1).float()
        eps = torch.randn(x.shape[0], k, mu.shape[1], device=x.device)
        z = mu[:, None, :] + eps * torch.exp(0.5 * logvar)[:, None, :]
        logits = model.fc4(F.relu(model.fc3(z.to(dtype)))).float()
        bce = F.binary_cross_entropy_with_logits(logits, x.float()[:, None, :].expand_as(logits),
                                                 reduction="none").sum(2)
        log_pz = (-0.5 * z.pow(2) - half_log_2pi).sum(2)
        log_qz = (-0.5 * eps.pow(2) - 0.5 * logvar[:, None, :] - half_log_2pi).sum(2)
        out.append(torch.logsumexp(-bce + log_pz - log_qz, dim=1) - np.log(k))
    return torch.cat(out)


def run_iwae(model, images, k, n, chunk=16):
    """Times one whole IWAE evaluation per mode (CUDA events, after one warm-up chunk)."""
    m32 = model.cuda()
    pixels = images[:n].cuda()
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: IWAE, K = {k}, {n} images, "
          f"chunks of {chunk} images")
    print("| PyTorch mode | images | K | time ms | mean NLL | decoder passes/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, dtype in (("eager fp32", None), ("eager bf16 autocast", torch.bfloat16)):
        def evaluate(px):
            if dtype is None:
                return iwae_log_px(m32, px, k, chunk, torch.float32)
            with torch.autocast("cuda", dtype=dtype):
                return iwae_log_px(m32, px, k, chunk, torch.float32)
        with torch.no_grad():
            evaluate(pixels[:chunk])
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            log_px = evaluate(pixels)
            stop.record()
            torch.cuda.synchronize()
        ms = start.elapsed_time(stop)
        print(f"| {mode} | {n} | {k} | {ms:.1f} | {-log_px.double().mean():.4f} | {n * k / (ms * 1e-3):.3g} |")


def time_cuda(fn, warmup=20, reps=200):
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        stops[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, stops))


def time_cpu(fn, warmup=2, reps=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graphed(fn):
    """Captures fn once as a CUDA graph; returns a replay function."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def parse_vae_bench(path):
    """{(precision, batch): us} from ./vae --bench output."""
    rows = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"\|\s*(fp32|bf16)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|", line)
            if m:
                rows[(m.group(1), int(m.group(2)))] = float(m.group(3))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data", help="folder with vae_weights.bin and the test images")
    p.add_argument("--vae-bench", help="output of ./vae --bench, to print the ratio per batch")
    p.add_argument("--no-cpu", action="store_true", help="skip the host CPU timing")
    p.add_argument("--iwae", type=int, metavar="K", help="time the IWAE log-likelihood with K samples instead")
    p.add_argument("-n", type=int, default=10000, help="images for --iwae (default 10000)")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = load_weights(os.path.join(args.data, "vae_weights.bin")).eval()
    images = load_images(os.path.join(args.data, "t10k-images-idx3-ubyte"))
    if args.iwae:
        if not torch.cuda.is_available():
            sys.exit("--iwae needs a CUDA device")
        run_iwae(model, images, args.iwae, args.n)
        return

    results = {}  # (mode, batch) -> us
    gpu = torch.cuda.is_available()
    if gpu:
        print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}")
        m32 = model.cuda()
        m16 = VAE().cuda().to(torch.bfloat16)
        m16.load_state_dict(model.state_dict())
        with torch.no_grad():
            for b in BATCHES:
                pixels = images[:b].cuda()
                results[("eager fp32", b)] = time_cuda(lambda: forward_loss(m32, pixels, torch.float32))

                def autocast_bf16():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        return forward_loss(m32, pixels, torch.float32)
                results[("eager bf16 autocast", b)] = time_cuda(autocast_bf16)
                results[("graph fp32", b)] = time_cuda(graphed(lambda: forward_loss(m32, pixels, torch.float32)))
                results[("graph bf16", b)] = time_cuda(graphed(lambda: forward_loss(m16, pixels, torch.bfloat16)))
    if not args.no_cpu:
        torch.set_num_threads(os.cpu_count())
        cpu_model = load_weights(os.path.join(args.data, "vae_weights.bin")).eval()
        with torch.no_grad():
            for b in BATCHES:
                pixels = images[:b]
                results[(f"CPU eager fp32 ({os.cpu_count()} cores)", b)] = time_cpu(
                    lambda: forward_loss(cpu_model, pixels, torch.float32))

    print("| PyTorch mode | batch | us/batch | images/s | TFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    for (mode, b), us in results.items():
        print(f"| {mode} | {b} | {us:.1f} | {b / (us * 1e-6):.3g} | {FLOPS_PER_IMAGE * b / (us * 1e6):.2f} |")

    if args.vae_bench and gpu:
        ours = parse_vae_bench(args.vae_bench)
        print("\n| batch | vae.cu fp32 us | vae.cu bf16 us | PyTorch eager fp32 us | PyTorch graph bf16 us "
              "| eager fp32 / vae.cu fp32 | graph bf16 / vae.cu bf16 |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for b in BATCHES:
            if ("fp32", b) not in ours or ("bf16", b) not in ours:
                continue
            e32, g16 = results[("eager fp32", b)], results[("graph bf16", b)]
            print(f"| {b} | {ours[('fp32', b)]:.1f} | {ours[('bf16', b)]:.1f} | {e32:.1f} | {g16:.1f} "
                  f"| {e32 / ours[('fp32', b)]:.1f}x | {g16 / ours[('bf16', b)]:.1f}x |")


if __name__ == "__main__":
    main()
