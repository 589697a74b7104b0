#!/usr/bin/env python3
"""
AIS in PyTorch, written from the maths of ./vae --ais (not from vae.cu's kernels): the reference
its trajectories are checked against.

  python3 dev/ais_pytorch.py --check CSV [--precision fp32]   float64 AIS with vae.cu's noise against
                                                              ./vae --ais 5 --chains 4 --leapfrog 3 -n 8 --csv CSV
                                                              (test_vae runs this check)
  python3 dev/ais_pytorch.py -w data/family/vae_784_512_2_512.bin --check CSV    the same for another size
                                                              (CSV from ./vae -w that file)

PyTorch's time for ./vae --ais's run is dev/bench_pytorch.py --ais T (every mode, the whole test set
at once).

The noise is injected, not drawn by PyTorch: a Python Philox4x32-10 and Box-Muller (numpy, vectorised) give
the start eps (seed, image, chain, latent), the momenta (seed, image, chain, 16 t + latent pair) and the
Metropolis uniforms (seed, image, chain, t) that vae.cu's counter-based generator gives, so both
run the same chains: in fp32 every Metropolis decision must come out the same (the per-image acceptance)
and the per-image log p(x) agree to float32 rounding (1e-5 relative). The model's size (H1, Z, H3) comes
from the weights file's header, and the noise is keyed for any Z: latent j of a start (as of any posterior
or prior draw) is word j % 4 of the Philox call of counter j / 4 (vae.cu's gaussian()), and momentum
coordinates 2i and 2i + 1 come from one call of counter MOMENTUM_STRIDE t + i, Box-Muller of its first two
words; for odd Z the last pair's second draw goes unused. MOMENTUM_STRIDE is 16 while the pairs fit (Z <= 32,
the keys of Z = 20 as they were), and the next multiple of 16 above Z / 2 beyond, so no two transitions share
a counter.
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
from bench_pytorch import load_images, load_weights, model_dims  # noqa: E402

M32 = 0xFFFFFFFF
STREAM_POSTERIOR, STREAM_PRIOR, STREAM_MOMENTUM, STREAM_ACCEPT, STREAM_SIMULATE = 0, 1, 2, 3, 4  # vae.cu's streams
U64 = np.uint64


def philox(counter, seed):
    """vae.cu's philox4x32 (Philox4x32-10) of the counters (c0, c1, c2, c3), each an int or an array of them,
    broadcast together, under a 64-bit seed: four uint64 arrays of 32-bit words."""
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=U64) for c in counter))
    k0, k1, mask, s32 = U64(seed & M32), U64(seed >> 32), U64(M32), U64(32)
    for _ in range(10):
        p0, p1 = U64(0xD2511F53) * c0, U64(0xCD9E8D57) * c2  # 32 x 32 bits: exact in 64
        c0, c1, c2, c3 = (p1 >> s32) ^ c1 ^ k0, p1 & mask, (p0 >> s32) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + U64(0x9E3779B9)) & mask, (k1 + U64(0xBB67AE85)) & mask
    return c0, c1, c2, c3


def box_muller(w1, w2):
    """Two N(0, 1) arrays from two arrays of 32-bit words, in float64 (vae.cu's box_muller, in float32)."""
    u1, u2 = ((w1 >> U64(8)) + U64(1)) / 16777216.0, (w2 >> U64(8)) / 16777216.0
    r = np.sqrt(-2.0 * np.log(u1))
    return r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)


def uniform_open0(seed, stream, image, chain, counter):
    """vae.cu's uniform_open0, in (0, 1], as float32."""
    return (((philox((counter, image, chain, stream), seed)[0] >> U64(8)) + U64(1)) / 16777216.0).astype(np.float32)


