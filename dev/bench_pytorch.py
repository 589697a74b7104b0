#!/usr/bin/env python3
"""
Times the same model and loss in PyTorch, the way ./vae --bench times vae.cu: one whole
forward+loss per call (uint8 pixels in, per-image BCE and KL out, z = mu + eps * sigma with a
fresh eps drawn on every call), the test images already on the device.

  python3 dev/bench_pytorch.py                          PyTorch table, every mode, B = 1024 2048 4096 10000
  python3 dev/bench_pytorch.py --vae-bench LOG          also vae.cu against PyTorch's fastest, from ./vae --bench's LOG
  python3 dev/bench_pytorch.py --modes graph-bf16,compiled-bf16 --batches 4096
  python3 dev/bench_pytorch.py --iwae 5000              IWAE log-likelihood of the test set instead
  python3 dev/bench_pytorch.py --ais 1000 --no-cpu      AIS of the test set (./vae --ais 1000's run)
  python3 dev/bench_pytorch.py --modes compiled-fp32 --results R.json   timings kept in R.json: a later run
                                                        with --results R.json adds its own and prints all

Each compiled mode compiles once per batch size; a max-autotune compile (GEMM autotuning
included) takes 20-120 s on an H200 with a cold Inductor cache, fp32 the slower, so the eight of
the default run take 9-10 minutes in all (each one's time is printed). --batches and --modes
narrow the run; --results splits it over several processes or device calls, and --modes none
--results FILE prints the tables of what FILE holds without timing anything.

Modes (--modes takes a comma-separated subset of these names; default all):
  eager-fp32     eager, fp32
  eager-bf16     eager, bf16 under torch.autocast (fp32 model)
  graph-fp32     the eager fp32 call captured once as a CUDA graph; one call = one replay
  graph-bf16     the same, with the model and the scaled pixels in bf16 (model.to(bfloat16))
  compiled-fp32  torch.compile(mode="max-autotune", fullgraph=True, dynamic=False) of the eager
                 fp32 function: Inductor's Triton/cuBLAS GEMM autotuning and its own CUDA graphs
                 (CUDA graph trees); one compile per batch size
  compiled-bf16  the same, of the graph-bf16 function (model and scaled pixels in bf16)
  cpu            eager fp32 on the host CPU with all cores
Every mode runs the same forward_loss(); the bf16 modes compute the BCE and KL in fp32 from
bf16 logits, mu and logvar. fp32 means IEEE fp32: TF32 is switched off for matmuls
(torch.backends.cuda.matmul.allow_tf32 = False, also in the Triton kernels Inductor generates);
the check table shows each mode's KL against a float64 reference (fp32 ~1e-6, TF32 would be ~1e-3).
The compiled modes read the pixels in place (torch._dynamo.mark_static_address), as the CUDA
graphs do, rather than copying them into the graph's input buffer on each call.

Two numbers per mode and batch size, both after 20 warm-up calls (compiled: after the
compile, its autotuning and its graph capture):
  latency     one call from an idle GPU: synchronize, CUDA event, one call, CUDA event; the
              median of 200. It includes the host's time to issue the call (Python, launches).
  throughput  CUDA events around 200 back-to-back calls, divided by 200: the time per batch
              when the host keeps the GPU fed.
images/s and TFLOP/s come from the throughput. The CPU mode has one number, wall clock per call
(median of 10 after 2 warm-up), in the latency column. PyTorch's fastest mode per batch size is
picked among the GPU modes, by latency and by throughput separately, overall and per precision.
With --vae-bench LOG, ./vae --bench's table is read by its column names (latency, throughput;
an older LOG's single us/batch column is read as latency) and each vae.cu precision is compared
with PyTorch's fastest mode overall and with its fastest mode of the same precision:
speedup = PyTorch us / vae.cu us (above 1: vae.cu is faster).

--iwae K times the IWAE log-likelihood (K importance samples per image) in chunks of 16 images:
eager and compiled, fp32 and bf16 (bf16 = torch.autocast, as in the eager bf16 mode). The compiled
chunk function is compiled once; the last chunk is padded to 16 images if n is not a multiple
of 16. Each mode: its time over all n images (CUDA events) and the mean NLL.

--ais T times ./vae --ais T's algorithm (C = 16, L = 10, from q, step sizes adapted per image) on
all n images at once (n x 16 rows): each mode runs 3 untimed transitions (compile, capture), then
CUDA events around --ais-timed more, and the time per transition x (T - 1) is the run's. The
gradient is written out (forward, then the backward pass w.r.t. z) rather than left to autograd,
so one transition (10 of them) is one graph for CUDA graphs and torch.compile; it is checked
against autograd in float64 before timing. The HMC state is fp32, the log weights float64; the
bf16 modes hold the model in bf16 (the loss and sigmoid - x in fp32). Its noise is PyTorch's own:
dev/ais_pytorch.py --check is the reference that replays vae.cu's noise.

A mode that fails (torch.compile missing or failing, no Triton, ...) prints one line naming it
and the error; the other modes go on. Reads data/vae_weights.bin and data/t10k-images-idx3-ubyte
(make data writes them).
"""
import argparse
import copy
import json
import logging
import math
import os
import re
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

