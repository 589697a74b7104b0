#!/usr/bin/env python3
"""
Your own VAE, start to end, beside PyTorch float64: a VAE of another size of the family, made and saved as a
user would, converted, and evaluated by ./vae in every likelihood mode, each number next to PyTorch's.

  python3 dev/own_vae.py                                  784-512-2-512: ELBO, --iwae 1000, --ais 100, --bdmc 100
  python3 dev/own_vae.py --dims 300,10,500 -n 200         another size, fewer images
  python3 dev/own_vae.py --iwae 5000 --ais 1000 --bdmc 1000 --bdmc-ais 100 --out /tmp/own

The steps, in a fresh folder (--out, default a temporary one):
  1. the model: prepare_weights.py's train_family_vae (what make family trains: torch.manual_seed(0), one epoch
     of Adam on the MNIST test images, on the CPU), saved by torch.save(model.state_dict(), NAME.pth): zip format
  2. python3 prepare_weights.py --checkpoint NAME.pth --out NAME.bin (numpy only, as a user runs it)
  3. ./vae -w NAME.bin on the first N test images (-n, default 1000): the ELBO with --zmu and sampled, --iwae K,
     --ais T (--csv for each), and --bdmc B --ais T_B on B simulated images
  4. the same quantities in PyTorch float64 (CUDA when there is a GPU) from the weights file, with vae.cu's noise
     injected (dev/ais_pytorch.py's Philox: the ELBO's and IWAE's eps, AIS's starts, momenta and uniforms, BDMC's
     simulated z and pixels), so that each pair differs by float32 rounding, not by sampling: ~1e-5 relative.
     An AIS or BDMC chain whose Metropolis test sits within rounding of its threshold may go the other way in
     float32; the table says on how many images the acceptance differs, and gives the difference in standard
     errors over images as well, which is what it would be measured in without the injected noise.
Then one table: quantity | vae.cu | PyTorch float64 | difference. Exit status 1 if ./vae or a step fails.
"""
import argparse
import csv
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import prepare_weights as pw  # noqa: E402
from ais_pytorch import (STREAM_POSTERIOR, STREAM_SIMULATE, KeyedNoise, ais, gaussians,  # noqa: E402
                         uniform_open0)
from bench_pytorch import load_images, load_weights  # noqa: E402

CHAINS, LEAPFROG = 16, 10  # ./vae --ais's defaults
IWAE_CHUNK_ROWS = 1 << 18  # decoder rows per PyTorch float64 IWAE chunk


