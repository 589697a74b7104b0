#!/usr/bin/env python3
"""
Tests prepare_weights.py: the numpy-only inputs, the legacy checkpoint reader against PyTorch and
against damaged or foreign files, the one-line errors, and the atomic, deterministic outputs.

  python3 test_prepare_weights.py [--src ../shared/data]

Needs numpy; compares with PyTorch, and writes the checkpoints it needs to damage, when the running
Python imports torch, and skips those checks otherwise. The command-line runs always hide torch
(a torch.py that raises ImportError, first on PYTHONPATH), so they test the numpy-only path
whatever Python runs them.
"""
import argparse
import collections
import gzip
import hashlib
import io
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import tempfile
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import prepare_weights as pw  # noqa: E402

try:
    import torch
except ImportError as e:
    torch, NO_TORCH = None, f"no torch in this Python ({e})"

SCRIPT = os.path.join(HERE, "prepare_weights.py")
INPUT_FILES = ["vae_weights.bin", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
# vae_weights.bin as converted from the published checkpoint (through torch.load, before this reader
# existed): a value known independently of the reader, so that a reader error shows without torch too
WEIGHTS_MD5 = "6cd407054ded473e2250a6faa8d1d378"

counts = collections.Counter()


def ok(what):
    counts["passed"] += 1
    print(f"  ok      {what}")


def not_ok(what, detail):
    counts["failed"] += 1
    print(f"  NOT OK  {what}: {detail}")


def skip(what, why):
    counts["skipped"] += 1
    print(f"  skip    {what}: {why}")


def check(what, problem):
    """problem: None when the check holds, else what went wrong."""
    if problem is None:
        ok(what)
    else:
        not_ok(what, problem)


def md5_of(path):
    with open(path, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()


def same_bits(a, b):
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(
        a.view(np.uint32), b.view(np.uint32))


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


class Env:
    """The temporary folders and the command-line runner shared by the checks."""

    def __init__(self, root, src):
        self.root, self.src = root, src
        self.checkpoint = os.path.join(src, pw.CHECKPOINT)
        self.blocker = os.path.join(root, "no_torch")
        os.makedirs(self.blocker)
        write(os.path.join(self.blocker, "torch.py"), b"raise ImportError('torch is hidden for this test')\n")
        self.serial = 0

    def folder(self, name):
        self.serial += 1
        path = os.path.join(self.root, f"{self.serial:03d}_{name}")
        os.makedirs(path)
        return path

    def run(self, *args, hide_torch=True):
        env = dict(os.environ)
        if hide_torch:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.blocker, env.get("PYTHONPATH")) if p)
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env,
                              timeout=120)

    def src_with_checkpoint(self, name, data):
        """A --src folder holding the real MNIST files and data as the checkpoint."""
        folder = self.folder(name)
        for f in pw.SOURCES:
            if f != pw.CHECKPOINT:
                write(os.path.join(folder, f), open(os.path.join(self.src, f), "rb").read())
        write(os.path.join(folder, pw.CHECKPOINT), data)
        return folder


def one_error_line(proc):
    """None when proc failed with exactly one 'prepare_weights.py: error: ... HINT: ...' line, else why not."""
    lines = proc.stderr.strip().splitlines()
    if proc.returncode != 1:
        return f"exit {proc.returncode}, stderr {proc.stderr[-300:]!r}"
    if len(lines) != 1 or "Traceback" in proc.stderr:
        return f"{len(lines)} lines on stderr: {proc.stderr[-300:]!r}"
    if not lines[0].startswith("prepare_weights.py: error: ") or ". HINT: " not in lines[0]:
        return f"not an error line with a hint: {lines[0]!r}"
    return None


def refusal_problem(path, *fragments):
    """None when the reader refuses path with one line naming path, a hint and every fragment, else why not."""
    try:
        pw.read_legacy_checkpoint(path)
    except pw.CheckpointError as e:
        msg = str(e)
        if not msg.startswith(f"{path}: ") or ". HINT: " not in msg or "\n" in msg:
            return f"not one line naming the file with a hint: {msg!r}"
        missing = [f for f in fragments if f not in msg]
        return f"{msg!r} lacks {missing}" if missing else None
    except Exception as e:  # anything but CheckpointError would reach the user as a traceback
        return f"{type(e).__name__} escaped: {e}"
    return "accepted"