BATCHES = [1024, 2048, 4096, 10000]
FLOPS_PER_IMAGE = 2 * (784 * 400 + 400 * 40 + 20 * 400 + 400 * 784)
WARMUP, LATENCY_REPS, THROUGHPUT_CALLS = 20, 200, 200
COMPILE_OPTIONS = dict(mode="max-autotune", dynamic=False)  # plus fullgraph=True, see compile_first_call

# key for --modes, name in the tables, precision
MODES = [
    ("eager-fp32", "eager fp32", "fp32"),
    ("eager-bf16", "eager bf16 autocast", "bf16"),
    ("graph-fp32", "graph fp32", "fp32"),
    ("graph-bf16", "graph bf16", "bf16"),
    ("compiled-fp32", "compiled fp32", "fp32"),
    ("compiled-bf16", "compiled bf16", "bf16"),
    ("cpu", f"CPU eager fp32 ({os.cpu_count()} cores)", "fp32"),
]
MODE_NAME = {key: name for key, name, _ in MODES}
MODE_PRECISION = {key: prec for key, _, prec in MODES}
IWAE_MODES = ["eager-fp32", "eager-bf16", "compiled-fp32", "compiled-bf16"]


# the model as it was trained: one definition, prepare_weights.py's
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from prepare_weights import MAX_HIDDEN, MAX_LATENT, Dims, model_dims, vae_class  # noqa: E402

VAE = vae_class()


def load_weights(path):
    """A vae.cu weights file as the float32 model of its size: H1, Z and H3 from its header (ints 3, 4 and 8;
    version 1, before H3, had H3 = H1)."""
    if not os.path.exists(path):
        sys.exit(f"{path}: no such file. HINT: make data")
    blob = np.fromfile(path, dtype="<i4")
    if blob.size < 256 or blob[0] != 0x31454156 or blob[1] not in (1, 2) or blob[2] != 784:
        sys.exit(f"{path}: not a vae.cu weights file. HINT: make data, or prepare_weights.py --checkpoint FILE")
    dims = Dims(int(blob[3]), int(blob[4]), int(blob[8] if blob[1] == 2 else blob[3]))
    if not (1 <= dims.h1 <= MAX_HIDDEN and 1 <= dims.z <= MAX_LATENT and 1 <= dims.h3 <= MAX_HIDDEN):
        sys.exit(f"{path}: header gives H1 = {dims.h1}, Z = {dims.z}, H3 = {dims.h3}, outside the family's bounds")
    floats = blob[256:].view("<f4")
    model, offset = VAE(dims), 0
    if floats.size != sum(p.numel() for p in model.parameters()):
        sys.exit(f"{path}: {floats.size} floats after the header, where a 784-{dims.h1}-{dims.z}-{dims.h3} VAE has "
                 f"{sum(p.numel() for p in model.parameters())}. HINT: convert its checkpoint again")
    for name in ["fc1", "fc21", "fc22", "fc3", "fc4"]:
        layer = getattr(model, name)
        for p in (layer.weight, layer.bias):
            p.data.copy_(torch.from_numpy(floats[offset:offset + p.numel()].copy()).view_as(p))
            offset += p.numel()
    return model


def load_images(path):
    if not os.path.exists(path):
        sys.exit(f"{path}: no such file. HINT: make data")
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


def reference_kl(model64, pixels):
    """KL of each image in float64 (no sampling involved): the check on every mode's precision."""
    x = pixels.double() / 255.0
    h1 = F.relu(model64.fc1(x))
    mu, logvar = model64.fc21(h1), model64.fc22(h1)
    return -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)


def iwae_log_px(model, pixels, k, chunk, dtype):
    """log p(x) of each image from k importance samples, chunk images at a time; Gaussian terms
    with their -1/2 log(2 pi), log p(x|z) = -BCE from the logits."""
    out = []
    half_log_2pi = 0.5 * math.log(2 * math.pi)
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
        out.append(torch.logsumexp(-bce + log_pz - log_qz, dim=1) - math.log(k))
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------
# timing

def time_latency(fn, warmup=WARMUP, reps=LATENCY_REPS):
    """Median of reps single calls, each from an idle GPU, between two CUDA events (us)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.cuda.synchronize()
        starts[i].record()
        fn()
        stops[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, stops))


def time_throughput(fn, calls=THROUGHPUT_CALLS):
    """CUDA events around calls back-to-back calls, divided by calls (us per call)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000.0 / calls


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
    """Captures fn once as a CUDA graph; returns a replay function that returns fn's outputs
    (the same tensors on every replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    return replay


def compile_first_call(fn, *args):
    """torch.compile(fn) in max-autotune mode and its first call (tracing, autotuning, code
    generation). fullgraph=True, or fullgraph=False if the function does not trace whole.
    Returns (compiled fn, seconds, note)."""
    if not hasattr(torch, "compile"):
        raise RuntimeError(f"torch.compile needs PyTorch 2.0 or later, this is {torch.__version__}")
    unsupported = getattr(getattr(getattr(torch, "_dynamo", None), "exc", None), "Unsupported", ())
    t0 = time.perf_counter()
    torch._dynamo.reset()  # one compile per (mode, batch): nothing cached from the previous one
    try:
        cfn, note = torch.compile(fn, fullgraph=True, **COMPILE_OPTIONS), "fullgraph"
        cfn(*args)
    except unsupported as e:
        note = f"fullgraph=False ({first_line(e)})"
        torch._dynamo.reset()
        cfn = torch.compile(fn, fullgraph=False, **COMPILE_OPTIONS)
        cfn(*args)
    torch.cuda.synchronize()
    return cfn, time.perf_counter() - t0, note


def first_line(e):
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    text = lines[0].strip() if lines else ""
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def cudagraph_skips():
    """Inductor's count of graphs it ran without CUDA graphs (None where it does not keep one)."""
    try:
        from torch._dynamo.utils import counters
        return sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# the per-batch table