def fail(msg):
    print(f"own_vae.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


def run(cmd):
    """Runs cmd, echoing it and its standard output; stops on failure with its error output."""
    print("$ " + " ".join(cmd), flush=True)
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        print("  " + line)
    print(f"  ({time.time() - start:.1f} s)", flush=True)
    if proc.returncode != 0:
        sys.stdout.flush()
        fail(f"{cmd[0]} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def read_csv(path):
    """{column: float64 array} of ./vae --csv's per-image rows (after its '#' line)."""
    with open(path) as f:
        rows = [line for line in f if not line.startswith("#")]
    table = list(csv.DictReader(rows))
    return {name: np.array([float(r[name]) for r in table]) for name in table[0]}


def printed(text, label):
    """The number after label at the start of a line of ./vae's output."""
    m = re.search(rf"^{re.escape(label)}\s+(-?[0-9.]+)", text, re.MULTILINE)
    if m is None:
        fail(f"./vae printed no '{label}' line")
    return float(m.group(1))


def standard_error(values):
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan


def iwae_float64(model, x, K, seed, dims):
    """log p(x) per image with K samples, eps as vae.cu draws them: (seed, image, sample k)."""
    out = []
    per_chunk = max(1, IWAE_CHUNK_ROWS // K)
    for first in range(0, len(x), per_chunk):
        images = np.arange(first, min(first + per_chunk, len(x)))
        eps = gaussians(seed, STREAM_POSTERIOR, images[:, None], np.arange(K)[None, :], dims.z)
        with torch.no_grad():
            out.append(pw.iwae_log_px(model, x[images], torch.from_numpy(eps).to(x.device, torch.float64)))
    return torch.cat(out).cpu().numpy()


def simulate(model, n, seed, dims, device):
    """BDMC's n images as vae.cu simulates them: z ~ N(0, I) keyed (seed, STREAM_SIMULATE, image, 0), pixel k of
    image i 255 where uniform (seed, STREAM_SIMULATE, i, 1, k) <= sigmoid(logit), else 0. Returns z (float32
    values), x in [0, 1] and how many pixels lie within 1e-6 of their threshold (vae.cu decides those in fp32)."""
    z = torch.from_numpy(gaussians(seed, STREAM_SIMULATE, np.arange(n), 0, dims.z)).to(device, torch.float64)
    with torch.no_grad():
        recon = torch.sigmoid(model.fc4(F.relu(model.fc3(z)))).cpu().numpy()
    u = uniform_open0(seed, STREAM_SIMULATE, np.arange(n)[:, None], 1, np.arange(pw.INPUT_DIM)[None, :])
    x = (u <= recon).astype(np.float64)
    return z, torch.from_numpy(x).to(device), int((np.abs(u - recon) < 1e-6).sum())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--dims", default="512,2,512", help="H1,Z,H3 of the model (default 512,2,512)")
    p.add_argument("-n", "--count", type=int, default=1000, help="test images for every mode but BDMC (default 1000)")
    p.add_argument("--iwae", type=int, default=1000, metavar="K", help="IWAE's samples per image (default 1000)")
    p.add_argument("--ais", type=int, default=100, metavar="T", help="AIS's distributions (default 100)")
    p.add_argument("--bdmc", type=int, default=100, metavar="B", help="BDMC's simulated images (default 100)")
    p.add_argument("--bdmc-ais", type=int, default=100, metavar="T", help="BDMC's AIS distributions (default 100)")
    p.add_argument("--seed", type=int, default=0, help="./vae's seed, -s (default 0)")
    p.add_argument("--vae", default=os.path.join(ROOT, "vae"), help="the program (default ./vae)")
    p.add_argument("--out", help="folder for the checkpoint, the weights file and the CSVs (default: a temporary "
                                 "one, removed at the end)")
    args = p.parse_args()
    try:
        dims = pw.Dims(*(int(v) for v in args.dims.split(",")))
    except (TypeError, ValueError):
        p.error(f"--dims {args.dims}: expected H1,Z,H3, e.g. 512,2,512")
    for name, value in zip(("H1", "Z", "H3"), dims):
        low, high = pw.SIZE_BOUNDS[name]
        if not low <= value <= high:
            p.error(f"--dims: {name} = {value} is outside {low}..{high}")
    if not os.access(args.vae, os.X_OK):
        fail(f"{args.vae} is not built. HINT: make vae")
    images_path = os.path.join(ROOT, "data", "t10k-images-idx3-ubyte")
    if not os.path.isfile(images_path):
        fail(f"{images_path} not found. HINT: make data")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        folder = args.out
    else:
        tmp = tempfile.TemporaryDirectory(prefix="own_vae_")
        folder = tmp.name
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    name = pw.family_name(dims)
    checkpoint, weights = os.path.join(folder, name + ".pth"), os.path.join(folder, name + ".bin")
    n, seed, T, K = args.count, args.seed, args.ais, args.iwae

    # 1. and 2.: the user's model, saved and converted
    _, train_images = pw.read_idx(images_path, gz=False)
    start = time.time()
    model = pw.train_family_vae(dims, train_images)
    torch.save(model.state_dict(), checkpoint)
    print(f"trained and saved {checkpoint} ({time.time() - start:.1f} s, CPU)")
    run([sys.executable, os.path.join(ROOT, "prepare_weights.py"), "--checkpoint", checkpoint, "--out", weights])

    # 3. ./vae
    vae = [args.vae, "-w", weights, "-s", str(seed)]
    csvs = {mode: os.path.join(folder, mode + ".csv") for mode in ("zmu", "elbo", "iwae", "ais")}
    pictures = os.path.join(folder, "pictures")
    run(vae + ["-n", str(n), "--zmu", "-o", pictures, "--csv", csvs["zmu"]])
    run(vae + ["-n", str(n), "-o", pictures, "--csv", csvs["elbo"]])
    run(vae + ["-n", str(n), "--iwae", str(K), "--csv", csvs["iwae"]])
    run(vae + ["-n", str(n), "--ais", str(T), "--csv", csvs["ais"]])
    bdmc_text = run(vae + ["--bdmc", str(args.bdmc), "--ais", str(args.bdmc_ais)])
    got = {mode: read_csv(path) for mode, path in csvs.items()}

    # 4. PyTorch float64 from the weights file ./vae read
    model64 = load_weights(weights).double().to(device).eval()
    x = load_images(images_path)[:n].to(device).double() / 255.0
    rows = []

    def row(quantity, vae_value, torch_value, note=""):
        rows.append((quantity, vae_value, torch_value, vae_value - torch_value, note))

    start = time.time()
    with torch.no_grad():
        zmu = pw.forward(model64, x, torch.zeros(n, dims.z, dtype=torch.float64, device=device))
        eps = torch.from_numpy(gaussians(seed, STREAM_POSTERIOR, np.arange(n), 0, dims.z)).to(device, torch.float64)
        sampled = pw.forward(model64, x, eps)
    iwae = iwae_float64(model64, x, K, seed, dims)
    for label, ref, mode in (("z = mu", zmu, "zmu"), ("sampled", sampled, "elbo")):
        bce, kl = ref["bce"].cpu().numpy(), ref["kl"].cpu().numpy()
        row(f"ELBO, {label}: mean BCE", got[mode]["bce"].mean(), bce.mean())
        if mode == "zmu":  # the KL does not depend on eps
            row("ELBO: mean KL", got[mode]["kl"].mean(), kl.mean())
        row(f"ELBO, {label}: mean loss (-ELBO)", (got[mode]["bce"] + got[mode]["kl"]).mean(), (bce + kl).mean(),
            "the same eps" if mode == "elbo" else "")
    se = standard_error(iwae)
    diff = -got["iwae"]["log_px"].mean() + iwae.mean()
    row(f"IWAE, K = {K}: mean NLL", -got["iwae"]["log_px"].mean(), -iwae.mean(),
        f"the same eps; {diff / se:+.4f} SE (SE {se:.4f})")
    print(f"PyTorch float64 ELBO and IWAE on {device}: {time.time() - start:.1f} s")

    start = time.time()
    ais_px, acceptance = (v.cpu().numpy() for v in ais(model64, x, T, CHAINS, LEAPFROG,
                                                      KeyedNoise(seed, n, CHAINS, dims.z, device)))
    differ = int((np.abs(acceptance - got["ais"]["acceptance"]) > 1e-6).sum())
    se = standard_error(ais_px)
    diff = -got["ais"]["log_px"].mean() + ais_px.mean()
    rel = np.max(np.abs(got["ais"]["log_px"] - ais_px) / np.abs(ais_px))
    row(f"AIS, T = {T}, C = {CHAINS}, L = {LEAPFROG}: mean NLL", -got["ais"]["log_px"].mean(), -ais_px.mean(),
        f"the same noise; {diff / se:+.4f} SE; per image at most {rel:.1e} relative; acceptance differs on "
        f"{differ} of {n} images")
    print(f"PyTorch float64 AIS on {device}: {time.time() - start:.1f} s")

    start = time.time()
    B, TB = args.bdmc, args.bdmc_ais
    z_true, x_sim, near = simulate(model64, B, seed, dims, device)
    noise = KeyedNoise(seed, B, CHAINS, dims.z, device)
    lower, _ = ais(model64, x_sim, TB, CHAINS, LEAPFROG, noise)
    upper, _ = ais(model64, x_sim, TB, CHAINS, LEAPFROG, noise, z_start=z_true)
    lower, upper = lower.mean().item(), upper.mean().item()
    vae_lower, vae_upper = printed(bdmc_text, "lower bound"), printed(bdmc_text, "upper bound")
    note = (f"the same noise; ./vae prints 4 decimals; {near} simulated pixels within 1e-6 of their threshold; "
            f"Metropolis tests within rounding of theirs may differ")
    row(f"BDMC, {B} images, T = {TB}: lower bound", vae_lower, lower, note)
    row(f"BDMC, {B} images, T = {TB}: upper bound", vae_upper, upper, "the same noise")
    row(f"BDMC, {B} images, T = {TB}: gap", vae_upper - vae_lower, upper - lower)
    print(f"PyTorch float64 BDMC on {device}: {time.time() - start:.1f} s")

    # 5.
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\n784-{dims.h1}-{dims.z}-{dims.h3} ({name}.pth, zip; converted by prepare_weights.py --checkpoint), "
          f"first {n} test images; PyTorch {torch.__version__} float64 on {gpu}; seed {seed}\n")
    print("| quantity | vae.cu | PyTorch float64 | difference | |")
    print("|---|---:|---:|---:|---|")
    for quantity, a, b, d, note in rows:
        print(f"| {quantity} | {a:.6f} | {b:.6f} | {d:+.2e} | {note} |")


if __name__ == "__main__":
    main()
