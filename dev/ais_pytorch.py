#!/usr/bin/env python3
"""
AIS in PyTorch, written from the maths of ./vae --ais (not from vae.cu's kernels): the reference
its trajectories are checked against.

  python3 dev/ais_pytorch.py --check CSV [--precision fp32]   float64 AIS with vae.cu's noise against
                                                              ./vae --ais 5 --chains 4 --leapfrog 3 -n 8 --csv CSV
                                                              (test_vae runs this check)

PyTorch's time for ./vae --ais's run is dev/bench_pytorch.py --ais T (every mode, the whole test set
at once).

The noise is injected, not drawn by PyTorch: a Python Philox4x32-10 and Box-Muller give the start
eps (seed, image, chain, latent), the momenta (seed, image, chain, 16 t + latent pair) and the
Metropolis uniforms (seed, image, chain, t) that vae.cu's counter-based generator gives, so both
run the same chains: in fp32 every Metropolis decision must come out the same (the per-image acceptance)
and the per-image log p(x) agree to float32 rounding (1e-5 relative).
The schedule (sigmoid, delta = 4), the step-size rule (x1.02 / x0.98 toward acceptance 0.65,
clamped to [1e-4, 0.5], start 0.05) and the weights are the issue's definitions.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pytorch import load_images, load_weights  # noqa: E402

M32 = 0xFFFFFFFF
STREAM_POSTERIOR, STREAM_MOMENTUM, STREAM_ACCEPT = 0, 2, 3


def philox(counter, seed):
    c0, c1, c2, c3 = counter
    k0, k1 = seed & M32, (seed >> 32) & M32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def box_muller(w1, w2):
    u1, u2 = ((w1 >> 8) + 1) / 16777216.0, (w2 >> 8) / 16777216.0
    r = math.sqrt(-2.0 * math.log(u1))
    return r * math.cos(2 * math.pi * u2), r * math.sin(2 * math.pi * u2)


def start_eps(seed, image, chain):
    out = []
    for group in range(5):
        r = philox((group, image, chain, STREAM_POSTERIOR), seed)
        out += [*box_muller(r[0], r[1]), *box_muller(r[2], r[3])]
    return out


def momentum(seed, image, chain, t):
    out = []
    for pair in range(10):
        r = philox((16 * t + pair, image, chain, STREAM_MOMENTUM), seed)
        out += box_muller(r[0], r[1])
    return out


def uniform(seed, image, chain, t):
    return ((philox((t, image, chain, STREAM_ACCEPT), seed)[0] >> 8) + 1) / 16777216.0


def schedule(T):
    s = [1 / (1 + math.exp(-4 * (2 * t / T - 1))) for t in range(T + 1)]
    return [0.0] + [(v - s[0]) / (s[-1] - s[0]) for v in s[1:-1]] + [1.0]


def bce_and_grad(model, x, z):
    """BCE(x, logits(z)) per chain and its gradient w.r.t. z, by autograd (float64)."""
    z = z.detach().requires_grad_(True)
    logits = model.fc4(F.relu(model.fc3(z)))
    bce = F.binary_cross_entropy_with_logits(logits, x.expand_as(logits), reduction="none").sum(-1)
    (grad,) = torch.autograd.grad(bce.sum(), z)
    return bce.detach().double(), grad.double()


def ais(model, x, T, C, L, noise):
    """log p(x) and the acceptance rate per image in float64, with vae.cu's keyed noise (start, momentum,
    uniform)."""
    n, dev = x.shape[0], x.device
    with torch.no_grad():
        h1 = F.relu(model.fc1(x))
        mu, logvar = model.fc21(h1).double(), model.fc22(h1).double()
    xs = x[:, None, :]
    mu, logvar = mu[:, None, :], logvar[:, None, :]
    inv_var = torch.exp(-logvar)
    eps = noise["start"]
    z = mu + torch.exp(0.5 * logvar) * eps
    beta = schedule(T)
    step = torch.full((n, 1, 1), 0.05, device=dev, dtype=torch.float64)

    def densities(z, bce):
        lpxz = -bce - 0.5 * (z * z).sum(-1)
        lp0 = -0.5 * (((z - mu) ** 2 * inv_var).sum(-1) + logvar.sum(-1))
        return lpxz, lp0

    def grad_u(z, g, b):
        return b * (g + z) + (1 - b) * (z - mu) * inv_var

    bce, g = bce_and_grad(model, xs, z)
    log_w = torch.zeros(n, C, device=dev, dtype=torch.float64)
    taken = torch.zeros(n, device=dev, dtype=torch.float64)
    for t in range(1, T + 1):
        lpxz, lp0 = densities(z, bce)
        log_w += (beta[t] - beta[t - 1]) * (lpxz - lp0)
        if t == T:
            break
        b = beta[t]
        p = noise["momentum"][t]
        h0 = -b * lpxz - (1 - b) * lp0 + 0.5 * (p * p).sum(-1)
        z0, g0, bce0 = z, g, bce
        p = p - 0.5 * step * grad_u(z, g, b)
        for step_index in range(1, L + 1):
            z = z + step * p
            bce, g = bce_and_grad(model, xs, z)
            p = p - (1.0 if step_index < L else 0.5) * step * grad_u(z, g, b)
        lpxz, lp0 = densities(z, bce)
        h1 = -b * lpxz - (1 - b) * lp0 + 0.5 * (p * p).sum(-1)
        u = noise["uniform"][t]
        accept = torch.log(u) < h0 - h1
        taken += accept.double().sum(1)
        z = torch.where(accept[..., None], z, z0)
        g = torch.where(accept[..., None], g, g0)
        bce = torch.where(accept, bce, bce0)
        rate = accept.double().mean(1)[:, None, None]
        step = torch.clamp(step * torch.where(rate > 0.65, 1.02, 0.98), 1e-4, 0.5)
    return torch.logsumexp(log_w, 1) - math.log(C), taken / (C * max(T - 1, 1))


def check(args):
    model = load_weights("data/vae_weights.bin").double()
    images = load_images("data/t10k-images-idx3-ubyte")
    rows = [line.split(",") for line in open(args.check) if line[0].isdigit()]
    n, T, C, L, seed = len(rows), args.transitions, args.chains, args.leapfrog, args.seed
    if n == 0:
        print(f"FAIL: {args.check} holds no rows of per-image results")
        return 1
    x = images[:n].double() / 255.0
    f32 = lambda v: float(np.float32(v))  # noqa: E731  vae.cu draws in float32
    noise = {"start": torch.tensor([[[f32(e) for e in start_eps(seed, i, c)] for c in range(C)] for i in range(n)]),
             "momentum": {t: torch.tensor([[[f32(e) for e in momentum(seed, i, c, t)] for c in range(C)]
                                           for i in range(n)]) for t in range(1, T)},
             "uniform": {t: torch.tensor([[f32(uniform(seed, i, c, t)) for c in range(C)] for i in range(n)],
                                         dtype=torch.float64) for t in range(1, T)}}
    ref, ref_acceptance = ais(model, x, T, C, L, noise)
    worst, decisions_differ = 0.0, 0
    for i, row in enumerate(rows):
        got, acceptance = float(row[2]), float(row[4])
        d = abs(got - ref[i].item()) / abs(ref[i].item())
        worst = max(worst, d) if math.isfinite(d) else math.inf  # max() would skip a NaN
        decisions_differ += not abs(acceptance - ref_acceptance[i].item()) <= 1e-6
        print(f"image {i}: vae.cu {got:.6f} (acceptance {acceptance:.4f})  PyTorch float64 {ref[i].item():.6f} "
              f"({ref_acceptance[i].item():.4f})")
    # fp32: the same Metropolis decisions and float32 rounding of the weights; bf16's energies are ~0.1 nat
    # off, so a decision near its threshold may go the other way: the estimate only at bf16's tolerance
    tol = 1e-5 if args.precision == "fp32" else 2e-2
    ok = worst <= tol and (decisions_differ == 0 or args.precision != "fp32")
    print(f"{'ok' if ok else 'FAIL'}: AIS T = {T}, C = {C}, L = {L}, {n} images, the same noise: max relative "
          f"difference {worst:.2e} (tolerance {tol:.0e}, {args.precision}); acceptance differs on {decisions_differ} "
          f"images")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--check", metavar="CSV", help="./vae --ais --csv output to check")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--transitions", type=int, default=5, help="T (default 5)")
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--leapfrog", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not args.check:
        p.error("pass --check CSV")
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