def gpu_callable(key, models, pixels, info):
    """The function that one call of mode key makes, ready to time (set up and compiled)."""
    m32, m16 = models
    if key == "eager-fp32":
        return lambda: forward_loss(m32, pixels, torch.float32)
    if key == "eager-bf16":
        def autocast_bf16():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return forward_loss(m32, pixels, torch.float32)
        return autocast_bf16
    if key == "graph-fp32":
        return graphed(lambda: forward_loss(m32, pixels, torch.float32))
    if key == "graph-bf16":
        return graphed(lambda: forward_loss(m16, pixels, torch.bfloat16))
    if key in ("compiled-fp32", "compiled-bf16"):
        model, dtype = (m32, torch.float32) if key == "compiled-fp32" else (m16, torch.bfloat16)

        def step(px):
            return forward_loss(model, px, dtype)
        if hasattr(torch, "_dynamo") and hasattr(torch._dynamo, "mark_static_address"):
            torch._dynamo.mark_static_address(pixels)
        skips = cudagraph_skips()
        cfn, seconds, note = compile_first_call(step, pixels)
        after = cudagraph_skips()
        info["compile_s"], info["compile_note"] = seconds, note
        if skips is not None and after is not None and after > skips:
            info["compile_note"] += ", ran without CUDA graphs"
        return lambda: cfn(pixels)
    raise ValueError(key)


def check_outputs(fn, kl64):
    """Two calls after one more (for the compiled modes, two CUDA graph replays): the KL's largest
    relative error against float64, the mean BCE + KL, and whether the BCE changed between the
    two calls (a fresh eps on each call)."""
    fn()
    bce1, kl1 = [t.clone() for t in fn()]  # cloned at once: a compiled graph's next replay reuses its outputs
    bce2, _ = [t.clone() for t in fn()]
    err = ((kl1.double() - kl64).abs() / kl64.abs().clamp_min(1e-12)).max().item()
    return {"kl_err": err, "mean_loss": (bce1.double() + kl1.double()).mean().item(),
            "fresh_z": not torch.equal(bce1, bce2)}


def run_gpu_modes(keys, model, images, batches, device="cuda"):
    """Times every GPU mode in keys at every batch size. Returns (results, checks):
    results[(key, batch)] = (latency us, throughput us), checks[(key, batch)] = dict."""
    results, checks, failed = {}, {}, set()
    m32 = model.to(device)
    m16 = VAE(model_dims(model)).to(device).to(torch.bfloat16)
    m16.load_state_dict(model.state_dict())
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        for b in batches:
            pixels = images[:b].to(device)
            kl64 = reference_kl(m64, pixels)
            for key in keys:
                if key in failed:
                    continue
                info = {}
                try:
                    t0 = time.perf_counter()
                    fn = gpu_callable(key, (m32, m16), pixels, info)
                    info.setdefault("compile_s", None)
                    info["setup_s"] = time.perf_counter() - t0
                    if info["compile_s"] is not None:
                        print(f"{MODE_NAME[key]}, batch {b}: compiled in {info['compile_s']:.1f} s "
                              f"({info['compile_note']})", flush=True)
                    info.update(check_outputs(fn, kl64))
                    results[(key, b)] = (time_latency(fn), time_throughput(fn))
                    checks[(key, b)] = info
                except Exception as e:  # one line, then the other modes
                    print(f"{MODE_NAME[key]}: failed at batch {b}, skipped ({first_line(e)})", flush=True)
                    failed.add(key)
                finally:
                    fn = None
                    if key.startswith("compiled") and hasattr(torch, "_dynamo"):
                        torch._dynamo.reset()
    return results, checks


def run_cpu_mode(data_dir, images, batches):
    torch.set_num_threads(os.cpu_count())
    cpu_model = load_weights(os.path.join(data_dir, "vae_weights.bin")).eval()
    results = {}
    with torch.no_grad():
        for b in batches:
            pixels = images[:b]
            results[("cpu", b)] = (time_cpu(lambda: forward_loss(cpu_model, pixels, torch.float32)), None)
    return results


def fmt_us(us):
    return "—" if us is None else f"{us:.1f}"


def order(results):
    rank = {key: i for i, (key, _, _) in enumerate(MODES)}
    return sorted(results, key=lambda kb: (kb[1], rank[kb[0]]))


def main_table(results):
    rows = ["| PyTorch mode | batch | latency us | throughput us | images/s | TFLOP/s |",
            "|---|---:|---:|---:|---:|---:|"]
    for key, b in order(results):
        lat, thr = results[(key, b)]
        rate = thr if thr is not None else lat
        rows.append(f"| {MODE_NAME[key]} | {b} | {fmt_us(lat)} | {fmt_us(thr)} | {b / (rate * 1e-6):.3g} "
                    f"| {FLOPS_PER_IMAGE * b / (rate * 1e6):.2f} |")
    return rows