# ----------------------------------------------------------------------------
# checks

def check_help(env):
    proc = env.run("--help")
    check("--help works without torch",
          None if proc.returncode == 0 and "--only" in proc.stdout else f"exit {proc.returncode}: {proc.stderr[-300:]}")


def check_inputs(env, state):
    what = "--only inputs without torch writes the three input files, and only them"
    out = env.folder("inputs")
    proc = env.run("--src", env.src, "--out", out, "--only", "inputs")
    if proc.returncode != 0:
        return not_ok(what, f"exit {proc.returncode}: {proc.stderr[-500:]}")
    check(what, None if sorted(os.listdir(out)) == sorted(INPUT_FILES) else f"folder holds {os.listdir(out)}")

    blob = open(os.path.join(out, "vae_weights.bin"), "rb").read()
    head = np.frombuffer(blob[:4 * pw.HEADER_INTS], dtype="<i4")
    total = sum(int(np.prod(s)) for s in pw.VAE_SHAPES.values())
    want = [pw.WEIGHTS_MAGIC, pw.VERSION, pw.INPUT_DIM, pw.HIDDEN_DIM, pw.LATENT_DIM, pw.DTYPE_FLOAT32,
            len(pw.VAE_SHAPES), total]
    problems = []
    if head[:8].tolist() != want or head[8:].any():
        problems.append(f"header {head[:8].tolist()}, expected {want} then zeros")
    if len(blob) != 4 * (pw.HEADER_INTS + total):
        problems.append(f"{len(blob)} bytes, expected {4 * (pw.HEADER_INTS + total)}")
    check("vae_weights.bin: header fields and size", "; ".join(problems) or None)

    floats = np.frombuffer(blob, dtype="<f4", offset=4 * pw.HEADER_INTS).astype(np.float32)
    offset, differ = 0, []
    for name, shape in pw.VAE_SHAPES.items():
        n = int(np.prod(shape))
        if not same_bits(floats[offset:offset + n].reshape(shape), state[name]):
            differ.append(name)
        offset += n
    check("vae_weights.bin: tensors equal the checkpoint (numpy reader) bit for bit",
          f"differ: {differ}" if differ else None)
    got = md5_of(os.path.join(out, "vae_weights.bin"))
    check("vae_weights.bin: the known conversion of the published checkpoint (MD5)",
          None if got == WEIGHTS_MD5 else f"MD5 {got}, expected {WEIGHTS_MD5}")

    differ = [name for name in INPUT_FILES[1:]
              if open(os.path.join(out, name), "rb").read() != gzip.open(os.path.join(env.src, name + ".gz")).read()]
    check("idx files: the decompressed .gz files", f"differ: {differ}" if differ else None)

    again = env.folder("inputs_again")
    proc = env.run("--src", env.src, "--out", again, "--only", "inputs")
    differ = [name for name in INPUT_FILES if not os.path.isfile(os.path.join(again, name))
              or md5_of(os.path.join(again, name)) != md5_of(os.path.join(out, name))]
    check("--only inputs twice gives identical files",
          f"exit {proc.returncode}, differ: {differ}" if proc.returncode or differ else None)


def check_without_torch(env):
    out = env.folder("default")
    proc = env.run("--src", env.src, "--out", out)
    lines = proc.stderr.strip().splitlines()
    problem = None
    if proc.returncode != 0 or sorted(os.listdir(out)) != sorted(INPUT_FILES):
        problem = f"exit {proc.returncode}, wrote {os.listdir(out)}, stderr {proc.stderr[-300:]!r}"
    elif len(lines) != 1 or "skipped" not in lines[0] or "HINT: apt-get install -y python3-torch" not in lines[0]:
        problem = f"expected one notice line with a hint, got {proc.stderr!r}"
    check("no --only, no torch: the inputs, one notice that the references were skipped, exit 0", problem)

    for args in (["--only", "references"], ["--only", "inputs", "--reference-loss"]):
        out = env.folder("needs_torch")
        proc = env.run("--src", env.src, "--out", out, *args)
        problem = one_error_line(proc) or (f"wrote {os.listdir(out)}" if os.listdir(out) else None)
        check(f"{' '.join(args)} without torch: one error line, exit 1, nothing written", problem)