def gaussians(seed, stream, image, sample, z):
    """vae.cu's gaussian(seed, stream, image, sample, j) for j = 0 .. z - 1, as float32: latents 4q .. 4q + 3 are
    the four Box-Muller draws of one Philox call of counter (q, image, sample, stream). image and sample (ints
    or arrays) broadcast together; the latents are the last axis."""
    q = np.arange((z + 3) // 4, dtype=U64)
    r = philox((q, np.asarray(image, dtype=U64)[..., None], np.asarray(sample, dtype=U64)[..., None], stream), seed)
    g = np.stack([*box_muller(r[0], r[1]), *box_muller(r[2], r[3])], -1)  # [..., group, 4]
    return g.reshape(*g.shape[:-2], -1)[..., :z].astype(np.float32)


def momentum_stride(z):
    """Counters per transition of the momentum draws: 16 while Z / 2 pairs fit, else the next multiple of 16."""
    return 16 * max(1, -(-((z + 1) // 2) // 16))


def momenta(seed, image, chain, t, z):
    """Transition t's momentum, float32 [..., z]: pair i from Box-Muller of the first two words of the Philox
    call of counter (momentum_stride(z) t + i, image, chain, STREAM_MOMENTUM)."""
    pairs = momentum_stride(z) * t + np.arange((z + 1) // 2, dtype=U64)
    r = philox((pairs, np.asarray(image, dtype=U64)[..., None], np.asarray(chain, dtype=U64)[..., None],
                STREAM_MOMENTUM), seed)
    g = np.stack(box_muller(r[0], r[1]), -1)  # [..., pair, 2]
    return g.reshape(*g.shape[:-2], -1)[..., :z].astype(np.float32)


class KeyedNoise:
    """vae.cu's AIS noise for n images (the generator's image indices first_image ..) of C chains and Z latents,
    as float64 tensors on device, [n, C, Z] or [n, C]; each value is the float32 that vae.cu draws."""

    def __init__(self, seed, n, C, Z, device="cpu", first_image=0):
        self.seed, self.Z, self.device = seed, Z, device
        self.image = (first_image + np.arange(n, dtype=U64))[:, None]
        self.chain = np.arange(C, dtype=U64)[None, :]

    def tensor(self, values):
        return torch.from_numpy(values).to(self.device, torch.float64)

    def start(self):  # a chain's start eps: chain c as sample c of the posterior stream
        return self.tensor(gaussians(self.seed, STREAM_POSTERIOR, self.image, self.chain, self.Z))

    def momentum(self, t):
        return self.tensor(momenta(self.seed, self.image, self.chain, t, self.Z))

    def uniform(self, t):
        return self.tensor(uniform_open0(self.seed, STREAM_ACCEPT, self.image, self.chain, t))


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


def ais(model, x, T, C, L, noise, z_start=None):
    """log p(x) and the acceptance rate per image in float64, with vae.cu's keyed noise (a KeyedNoise). With z_start
    ([n, Z]), BDMC's reverse run: every chain starts there and the schedule runs from b_T to b_0, and the estimate
    is then an upper bound of log p(x)."""
    n, dev, reverse = x.shape[0], x.device, z_start is not None
    with torch.no_grad():
        h1 = F.relu(model.fc1(x))
        mu, logvar = model.fc21(h1).double(), model.fc22(h1).double()
    xs = x[:, None, :]
    mu, logvar = mu[:, None, :], logvar[:, None, :]
    inv_var = torch.exp(-logvar)
    if z_start is None:
        z = mu + torch.exp(0.5 * logvar) * noise.start()
    else:
        z = z_start.double()[:, None, :].repeat(1, C, 1)
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
        at = T + 1 - t if reverse else t  # the weight's step of the schedule
        log_w += (beta[at - 1] - beta[at] if reverse else beta[at] - beta[at - 1]) * (lpxz - lp0)
        if t == T:
            break
        b = beta[T - t] if reverse else beta[t]
        p = noise.momentum(t)
        h0 = -b * lpxz - (1 - b) * lp0 + 0.5 * (p * p).sum(-1)
        z0, g0, bce0 = z, g, bce
        p = p - 0.5 * step * grad_u(z, g, b)
        for step_index in range(1, L + 1):
            z = z + step * p
            bce, g = bce_and_grad(model, xs, z)
            p = p - (1.0 if step_index < L else 0.5) * step * grad_u(z, g, b)
        lpxz, lp0 = densities(z, bce)
        h1 = -b * lpxz - (1 - b) * lp0 + 0.5 * (p * p).sum(-1)
        u = noise.uniform(t)
        accept = torch.log(u) < h0 - h1
        taken += accept.double().sum(1)
        z = torch.where(accept[..., None], z, z0)
        g = torch.where(accept[..., None], g, g0)
        bce = torch.where(accept, bce, bce0)
        rate = accept.double().mean(1)[:, None, None]
        step = torch.clamp(step * torch.where(rate > 0.65, 1.02, 0.98), 1e-4, 0.5)
    estimate = torch.logsumexp(log_w, 1) - math.log(C)
    return -estimate if reverse else estimate, taken / (C * max(T - 1, 1))


def check(args):
    model = load_weights(args.weights).double()
    images = load_images("data/t10k-images-idx3-ubyte")
    rows = [line.split(",") for line in open(args.check) if line[0].isdigit()]
    n, T, C, L, seed = len(rows), args.transitions, args.chains, args.leapfrog, args.seed
    if n == 0:
        print(f"FAIL: {args.check} holds no rows of per-image results")
        return 1
    x = images[:n].double() / 255.0
    ref, ref_acceptance = ais(model, x, T, C, L, KeyedNoise(seed, n, C, model_dims(model).z))
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
    p.add_argument("-w", "--weights", metavar="FILE", default="data/vae_weights.bin",
                   help="the weights file ./vae ran with: any size of the family (default data/vae_weights.bin)")
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