def fastest(results, b, measure, precision=None):
    """(key, us) of PyTorch's fastest GPU mode at batch b by measure (0 latency, 1 throughput),
    of the given precision or any; None if there is none."""
    best = None
    for (key, batch), times in results.items():
        if batch != b or key == "cpu" or times[measure] is None:
            continue
        if precision is not None and MODE_PRECISION[key] != precision:
            continue
        if best is None or times[measure] < best[1]:
            best = (key, times[measure])
    return best


def fastest_table(results, batches):
    rows = ["| batch | precision | fastest by latency | latency us | fastest by throughput | throughput us |",
            "|---:|---|---|---:|---|---:|"]
    for b in batches:
        for prec in (None, "fp32", "bf16"):
            lat, thr = fastest(results, b, 0, prec), fastest(results, b, 1, prec)
            if lat is None and thr is None:
                continue
            cells = []
            for best in (lat, thr):
                cells += ["—", "—"] if best is None else [MODE_NAME[best[0]], f"{best[1]:.1f}"]
            rows.append(f"| {b} | {prec or 'any'} | " + " | ".join(cells) + " |")
    return rows


def check_table(checks):
    rows = ["| PyTorch mode | batch | setup s | KL max rel. error vs float64 | mean BCE + KL | fresh eps per call | compile |",
            "|---|---:|---:|---:|---:|---|---|"]
    for key, b in order(checks):
        c = checks[(key, b)]
        rows.append(f"| {MODE_NAME[key]} | {b} | {c['setup_s']:.2f} | {c['kl_err']:.1e} | {c['mean_loss']:.4f} "
                    f"| {'yes' if c['fresh_z'] else 'NO'} | {c.get('compile_note', '') or ''} |")
    return rows


# ---------------------------------------------------------------------------------------------
# ./vae --bench

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def parse_vae_bench(lines):
    """{(precision, batch): (latency us, throughput us or None)} from ./vae --bench's output; the precision
    is prefixed with the engine ("plain bf16") where the table has a kernels column.
    Columns are found by name in the header row of the table (one containing "latency", or the
    old format's "us/batch", which is read as latency)."""
    rows, cols = {}, None
    for line in lines:
        s = line.strip()
        if not s.startswith("|"):
            cols = None
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        low = [c.lower() for c in cells]
        if any("latency" in c or "us/batch" in c for c in low):
            cols = {}
            for i, c in enumerate(low):
                if "precision" in c:
                    cols.setdefault("precision", i)
                elif c == "kernels":
                    cols.setdefault("kernels", i)
                elif "latency" in c:
                    cols.setdefault("latency", i)
                elif "throughput" in c:
                    cols.setdefault("throughput", i)
                elif "us/batch" in c:
                    cols.setdefault("latency", i)
                elif re.fullmatch(r"(batch|b)( size)?", c.strip("* ")):
                    cols.setdefault("batch", i)
            if not {"precision", "batch", "latency"} <= set(cols):
                cols = None
            continue
        if cols is None or re.fullmatch(r"[|:\- ]*", s):
            continue
        try:
            words = cells[cols["precision"]].strip("*` ").lower().split()
            batch = int(NUMBER.search(cells[cols["batch"]].replace(",", "")).group())
            lat = float(NUMBER.search(cells[cols["latency"]].replace(",", "")).group())
            thr = None
            if "throughput" in cols:
                m = NUMBER.search(cells[cols["throughput"]].replace(",", ""))
                thr = float(m.group()) if m else None
        except (IndexError, AttributeError, ValueError):
            continue
        if words:  # "plain bf16", "fused fp32" where the table names the engine
            engine = cells[cols["kernels"]].strip("*` ").lower() + " " if "kernels" in cols else ""
            rows[(engine + words[0], batch)] = (lat, thr)
    return rows


def vae_table(results, ours, batches):
    """vae.cu against PyTorch's fastest GPU mode overall and of the same precision."""
    rows = ["| batch | measure | vae.cu | vae.cu us | PyTorch fastest | PyTorch us | speedup "
            "| PyTorch fastest, same precision | PyTorch us | speedup |",
            "|---:|---|---|---:|---|---:|---:|---|---:|---:|"]
    precisions = sorted({p for p, _ in ours}, key=lambda p: (p.split()[-1] not in ("bf16", "fp32"),
                                                             p.split()[-1] != "bf16", p))
    for b in batches:
        for measure, label in ((0, "latency"), (1, "throughput")):
            for prec in precisions:
                if (prec, b) not in ours or ours[(prec, b)][measure] is None:
                    continue
                us = ours[(prec, b)][measure]
                cells = [str(b), label, prec, f"{us:.1f}"]
                for best in (fastest(results, b, measure), fastest(results, b, measure, prec.split()[-1])):
                    cells += ["—"] * 3 if best is None else [MODE_NAME[best[0]], f"{best[1]:.1f}",
                                                             f"{best[1] / us:.2f}x"]
                rows.append("| " + " | ".join(cells) + " |")
    return rows