def check_against_torch(env, state):
    what = "numpy reader equals torch.load, tensor by tensor, bitwise"
    if torch is None:
        return skip(what, NO_TORCH)
    ref = torch.load(env.checkpoint, map_location="cpu")
    if list(ref) != list(state):
        return not_ok(what, f"keys {list(state)}, torch.load gives {list(ref)}")
    differ = [name for name, t in ref.items() if not same_bits(state[name], t.numpy())]
    check(what, f"differ: {differ}" if differ else None)


def check_references(env):
    what = "--only references (torch) writes the two dumps, with their headers and sizes"
    if torch is None:
        return skip(what, NO_TORCH)
    out = env.folder("references")
    proc = env.run("--src", env.src, "--out", out, "--only", "references", hide_torch=False)
    if proc.returncode != 0 or sorted(os.listdir(out)) != sorted(pw.REFERENCE_FILES):
        return not_ok(what, f"exit {proc.returncode}, wrote {os.listdir(out)}: {proc.stderr[-500:]}")
    row = 784 + 20 + 400 + 20 + 20 + 20 + 400 + 784 + 784 + 1 + 1  # one image's debug tensors
    n, k, _ = pw.IWAE_CASE
    sizes = {"vae_debug_state.bin": (pw.DEBUG_MAGIC, 4 * pw.HEADER_INTS + 12 * row * sum(b for b, _ in pw.DEBUG_CASES)),
             "vae_iwae_state.bin": (pw.IWAE_MAGIC, 4 * pw.HEADER_INTS + 4 * n * k * pw.LATENT_DIM + 12 * n)}
    problems = []
    for name, (magic, size) in sizes.items():
        blob = open(os.path.join(out, name), "rb").read()
        if len(blob) != size or struct.unpack_from("<i", blob)[0] != magic:
            problems.append(f"{name}: {len(blob)} bytes, expected {size}, or a wrong magic")
    check(what, "; ".join(problems) or None)


def legacy_pickles(*objs):
    """A legacy checkpoint's first three pickles (magic number, protocol, sys_info), then objs pickled."""
    sys_info = dict(protocol_version=pw.LEGACY_PROTOCOL, little_endian=True, type_sizes=dict(short=2, int=4, long=4))
    return b"".join(pickle.dumps(o, protocol=2) for o in (pw.LEGACY_MAGIC, pw.LEGACY_PROTOCOL, sys_info, *objs))


def os_system_pickle(command):
    """A pickle of os.system(command), written opcode by opcode: GLOBAL, the argument, TUPLE1, REDUCE, STOP."""
    return b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(command)) + command.encode() + b"\x85R."