def merge_results_file(path, results, checks, device):
    """Adds this run's timings to those saved in path by earlier runs (this run's win where both
    timed the same mode and batch), writes the union back, and returns it. Lets the slow compiled
    modes run in a separate process (or device call) from the others and still share one table."""
    known = {key for key, _, _ in MODES}
    all_results, all_checks = {}, {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                saved = json.load(f)
            if saved.get("device") != device and (results or checks):
                print(f"--results {path}: earlier timings from {saved.get('device')}, this run on {device}")
            for key, b, lat, thr in saved["results"]:
                if key in known:
                    all_results[(key, int(b))] = (lat, thr)
            for key, b, check in saved.get("checks", []):
                if key in known:
                    all_checks[(key, int(b))] = check
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"--results {path}: not a results file of this script ({first_line(e)})")
    if not results and not checks:  # --modes none: read only
        return all_results, all_checks
    all_results.update(results)
    all_checks.update(checks)
    try:
        with open(path, "w") as f:
            json.dump({"device": device, "torch": torch.__version__,
                       "results": [[k, b, lat, thr] for (k, b), (lat, thr) in all_results.items()],
                       "checks": [[k, b, c] for (k, b), c in all_checks.items()]}, f, indent=1)
    except OSError as e:
        sys.exit(f"--results {path}: cannot write ({e.strerror})")
    return all_results, all_checks


def quiet_inductor():
    """Inductor prints every GEMM's autotuning table to stderr and logs each Triton config that
    does not fit in shared memory (skipped, harmless); --verbose keeps all of that."""
    try:
        import torch._inductor.config as inductor_config
        inductor_config.autotune_num_choices_displayed = 0
        if hasattr(inductor_config, "max_autotune_report_choices_stats"):
            inductor_config.max_autotune_report_choices_stats = False
    except Exception:
        pass
    logging.getLogger("torch._inductor.select_algorithm").setLevel(logging.CRITICAL)


# ---------------------------------------------------------------------------------------------
# --iwae

def run_iwae(model, images, k, n, keys, chunk=16):
    """Times one whole IWAE evaluation of n images per mode (CUDA events around all chunks)."""
    m32 = model.cuda()
    pixels = images[:n].cuda()
    padded_n = -(-n // chunk) * chunk
    padded = torch.zeros(padded_n, 784, dtype=torch.uint8, device="cuda")
    padded[:n] = pixels
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: IWAE, K = {k}, {n} images, "
          f"chunks of {chunk} images; TF32 off (allow_tf32 = {torch.backends.cuda.matmul.allow_tf32})", flush=True)
    rows = []
    for key in keys:
        bf16 = MODE_PRECISION[key] == "bf16"

        def evaluate_chunks(px, bf16=bf16):
            if not bf16:
                return iwae_log_px(m32, px, k, chunk, torch.float32)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return iwae_log_px(m32, px, k, chunk, torch.float32)
        try:
            with torch.no_grad():
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                compile_s = None
                if key.startswith("eager"):
                    evaluate_chunks(pixels[:chunk])
                    torch.cuda.synchronize()
                    start.record()
                    log_px = evaluate_chunks(pixels)
                    stop.record()
                else:
                    buf = torch.zeros(chunk, 784, dtype=torch.uint8, device="cuda")  # the compiled input, read in place
                    if hasattr(torch, "_dynamo") and hasattr(torch._dynamo, "mark_static_address"):
                        torch._dynamo.mark_static_address(buf)
                    buf.copy_(padded[:chunk])
                    cfn, compile_s, note = compile_first_call(evaluate_chunks, buf)
                    print(f"IWAE {MODE_NAME[key]}: compiled in {compile_s:.1f} s ({note})", flush=True)
                    for _ in range(3):  # CUDA graph capture, then replays
                        cfn(buf)
                    out = torch.empty(padded_n, device="cuda")
                    torch.cuda.synchronize()
                    start.record()
                    for first in range(0, padded_n, chunk):
                        buf.copy_(padded[first:first + chunk])
                        out[first:first + chunk].copy_(cfn(buf))  # consumed before the next replay reuses it
                    stop.record()
                    log_px = out[:n]
                torch.cuda.synchronize()
            ms = start.elapsed_time(stop)
            rows.append(f"| {MODE_NAME[key]} | {n} | {k} | {ms:.1f} | {-log_px.double().mean():.4f} "
                        f"| {n * k / (ms * 1e-3):.3g} | {'—' if compile_s is None else f'{compile_s:.1f}'} |")
        except Exception as e:
            print(f"IWAE {MODE_NAME[key]}: failed, skipped ({first_line(e)})", flush=True)
        finally:
            cfn = None
            if key.startswith("compiled") and hasattr(torch, "_dynamo"):
                torch._dynamo.reset()
    print("\n| PyTorch mode | images | K | time ms | mean NLL | decoder passes/s | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(row)


# ---------------------------------------------------------------------------------------------
# --ais T

def ais_gradient(w3, b3, w4, b4, x, z):
    """BCE(x, logits(z)) per row and grad_z BCE, the backward pass written out rather than by autograd,
    so that a whole transition is one graph for CUDA graphs and torch.compile: the products in the
    weights' dtype (fp32 or bf16), the loss and sigmoid - x in z's (fp32)."""
    pre = torch.addmm(b3, z.to(w3.dtype), w3.t())
    logits = torch.addmm(b4, torch.relu(pre), w4.t()).to(z.dtype)
    bce = (logits.clamp_min(0) - x * logits + torch.log1p(torch.exp(-logits.abs()))).sum(1)
    dh = ((torch.sigmoid(logits) - x).to(w4.dtype) @ w4) * (pre > 0)
    return bce, (dh @ w3).to(z.dtype)


def check_ais_gradient(model):
    """The written-out gradient against autograd, both float64, on 64 rows: an error in it fails here.

    An error in the formula is off by O(1); float64 rounding is ~1e-12 here (seen: 1.4e-12 on a 16-core
    machine, under 1e-12 on others: the summation order of the 784-term products, whose sigmoid - x
    terms cancel, follows the CPU's threads), so the bound is 1e-9."""
    m64 = copy.deepcopy(model).double().cpu()
    gen = torch.Generator().manual_seed(0)
    z = 0.6 * torch.randn(64, 20, generator=gen, dtype=torch.float64)
    x = torch.rand(64, 784, generator=gen, dtype=torch.float64)
    bce, grad = ais_gradient(m64.fc3.weight, m64.fc3.bias, m64.fc4.weight, m64.fc4.bias, x, z)
    zg = z.clone().requires_grad_(True)
    ref = F.binary_cross_entropy_with_logits(m64.fc4(F.relu(m64.fc3(zg))), x, reduction="none").sum(1)
    (ref_grad,) = torch.autograd.grad(ref.sum(), zg)
    err = max(((bce - ref).abs().max() / ref.abs().max()).item(),
              ((grad.double() - ref_grad).abs().max() / ref_grad.abs().max()).item())
    if not err < 1e-9:
        sys.exit(f"bench_pytorch.py --ais: the written-out gradient is {err:.2e} off autograd's (float64)")
    return err


def ais_transition(weights, x, mu, inv_var, logvar_sum, z, grad, bce, log_w, step, b, db, chains, leapfrog):
    """One AIS step on n images x C chains (rows image-major), the algorithm of ./vae --ais: the weight
    update log w += (b_t - b_{t-1}) [log p(x, z) - log p0(z)], then one HMC transition at b (a momentum
    draw, `leapfrog` steps, the Metropolis test) and each image's step size moved toward acceptance 0.65.
    The state (z, grad, bce, step) in fp32, log w in float64. Returns the new state and the acceptances."""
    def densities(z, bce):
        return -bce - 0.5 * (z * z).sum(1), -0.5 * (((z - mu) ** 2 * inv_var).sum(1) + logvar_sum)

    def grad_u(z, g):
        return b * (g + z) + (1 - b) * (z - mu) * inv_var

    lpxz, lp0 = densities(z, bce)
    log_w = log_w + db.double() * (lpxz - lp0).double()
    rows_step = step.repeat_interleave(chains, 0)
    p = torch.randn_like(z)
    h0 = -b * lpxz - (1 - b) * lp0 + 0.5 * (p * p).sum(1)
    z1, g1 = z, grad
    p = p - 0.5 * rows_step * grad_u(z1, g1)
    for i in range(1, leapfrog + 1):
        z1 = z1 + rows_step * p
        bce1, g1 = ais_gradient(*weights, x, z1)
        p = p - (1.0 if i < leapfrog else 0.5) * rows_step * grad_u(z1, g1)
    lpxz1, lp01 = densities(z1, bce1)
    h1 = -b * lpxz1 - (1 - b) * lp01 + 0.5 * (p * p).sum(1)
    accept = torch.log(torch.rand_like(h0)) < h0 - h1  # False for NaN: a non-finite proposal is rejected
    z, grad = torch.where(accept[:, None], z1, z), torch.where(accept[:, None], g1, grad)
    bce = torch.where(accept, bce1, bce)
    rate = accept.float().view(-1, chains).mean(1, keepdim=True)
    step = torch.clamp(step * torch.where(rate > 0.65, 1.02, 0.98), 1e-4, 0.5)
    return z, grad, bce, log_w, step, accept


def run_ais(model, images, T, n, keys, timed, chains=16, leapfrog=10):
    """Times AIS at T (C = 16, L = 10, from q) per mode: CUDA events around `timed` transitions after
    3 untimed ones (the compile, the graph capture), scaled to the run's T - 1 transitions."""
    err = check_ais_gradient(model)
    pixels = images[:n].cuda()
    rows = n * chains
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: AIS, {n} images x {chains} chains, "
          f"L = {leapfrog}; {timed} transitions timed, scaled to T = {T}; TF32 off; the written-out gradient "
          f"{err:.1e} off autograd (float64)", flush=True)
    s = [1 / (1 + math.exp(-4 * (2 * t / T - 1))) for t in range(T + 1)]
    beta = [0.0] + [(v - s[0]) / (s[-1] - s[0]) for v in s[1:-1]] + [1.0]
    table = []
    for key in keys:
        dtype = torch.bfloat16 if MODE_PRECISION[key] == "bf16" else torch.float32
        m = copy.deepcopy(model).cuda().to(dtype)
        weights = (m.fc3.weight, m.fc3.bias, m.fc4.weight, m.fc4.bias)
        try:
            with torch.no_grad():
                x = (pixels.float() / 255.0).repeat_interleave(chains, 0)
                h1 = F.relu(m.fc1(x[::chains].to(dtype)))
                mu = m.fc21(h1).float().repeat_interleave(chains, 0)
                logvar = m.fc22(h1).float().repeat_interleave(chains, 0)
                inv_var, logvar_sum = torch.exp(-logvar), logvar.sum(1)
                z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
                bce, grad = ais_gradient(*weights, x, z)
                state = [z, grad, bce, torch.zeros(rows, dtype=torch.float64, device="cuda"),
                         torch.full((n, 1), 0.05, device="cuda")]
                fixed = (weights, x, mu, inv_var, logvar_sum)
                b_t = [torch.tensor(v, device="cuda") for v in beta]
                db_t = [torch.tensor(beta[t] - beta[t - 1], device="cuda") for t in range(1, T + 1)]

                def step_fn(*args):
                    return ais_transition(*fixed, *args, chains, leapfrog)
                compile_s = None
                if key.startswith("eager"):
                    def transition(t, state):
                        return step_fn(*state, b_t[t], db_t[t - 1])
                elif key.startswith("graph"):
                    static = [v.clone() for v in state] + [b_t[1].clone(), db_t[0].clone()]

                    def capture():
                        out = step_fn(*static)
                        for dst, src in zip(static[:5], out[:5]):
                            dst.copy_(src)
                        return out[5]
                    replay = graphed(capture)

                    def transition(t, state):
                        static[5].copy_(b_t[t]), static[6].copy_(db_t[t - 1])
                        accept = replay()
                        return [*static[:5], accept]
                    static_state = static[:5]
                    for dst, src in zip(static_state, state):
                        dst.copy_(src)
                    state = static_state
                else:
                    cfn, compile_s, note = compile_first_call(step_fn, *state, b_t[1], db_t[0])
                    print(f"AIS {key}: compiled in {compile_s:.1f} s ({note})", flush=True)

                    def transition(t, state):
                        if hasattr(torch, "compiler") and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                            torch.compiler.cudagraph_mark_step_begin()
                        return [v.clone() for v in cfn(*state, b_t[t], db_t[t - 1])]  # before the next replay
                for t in range(1, 4):  # untimed: CUDA graph capture and warm-up
                    state = transition(t, state)[:5]
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                accepted = torch.zeros((), device="cuda")
                torch.cuda.synchronize()
                start.record()
                for t in range(4, 4 + timed):
                    out = transition(t, state)
                    state, accepted = out[:5], accepted + out[5].float().mean()
                stop.record()
                torch.cuda.synchronize()
            ms = start.elapsed_time(stop) / timed
            acceptance = accepted.item() / timed
            if not (math.isfinite(acceptance) and 0.2 < acceptance <= 1.0):
                raise RuntimeError(f"acceptance {acceptance:.3f}: the chains are not moving as they should")
            table.append(f"| {key} | {ms:.2f} | {ms * (T - 1) / 1e3:.2f} | {acceptance:.3f} "
                         f"| {'—' if compile_s is None else f'{compile_s:.1f}'} |")
            print(table[-1], flush=True)
        except Exception as e:
            print(f"AIS {key}: failed, skipped ({first_line(e)})", flush=True)
        finally:
            if key.startswith("compiled") and hasattr(torch, "_dynamo"):
                torch._dynamo.reset()
    print(f"\n| PyTorch mode | ms / transition | --ais {T} (s) | acceptance | compile s |")
    print("|---|---:|---:|---:|---:|")
    for row in table:
        print(row)