def check_damaged(env, real):
    """Damaged or foreign checkpoints that need no torch to make."""
    folder = env.folder("damaged")

    def refused(what, name, data, *fragments):
        check(f"reader refuses {what}", refusal_problem(write(os.path.join(folder, name), data), *fragments))

    refused("an empty file", "empty.pth", b"", "empty")
    refused("a zip-format file", "zip.pth", b"PK\x03\x04" + bytes(range(256)) * 4, "zip format", "legacy")
    magic = bytearray(real)
    magic[4] ^= 0xFF  # a byte inside the magic number's pickled long
    refused("a wrong magic number", "magic.pth", bytes(magic), "magic number")
    refused("bytes after the last storage", "trailing.pth", real + b"\0", "after its last storage")
    # opcodes whose argument would size an allocation: a memo slot (2**24 here, harmless were it allowed; the
    # reader must refuse 2**32 alike), a protocol-5 bytearray
    memo = legacy_pickles() + b"\x80\x02)r" + struct.pack("<I", 1 << 24) + b"."
    refused("a pickle memo slot far beyond the pickle", "memo.pth", memo, f"memo slot {1 << 24}")
    refused("a pickle opcode newer than protocol 2", "bytearray8.pth",
            legacy_pickles() + b"\x80\x05\x96" + struct.pack("<Q", 3) + b"abc.", "BYTEARRAY8")

    # every length of the first 64 bytes, points through the pickles, the storage counts and their data
    lengths = list(range(1, 64)) + list(range(64, 1600, 97)) + [len(real) * i // 16 for i in range(1, 16)]
    lengths.append(len(real) - 1)
    problems = []
    for n in lengths:
        problem = refusal_problem(write(os.path.join(folder, "truncated.pth"), real[:n]), "truncated")
        if problem:
            problems.append(f"at {n} bytes: {problem}")
    check(f"reader refuses the checkpoint truncated at each of {len(lengths)} points",
          "; ".join(problems[:3]) or None)

    marker = os.path.join(folder, "ran")
    path = write(os.path.join(folder, "evil.pth"), legacy_pickles() + os_system_pickle(f"touch {marker}"))
    problem = refusal_problem(path, "os.system", "refused")
    check("reader refuses a pickle that asks for os.system, without running it",
          problem or ("the command ran" if os.path.exists(marker) else None))

    # well-formed files made by patching the real one: fc1.bias viewed from element 1 of its 400, a NaN
    stream = io.BytesIO(real)
    for _ in range(3):  # magic number, protocol, sys_info
        for _ in pickletools.genops(stream):
            pass
    ops = list(pickletools.genops(stream))
    bias = next(i for i, (_, arg, _) in enumerate(ops) if arg == "fc1.bias")
    persid = next(i for i in range(bias, len(ops)) if ops[i][0].name == "BINPERSID")
    opcode, arg, pos = ops[persid + 1]  # the storage offset follows the storage
    if (opcode.name, arg) != ("BININT1", 0):
        not_ok("reader refuses a view past its storage's end", f"unexpected pickle layout at byte {pos}")
    else:
        shifted = bytearray(real)
        shifted[pos + 1] = 1
        refused("a view past its storage's end", "view.pth", bytes(shifted), "'fc1.bias' reaches element 400")
    refused("a non-finite value", "nan.pth", real[:-4] + struct.pack("<I", 0x7FC00000), "non-finite")


def check_torch_made(env, state):
    """Foreign and damaged state_dicts written by torch.save, and views the reader must follow."""
    whats = ["a torch.save zip-format file", "a state_dict with a key renamed", "a state_dict with a key missing",
             "a state_dict with an extra key", "a tensor of the wrong shape", "a float64 tensor"]
    if torch is None:
        for what in whats:
            skip(f"reader refuses {what}", NO_TORCH)
        return skip("reader follows strided, offset and shared-storage views", NO_TORCH)
    folder = env.folder("torch_made")
    base = collections.OrderedDict((k, torch.from_numpy(v)) for k, v in state.items())

    def variant(**changes):
        d = collections.OrderedDict(base)
        for old, new in changes.pop("rename", {}).items():
            d = collections.OrderedDict((new if k == old else k, v) for k, v in d.items())
        for k, v in changes.items():
            if v is None:
                del d[k]
            else:
                d[k] = v
        return d

    def save(name, obj, zip_format=False):
        path = os.path.join(folder, name)
        torch.save(obj, path, _use_new_zipfile_serialization=zip_format)
        return path

    cases = [
        (save("zip.pth", base, zip_format=True), ("zip format",)),
        (save("renamed.pth", variant(rename={"fc1.weight": "fc1.weights"})), ("missing ['fc1.weight']",
                                                                              "unexpected ['fc1.weights']")),
        (save("missing.pth", variant(**{"fc4.bias": None})), ("missing ['fc4.bias']",)),
        (save("extra.pth", variant(**{"fc5.weight": torch.zeros(3, 4)})), ("unexpected ['fc5.weight']",)),
        (save("shape.pth", variant(**{"fc3.weight": base["fc3.weight"].t().contiguous()})), ("'fc3.weight'", "shape")),
        (save("float64.pth", variant(**{"fc1.bias": base["fc1.bias"].double()})), ("DoubleStorage", "float32")),
    ]
    for what, (path, fragments) in zip(whats, cases):
        check(f"reader refuses {what}", refusal_problem(path, *fragments))

    # fc1.weight transposed in memory (stride (1, 400)); fc21 and fc22 weights in one storage, the
    # second at offset 8000; fc4.bias at offset 5 of a longer storage
    encoders = torch.cat([base["fc21.weight"], base["fc22.weight"]])
    views = variant(**{"fc1.weight": base["fc1.weight"].t().contiguous().t(),
                       "fc21.weight": encoders[:20], "fc22.weight": encoders[20:],
                       "fc4.bias": torch.cat([torch.zeros(5), base["fc4.bias"]])[5:]})
    what = "reader follows strided, offset and shared-storage views"
    try:
        got = pw.read_legacy_checkpoint(save("views.pth", views))
    except Exception as e:
        return not_ok(what, f"{type(e).__name__}: {e}")
    differ = [name for name in state if not same_bits(got[name], state[name])]
    check(what, f"differ: {differ}" if differ else None)


def check_cli_refusals(env, real):
    """Through the command line, a changed checkpoint in --src fails its MD5 check first: one line,
    exit 1, nothing written, and a hint that does not ask to delete what may be the user's only copy."""
    cases = {"a truncated checkpoint": real[:len(real) // 2], "a zip-format checkpoint": b"PK\x03\x04" + bytes(1000),
             "an os.system pickle as checkpoint": legacy_pickles() + os_system_pickle("true")}
    for name, data in cases.items():
        src = env.src_with_checkpoint("src", data)
        out = env.folder("out")
        proc = env.run("--src", src, "--out", out, "--only", "inputs")
        problem = one_error_line(proc)
        if problem is None and ("MD5" not in proc.stderr or "delete" in proc.stderr.lower()):
            problem = f"expected an MD5 line whose hint does not say delete: {proc.stderr.strip()!r}"
        check(f"--src with {name}: one MD5 error line without 'delete', exit 1, nothing written",
              problem or (f"wrote {os.listdir(out)}" if os.listdir(out) else None))

    what = "a failed run leaves an earlier vae_weights.bin as it was, and no temporary file"
    out = env.folder("sentinel")
    sentinel = b"earlier vae_weights.bin\n" * 100
    write(os.path.join(out, "vae_weights.bin"), sentinel)
    proc = env.run("--src", env.src_with_checkpoint("sentinel_src", real[:-1]), "--out", out, "--only", "inputs")
    after = open(os.path.join(out, "vae_weights.bin"), "rb").read()
    check(what, one_error_line(proc) or (None if after == sentinel and os.listdir(out) == ["vae_weights.bin"]
                                         else f"folder holds {os.listdir(out)}, file changed: {after != sentinel}"))


def check_replace_when_complete(env):
    folder = env.folder("replace")
    path = write(os.path.join(folder, "file.bin"), b"old")
    for error in (RuntimeError("disk full"), SystemExit(1)):  # an exception, and fail()'s exit
        try:
            with pw.replace_when_complete(path) as f:
                f.write(b"half of the new")
                raise error
        except (RuntimeError, SystemExit):
            pass
    kept = open(path, "rb").read() == b"old" and os.listdir(folder) == ["file.bin"]
    with pw.replace_when_complete(path) as f:
        f.write(b"new")
    replaced = open(path, "rb").read() == b"new" and os.listdir(folder) == ["file.bin"]
    check("an output interrupted part way leaves the earlier file and no temporary; a complete one replaces it",
          None if kept and replaced else f"kept {kept}, replaced {replaced}, folder {os.listdir(folder)}")


def main():
    p = argparse.ArgumentParser(description="Tests prepare_weights.py.")
    p.add_argument("--src", default=os.path.join(HERE, "..", "shared", "data"),
                   help="folder holding vae_epoch_25.pth and the t10k .gz files "
                        "(default: ../shared/data beside this repository)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="test_prepare_weights_") as root:
        env = Env(root, os.path.abspath(args.src))
        checks = [(check_help, ()), (check_replace_when_complete, ())]
        missing = [n for n in pw.SOURCES if not os.path.isfile(os.path.join(env.src, n))]
        if missing:
            skip("every check on the real inputs", f"{env.src} lacks {missing}")
        else:
            real = open(env.checkpoint, "rb").read()
            try:
                state = pw.read_legacy_checkpoint(env.checkpoint)
                ok("reader reads the published checkpoint")
            except Exception as e:
                not_ok("reader reads the published checkpoint", f"{type(e).__name__}: {e}")
            else:
                checks += [(check_inputs, (state,)), (check_against_torch, (state,)), (check_torch_made, (state,))]
            checks += [(check_without_torch, ()), (check_references, ()), (check_damaged, (real,)),
                       (check_cli_refusals, (real,))]
        for fn, fn_args in checks:
            try:
                fn(env, *fn_args)
            except Exception:  # a check that breaks is a failure, and the others still run
                not_ok(fn.__name__, traceback.format_exc().strip().splitlines()[-1])
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    sys.exit(1 if counts["failed"] else 0)


if __name__ == "__main__":
    main()