# ---------------------------------------------------------------------------------------------

def comma_list(text, parse, allowed=None, what="value"):
    items = [s.strip() for s in text.split(",") if s.strip()]
    out = []
    for s in items:
        try:
            v = parse(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {s!r} is not valid")
        if allowed is not None and v not in allowed:
            raise argparse.ArgumentTypeError(f"unknown {what} {s!r}; choose from {', '.join(allowed)}")
        if v not in out:
            out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data", help="folder with vae_weights.bin and the test images")
    p.add_argument("--vae-bench", metavar="LOG", help="output of ./vae --bench, to compare vae.cu with PyTorch's fastest")
    p.add_argument("--modes", type=lambda s: comma_list(s, str, [k for k, _, _ in MODES] + ["none"], "mode"),
                   default=[k for k, _, _ in MODES],
                   help="comma-separated subset of " + ",".join(k for k, _, _ in MODES) + " (default all); "
                        "none times nothing and prints the tables of --results FILE")
    p.add_argument("--batches", type=lambda s: comma_list(s, int, None, "batch size"), default=BATCHES,
                   help="comma-separated batch sizes (default 1024,2048,4096,10000)")
    p.add_argument("--no-cpu", action="store_true", help="skip the host CPU timing (same as leaving cpu out of --modes)")
    p.add_argument("--iwae", type=int, metavar="K", help="time the IWAE log-likelihood with K samples instead")
    p.add_argument("--ais", type=int, metavar="T", help="time AIS at T (C = 16, L = 10, from q) instead")
    p.add_argument("--ais-timed", type=int, default=20, metavar="N", help="transitions timed for --ais (default 20)")
    p.add_argument("-n", type=int, default=10000, help="images for --iwae and --ais (default 10000)")
    p.add_argument("--results", metavar="FILE",
                   help="JSON file: this run's timings are added to those saved there by earlier runs, and the "
                        "tables cover them all (e.g. the compiled modes in a separate process)")
    p.add_argument("--verbose", action="store_true", help="keep Inductor's autotuning reports on stderr")
    p.add_argument("--gemm-backends", metavar="LIST",
                   help="torch._inductor.config.max_autotune_gemm_backends for the compiled modes, e.g. ATEN,TRITON "
                        "(default: Inductor's own)")
    args = p.parse_args(argv)
    if "none" in args.modes:
        if len(args.modes) > 1 or not args.results or args.iwae or args.ais:
            p.error("--modes none goes alone, with --results FILE and without --iwae or --ais")
        args.modes = []
    if args.no_cpu:
        args.modes = [k for k in args.modes if k != "cpu"]
    if args.iwae is not None and args.iwae < 1:
        p.error("--iwae K needs K >= 1")
    if args.ais is not None and (args.iwae or args.ais_timed < 1 or args.ais < args.ais_timed + 4):
        p.error("--ais T needs T >= --ais-timed + 4 (3 untimed transitions first), --ais-timed >= 1, and no --iwae")
    if args.n < 1 or any(b < 1 for b in args.batches):
        p.error("-n and the batch sizes must be positive")
    return args


def main():
    args = parse_args()
    warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores.*")
    warnings.filterwarnings("ignore", message=".*new API settings to control TF32.*")
    # fp32 is IEEE fp32 everywhere (eager, cuBLAS in the graphs, Inductor's Triton GEMMs). The legacy
    # flag only: Inductor in PyTorch 2.9-2.11 still reads it and rejects a mix with fp32_precision.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.gemm_backends and hasattr(torch, "_inductor"):
        import torch._inductor.config as inductor_config
        inductor_config.max_autotune_gemm_backends = args.gemm_backends
    if hasattr(torch, "_dynamo"):
        torch._dynamo.config.error_on_recompile = True  # a recompile mid-timing would be timed: fail instead
        if not args.verbose:
            quiet_inductor()

    gpu_keys = [k for k in args.modes if k != "cpu"]
    if args.iwae:
        gpu_keys = [k for k in args.modes if k in IWAE_MODES]
        if not gpu_keys:
            sys.exit(f"--iwae times only the modes {','.join(IWAE_MODES)}")
    if args.ais and not gpu_keys:
        sys.exit("--ais times the GPU modes only")
    if gpu_keys and not torch.cuda.is_available():
        sys.exit(f"bench_pytorch.py: PyTorch {torch.__version__} sees no CUDA device "
                 f"(modes {','.join(gpu_keys)} need one; --modes cpu times the host CPU alone)")
    model = images = None
    if args.modes:
        model = load_weights(os.path.join(args.data, "vae_weights.bin")).eval()
        images = load_images(os.path.join(args.data, "t10k-images-idx3-ubyte"))
    if args.iwae:
        if args.n > len(images):
            sys.exit(f"-n {args.n}: the test set holds {len(images)} images")
        run_iwae(model, images, args.iwae, args.n, gpu_keys)
        return
    if args.ais:
        if args.n > len(images):
            sys.exit(f"-n {args.n}: the test set holds {len(images)} images")
        run_ais(model, images, args.ais, args.n, gpu_keys, args.ais_timed)
        return
    too_big = [b for b in args.batches if images is not None and b > len(images)]
    if too_big:
        sys.exit(f"--batches: the test set holds {len(images)} images, fewer than {too_big[0]}")
    ours = None
    if args.vae_bench:
        try:
            with open(args.vae_bench) as f:
                ours = parse_vae_bench(f)
        except OSError as e:
            sys.exit(f"--vae-bench {args.vae_bench}: {e.strerror}")
        if not ours:
            print(f"--vae-bench {args.vae_bench}: no ./vae --bench table found (a header with latency or us/batch)")

    results, checks = {}, {}
    if gpu_keys:
        print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}; fp32 matmuls without TF32 "
              f"(allow_tf32 = {torch.backends.cuda.matmul.allow_tf32})", flush=True)
        if any(k.startswith("compiled") for k in gpu_keys) and hasattr(torch, "_inductor"):
            try:
                import torch._inductor.config as inductor_config
                print(f"compiled: torch.compile(fullgraph=True, {', '.join(f'{k}={v!r}' for k, v in COMPILE_OPTIONS.items())}) "
                      f"= {torch._inductor.list_mode_options(COMPILE_OPTIONS['mode'])}, GEMM backends "
                      f"{inductor_config.max_autotune_gemm_backends}", flush=True)
            except Exception as e:
                print(f"compiled: Inductor's options unreadable ({first_line(e)})")
        results, checks = run_gpu_modes(gpu_keys, model, images, args.batches)
    if "cpu" in args.modes:
        results.update(run_cpu_mode(args.data, images, args.batches))
    if args.results:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
        results, checks = merge_results_file(args.results, results, checks, device)
    batches = sorted({b for _, b in results})

    print(f"\nforward + loss per batch. latency: one call from an idle GPU between CUDA events, median of "
          f"{LATENCY_REPS}; throughput: CUDA events around {THROUGHPUT_CALLS} back-to-back calls / "
          f"{THROUGHPUT_CALLS}; both after {WARMUP} warm-up calls; images/s and TFLOP/s from the throughput. "
          f"CPU: wall clock per call, median of 10.\n")
    print("\n".join(main_table(results)))
    if any(key != "cpu" for key, _ in results):
        print("\nPyTorch's fastest GPU mode per batch size\n")
        print("\n".join(fastest_table(results, batches)))
    if checks:
        print("\nchecks: KL (no sampling) against float64; the mean loss differs between modes by sampling noise\n")
        print("\n".join(check_table(checks)))
    if ours:
        if all(thr is None for _, thr in ours.values()):
            print(f"\n{args.vae_bench}: the old ./vae --bench format (us/batch only), read as latency")
        print("\nvae.cu (./vae --bench) against PyTorch's fastest GPU mode; speedup = PyTorch us / vae.cu us\n")
        print("\n".join(vae_table(results, ours, batches)))


if __name__ == "__main__":
    main()
