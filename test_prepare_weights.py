#!/usr/bin/env python3
"""
Tests prepare_weights.py: the numpy-only inputs, the checkpoint readers (PyTorch's zip and legacy
formats, safetensors) against PyTorch and against damaged or foreign files, VAEs of other sizes of the
family, the one-line errors, and the atomic, deterministic outputs.

  python3 test_prepare_weights.py [--src ../shared/data] [--exhaustive]

Needs numpy; writes its own checkpoints of every format with a small writer of each, without torch.
Compares with PyTorch (torch.load, and files that torch.save wrote) when the running Python imports
torch, and skips those checks otherwise. The command-line runs hide torch unless they need it, so they
test the numpy-only path whatever Python runs them. Most run prepare_weights.py's main() in this
process, torch hidden by an import finder that refuses it; those that need a process of their own (no
numpy, no network, and one conversion of each format that shows that a whole run never imports torch)
run the script, torch hidden by a torch.py that raises ImportError, first on PYTHONPATH.

The corrupt-file sweep reads a fixed sample of each format's ~3,000 damaged files by default (a
quarter, the same each run); --exhaustive reads them all (about four times as long).
"""
import argparse
import collections
import contextlib
import gzip
import hashlib
import importlib.abc
import io
import json
import os
import pickle
import pickletools
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
import traceback
import zipfile

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
# MD5 of vae_weights.bin's tensor bytes (all after its 1024-byte header) as converted from the published
# checkpoint (through torch.load, before this reader existed): a value known independently of the reader
# and of the header's version, so that a reader error shows without torch too
TENSORS_MD5 = "c95f685b19a1b84b7de2ea9e5d72f1da"
# sizes of the family (H1, Z, H3) that the hand-written checkpoints hold, beside the published 400-20-400
FAMILY = [pw.Dims(512, 2, 512), pw.Dims(256, 64, 256), pw.Dims(300, 10, 500)]
SEED = 20240611
FORMATS = ["legacy", "zip", "safetensors"]

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


def read(path):
    with open(path, "rb") as f:
        return f.read()


class Env:
    """The temporary folders and the command-line runner shared by the checks."""

    def __init__(self, root, src):
        self.root, self.src = root, src
        self.checkpoint = os.path.join(src, pw.CHECKPOINT)
        # a torch.py that refuses to import, and records that something tried to when TORCH_TRIPWIRE names a file
        self.blocker = os.path.join(root, "no_torch")
        os.makedirs(self.blocker)
        write(os.path.join(self.blocker, "torch.py"),
              b"import os\nif os.environ.get('TORCH_TRIPWIRE'):\n    open(os.environ['TORCH_TRIPWIRE'], 'a').close()\n"
              b"raise ImportError('torch is hidden for this test')\n")
        self.no_numpy = os.path.join(root, "no_numpy")
        os.makedirs(self.no_numpy)
        write(os.path.join(self.no_numpy, "numpy.py"), b"raise ImportError('numpy is hidden for this test')\n")
        self.serial = 0

    def folder(self, name):
        self.serial += 1
        path = os.path.join(self.root, f"{self.serial:03d}_{name}")
        os.makedirs(path)
        return path

    def run(self, *args, hide_torch=True, hide_numpy=False, cwd=None, tripwire=None, process=False, path=None):
        """prepare_weights.py with args, torch hidden unless hide_torch is false: in this process, or, when it
        needs one (process; hide_numpy; path, a folder put first on PATH), as a process of its own. Either
        way a subprocess.CompletedProcess, and tripwire (a file's name) is created if it tried to import torch."""
        if not (process or hide_numpy or path):
            return self.run_here(args, hide_torch, cwd, tripwire)
        env = dict(os.environ)
        hidden = [self.blocker] if hide_torch else []
        hidden += [self.no_numpy] if hide_numpy else []
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*hidden, env.get("PYTHONPATH")) if p)
        if tripwire:
            env["TORCH_TRIPWIRE"] = tripwire
        if path:
            env["PATH"] = os.pathsep.join((path, env.get("PATH", "")))
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env,
                              timeout=120, cwd=cwd)

    @staticmethod
    def run_here(args, hide_torch, cwd, tripwire):
        """main() with args in this process, as the script runs it: its output, and its exit status and any
        traceback as a process of its own would give them. Spawning one costs ~0.3 s (Python and numpy start)."""
        stdout, stderr, code = io.StringIO(), io.StringIO(), 0
        argv, here = sys.argv, os.getcwd()
        with contextlib.ExitStack() as stack:
            blocker = stack.enter_context(torch_hidden()) if hide_torch else None
            stack.enter_context(contextlib.redirect_stdout(stdout))
            stack.enter_context(contextlib.redirect_stderr(stderr))
            sys.argv = [SCRIPT, *args]
            try:
                if cwd:
                    os.chdir(cwd)
                pw.main()
            except SystemExit as e:  # sys.exit's conventions: None is 0, another non-int is printed and is 1
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except Exception:
                traceback.print_exc()
                code = 1
            finally:
                sys.argv = argv
                os.chdir(here)
        if tripwire and blocker and blocker.tried:
            open(tripwire, "a").close()
        return subprocess.CompletedProcess([sys.executable, SCRIPT, *args], code, stdout.getvalue(), stderr.getvalue())

    def src_with_checkpoint(self, name, data):
        """A --src folder holding the real MNIST files and data as the checkpoint."""
        folder = self.folder(name)
        for f in pw.SOURCES:
            if f != pw.CHECKPOINT:
                write(os.path.join(folder, f), read(os.path.join(self.src, f)))
        write(os.path.join(folder, pw.CHECKPOINT), data)
        return folder


class TorchRefused(importlib.abc.MetaPathFinder):
    """Refuses to import torch (and its submodules) in this process, as the torch.py blocker does in a process of
    its own, and records that something tried."""

    def __init__(self):
        self.tried = False

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            self.tried = True
            raise ImportError("torch is hidden for this test")
        return None


@contextlib.contextmanager
def torch_hidden():
    """torch unimportable in this process inside the block, even when this test has imported it: its modules leave
    sys.modules for the block, and a TorchRefused comes first on sys.meta_path."""
    blocker = TorchRefused()
    held = {name: sys.modules.pop(name) for name in list(sys.modules) if name.partition(".")[0] == "torch"}
    sys.meta_path.insert(0, blocker)
    try:
        yield blocker
    finally:
        sys.meta_path.remove(blocker)
        sys.modules.update(held)
        pw.python_with_torch.cache_clear()  # it found no torch here: not so outside the block


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
        pw.read_checkpoint(path)
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
# checkpoints of every format, written without torch
#
# A tensor to write is a Raw: a dtype name of prepare_weights.py's and its raw values (bfloat16 as its
# uint16 bits). The pickle formats hold any object built of dicts, lists, tuples, strings, numbers, None,
# Raw tensors and Global references; a dict of Raws is written as the OrderedDict that state_dict() gives.

Raw = collections.namedtuple("Raw", "dtype values")
Global = collections.namedtuple("Global", "module name")  # a class or function the pickle asks for, by name
STORAGE_NAMES = {dtype: name for name, dtype in pw.STORAGE_DTYPES.items()}
SAFETENSORS_NAMES = {dtype: name for name, dtype in pw.SAFETENSORS_DTYPES.items()}
NUMPY_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "float64": "<f8", "int64": "<i8"}


class PickleWriter:
    """Writes one protocol-2 pickle opcode by opcode, as torch.save does for a state_dict; each Raw becomes a
    storage of its own, its persistent id ('storage', torch.<Type>Storage, key, 'cpu', numel[, None])."""

    def __init__(self, legacy, tweak=None):
        self.out = bytearray(b"\x80\x02")
        self.legacy, self.storages = legacy, []  # (key, Raw) in the order the pickle names them
        self.tweak = tweak  # tweak(index, fields) -> the fields the pickle gives the tensor of that index

    def dump(self, obj):
        self.value(obj)
        self.out += b"."
        return bytes(self.out)

    def global_(self, module, name):
        self.out += b"c" + f"{module}\n{name}\n".encode()

    def value(self, v):
        if isinstance(v, Raw):
            self.tensor(v)
        elif isinstance(v, Global):
            self.global_(v.module, v.name)
        elif v is None:
            self.out += b"N"
        elif isinstance(v, bool):
            self.out += b"\x88" if v else b"\x89"
        elif isinstance(v, int) and -2 ** 31 <= v < 2 ** 31:
            self.out += b"J" + struct.pack("<i", v)
        elif isinstance(v, int):
            data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(data)]) + data
        elif isinstance(v, float):
            self.out += b"G" + struct.pack(">d", v)
        elif isinstance(v, str):
            data = v.encode()
            self.out += b"X" + struct.pack("<I", len(data)) + data
        elif isinstance(v, tuple):
            self.out += b"("
            for item in v:
                self.value(item)
            self.out += b"t"
        elif isinstance(v, list):
            self.out += b"]("
            for item in v:
                self.value(item)
            self.out += b"e"
        elif isinstance(v, dict):
            if all(isinstance(item, Raw) for item in v.values()):  # a state_dict: an OrderedDict
                self.global_("collections", "OrderedDict")
                self.out += b")R"
            else:
                self.out += b"}"
            self.out += b"("
            for key, item in v.items():
                self.value(key)
                self.value(item)
            self.out += b"u"
        else:
            raise TypeError(f"the test's pickle writer cannot write a {type(v).__name__}")

    def tensor(self, raw):
        key = str(len(self.storages)) if not self.legacy else str(140000000 + len(self.storages))
        self.storages.append((key, raw))
        shape = raw.values.shape
        fields = dict(type=Global("torch", STORAGE_NAMES[raw.dtype]), key=key, location="cpu", numel=raw.values.size,
                      offset=0, size=tuple(shape), stride=tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))),
                      requires_grad=False)
        if self.tweak:
            fields = self.tweak(len(self.storages) - 1, fields)
        # _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks)
        self.global_("torch._utils", "_rebuild_tensor_v2")
        self.out += b"(("
        for item in ("storage", fields["type"], fields["key"], fields["location"], fields["numel"]):
            self.value(item)
        self.out += b"Nt" if self.legacy else b"t"
        self.out += b"Q"
        for name in ("offset", "size", "stride", "requires_grad"):
            self.value(fields[name])
        self.global_("collections", "OrderedDict")
        self.out += b")Rt" + b"R"


def raw_bytes(raw):
    return np.ascontiguousarray(raw.values).astype(NUMPY_DTYPES[raw.dtype]).tobytes()


def legacy_pickles(*objs):
    """A legacy checkpoint's first three pickles (magic number, protocol, sys_info), then objs pickled."""
    sys_info = dict(protocol_version=pw.LEGACY_PROTOCOL, little_endian=True, type_sizes=dict(short=2, int=4, long=4))
    return b"".join(pickle.dumps(o, protocol=2) for o in (pw.LEGACY_MAGIC, pw.LEGACY_PROTOCOL, sys_info, *objs))


def legacy_file(obj, tweak=None):
    """obj as torch.save(obj, f, _use_new_zipfile_serialization=False) writes it."""
    writer = PickleWriter(legacy=True, tweak=tweak)
    state = writer.dump(obj)
    keys = [key for key, _ in writer.storages]
    data = b"".join(struct.pack("<q", raw.values.size) + raw_bytes(raw) for _, raw in writer.storages)
    return legacy_pickles() + state + pickle.dumps(keys, protocol=2) + data


def zip_file(obj, folder="archive", byteorder=True, pkl=None, tweak=None):
    """obj as torch.save(obj, f) writes it: an uncompressed zip of folder/data.pkl and each storage's data;
    pkl, when given, replaces the pickle."""
    writer = PickleWriter(legacy=False, tweak=tweak)
    data_pkl = writer.dump(obj) if pkl is None else pkl
    records = [("data.pkl", data_pkl)] + ([("byteorder", b"little")] if byteorder else [])
    records += [(f"data/{key}", raw_bytes(raw)) for key, raw in writer.storages] + [("version", b"3\n")]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(zipfile.ZipInfo(f"{folder}/{name}", date_time=(1980, 1, 1, 0, 0, 0)), data)
    return out.getvalue()


def safetensors_file(tensors, metadata=None, header=None):
    """{name: Raw} as safetensors' save_file writes them: a u64 header length, the JSON header padded with
    spaces to 8 bytes, the data in the header's order; header, when given, replaces the computed one."""
    entries, data, offset = {}, [], 0
    for name, raw in sorted(tensors.items()):
        values = raw_bytes(raw)
        entries[name] = dict(dtype=SAFETENSORS_NAMES[raw.dtype], shape=list(raw.values.shape),
                             data_offsets=[offset, offset + len(values)])
        data.append(values)
        offset += len(values)
    if metadata is not None:
        entries = {"__metadata__": metadata, **entries}
    text = json.dumps(entries if header is None else header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(data)


def checkpoint_file(fmt, obj):
    """obj in one of FORMATS; safetensors holds only a flat {name: Raw}."""
    return {"legacy": legacy_file, "zip": zip_file, "safetensors": safetensors_file}[fmt](obj)


def random_vae(dims, seed):
    """A VAE of the family with reproducible float32 weights of a trained model's scale."""
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * 0.05).astype(np.float32)
            for name, shape in pw.vae_shapes(dims).items()}


def as_raw(vae, dtype="float32"):
    """{name: Raw} of float32 weights in dtype; bfloat16 keeps each value's upper 16 bits."""
    if dtype == "bfloat16":
        return {name: Raw(dtype, (v.view(np.uint32) >> 16).astype(np.uint16)) for name, v in vae.items()}
    return {name: Raw(dtype, v.astype(NUMPY_DTYPES[dtype])) for name, v in vae.items()}


def as_float32(raws):
    """What the converter should make of {name: Raw}: float32 values, bfloat16's bits shifted up by 16."""
    return {name: (r.values.astype(np.uint32) << 16).view(np.float32) if r.dtype == "bfloat16"
            else r.values.astype(np.float32) for name, r in raws.items()}


def weights_file(vae):
    """vae_weights.bin's version-2 bytes for {name: float32 array}, written here independently of
    prepare_weights.py: 256 int32 of header, then the tensors in their order."""
    h1, z, h3 = vae["fc1.weight"].shape[0], vae["fc21.weight"].shape[0], vae["fc3.weight"].shape[0]
    order = ["fc1.weight", "fc1.bias", "fc21.weight", "fc21.bias", "fc22.weight", "fc22.bias",
             "fc3.weight", "fc3.bias", "fc4.weight", "fc4.bias"]
    total = sum(vae[name].size for name in order)
    head = [0x31454156, 2, 784, h1, z, 1, 10, total, h3] + [0] * 247
    return struct.pack("<256i", *head) + b"".join(vae[name].astype("<f4").tobytes() for name in order)


def state_problem(got, want):
    """None when the reader's {name: array} equals want ({name: float32 array}) bit for bit, in order."""
    if list(got) != list(want):
        return f"keys {list(got)}, expected {list(want)}"
    differ = [name for name in want if not same_bits(got[name], want[name])]
    return f"differ: {differ}" if differ else None


# ----------------------------------------------------------------------------
# checks

def check_help(env):
    for what, hide_numpy in (("torch", False), ("numpy or torch", True)):
        proc = env.run("--help", hide_numpy=hide_numpy, process=True)
        check(f"--help works without {what}",
              None if proc.returncode == 0 and "--checkpoint" in proc.stdout
              else f"exit {proc.returncode}: {proc.stderr[-300:]}")
    # the Pythons it looks for numpy in inherit the PYTHONPATH that hides numpy: none has it, so the hint installs it
    proc = env.run("--checkpoint", "x.pt", hide_numpy=True)
    lines = proc.stderr.strip().splitlines()
    want = f"has no numpy. HINT: {sys.executable} -m pip install numpy, or apt-get install -y python3-numpy"
    check("without numpy, and no Python found that has it: one error line whose hint installs numpy for this "
          "Python, exit 1", None if proc.returncode == 1 and len(lines) == 1 and lines[0].endswith(want)
          and "make data" not in lines[0] else f"exit {proc.returncode}: {proc.stderr[-300:]!r}")

    # a python3 first on PATH that has numpy (this Python, PYTHONPATH unset): the hint is the command again with
    # it, the user's arguments quoted for the shell, and it runs as written
    what = ("without numpy, with a python3 on PATH that has it: the hint gives the same command with that python3, "
            "which converts as written")
    folder = env.folder("numpy_elsewhere")
    bin_dir = os.path.join(folder, "bin")
    os.makedirs(bin_dir)
    fake = write(os.path.join(bin_dir, "python3"), f"#!/bin/sh\nunset PYTHONPATH\nexec {shlex.quote(sys.executable)} "
                                                   f'"$@"\n'.encode())
    os.chmod(fake, 0o755)
    vae = random_vae(FAMILY[0], SEED)
    args = ["--checkpoint", write(os.path.join(folder, "my vae.pt"), zip_file(as_raw(vae))),
            "--out", os.path.join(folder, "it's out", "my vae.bin")]
    proc = env.run(*args, hide_numpy=True, path=bin_dir)
    command = shlex.join(["python3", SCRIPT, *args])
    if one_error_line(proc) or not proc.stderr.strip().endswith(f"HINT: python3 has numpy: {command}"):
        return not_ok(what, f"expected the hint 'python3 has numpy: {command}', got {proc.stderr.strip()!r}")
    ran = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PATH=os.pathsep.join((bin_dir, os.environ.get("PATH", ""))),
                                  PYTHONPATH=env.no_numpy))
    check(what, f"exit {ran.returncode}: {ran.stderr[-300:]!r}" if ran.returncode else
          None if read(args[-1]) == weights_file(vae) else "converted to another file")


def check_inputs(env, state):
    what = "--only inputs without torch writes the three input files, and only them"
    out = env.folder("inputs")
    proc = env.run("--src", env.src, "--out", out, "--only", "inputs")
    if proc.returncode != 0:
        return not_ok(what, f"exit {proc.returncode}: {proc.stderr[-500:]}")
    check(what, None if sorted(os.listdir(out)) == sorted(INPUT_FILES) else f"folder holds {os.listdir(out)}")

    blob = read(os.path.join(out, "vae_weights.bin"))
    head = np.frombuffer(blob[:4 * pw.HEADER_INTS], dtype="<i4")
    shapes = pw.vae_shapes(pw.PUBLISHED_DIMS)
    total = sum(int(np.prod(s)) for s in shapes.values())
    want = [0x31454156, 2, 784, 400, 20, 1, 10, total, 400]
    problems = []
    if head[:9].tolist() != want or head[9:].any():
        problems.append(f"header {head[:9].tolist()}, expected {want} then zeros")
    if len(blob) != 4 * (pw.HEADER_INTS + total):
        problems.append(f"{len(blob)} bytes, expected {4 * (pw.HEADER_INTS + total)}")
    check("vae_weights.bin: version-2 header fields (H1 = H3 = 400, Z = 20) and size", "; ".join(problems) or None)

    floats = np.frombuffer(blob, dtype="<f4", offset=4 * pw.HEADER_INTS).astype(np.float32)
    offset, differ = 0, []
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        if not same_bits(floats[offset:offset + n].reshape(shape), state[name]):
            differ.append(name)
        offset += n
    check("vae_weights.bin: tensors equal the checkpoint (numpy reader) bit for bit",
          f"differ: {differ}" if differ else None)
    got = hashlib.md5(blob[4 * pw.HEADER_INTS:]).hexdigest()
    check("vae_weights.bin: the known conversion of the published checkpoint (MD5 of the tensors after the header)",
          None if got == TENSORS_MD5 else f"MD5 {got}, expected {TENSORS_MD5}")
    check("vae_weights.bin: the bytes that this test's own writer makes of the checkpoint's tensors",
          None if blob == weights_file(state) else "differ")

    differ = [name for name in INPUT_FILES[1:]
              if read(os.path.join(out, name)) != gzip.open(os.path.join(env.src, name + ".gz")).read()]
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
             "vae_iwae_state.bin": (pw.IWAE_MAGIC, 4 * pw.HEADER_INTS + 4 * n * k * 20 + 12 * n)}
    problems = []
    for name, (magic, size) in sizes.items():
        blob = read(os.path.join(out, name))
        head = list(struct.unpack_from("<9i", blob))
        h3 = head[6] if magic == pw.DEBUG_MAGIC else head[8]
        if len(blob) != size or head[:5] != [magic, 1, 784, 400, 20] or h3 != 400:
            problems.append(f"{name}: {len(blob)} bytes, expected {size}; header {head}")
    check(what, "; ".join(problems) or None)


def dump_problems(folder, name, dims):
    """Why the weights file and the two dumps NAME*.bin in folder are not those of a VAE of dims (their headers and
    sizes, from the formats as documented), or an empty list."""
    n, k, first = pw.IWAE_CASE
    row = 784 + dims.z + dims.h1 + 3 * dims.z + dims.h3 + 2 * 784 + 2  # x eps h1 mu logvar z h3 logits recon bce kl
    cases = [v for b, f in pw.DEBUG_CASES for v in (b, f)]
    total = 784 * dims.h1 + dims.h1 + 2 * (dims.h1 * dims.z + dims.z) + dims.z * dims.h3 + dims.h3 + dims.h3 * 784 + 784
    expected = {  # suffix: (the first header ints, size)
        ".bin": ([0x31454156, 2, 784, dims.h1, dims.z, 1, 10, total, dims.h3], 1024 + 4 * total),
        "_debug_state.bin": ([0x44454156, 1, 784, dims.h1, dims.z, len(pw.DEBUG_CASES), dims.h3, 0] + cases,
                             1024 + 12 * row * sum(cases[::2])),
        "_iwae_state.bin": ([0x49454156, 1, 784, dims.h1, dims.z, n, k, first, dims.h3],
                            1024 + 4 * n * k * dims.z + 12 * n),
    }
    problems = []
    for suffix, (head, size) in expected.items():
        blob = read(os.path.join(folder, name + suffix))
        got = list(struct.unpack_from(f"<{len(head)}i", blob))
        rest = set(struct.unpack_from(f"<{256 - len(head)}i", blob, 4 * len(head)))
        if got != head or rest != {0} or len(blob) != size:
            problems.append(f"{name}{suffix}: header {got} (rest {sorted(rest)[:4]}), {len(blob)} bytes; expected "
                            f"{head}, {size} bytes")
    return problems


def check_family_cli(env):
    """--family's refusals, without torch: one error line each, nothing written."""
    for args, what in ((["--family"], "--family without torch"),
                       (["--family", "--checkpoint", env.checkpoint], "--family with --checkpoint"),
                       (["--family", "--only", "inputs"], "--family with --only")):
        out = env.folder("family_refused")
        proc = env.run(*args, "--out", os.path.join(out, "family"), cwd=out)
        problem = one_error_line(proc) or (f"wrote {os.listdir(out)}" if os.listdir(out) else None)
        check(f"{what}: one error line, exit 1, nothing written", problem)


def check_all_or_nothing(env):
    folder = env.folder("all_or_nothing")
    paths = [write(os.path.join(folder, name), b"old") for name in ("a.bin", "b.bin")]
    try:
        with pw.all_or_nothing():
            for path in paths:
                with pw.replace_when_complete(path) as f:
                    f.write(b"new")
            raise RuntimeError("the last output failed")
    except RuntimeError:
        pass
    kept = [read(p) for p in paths] == [b"old", b"old"] and sorted(os.listdir(folder)) == ["a.bin", "b.bin"]
    with pw.all_or_nothing():
        for path in paths:
            with pw.replace_when_complete(path) as f:
                f.write(b"new")
            held = read(path) == b"old"
    replaced = (held and [read(p) for p in paths] == [b"new", b"new"]
                and sorted(os.listdir(folder)) == ["a.bin", "b.bin"])
    check("all_or_nothing: outputs complete in a failed block leave every earlier file and no temporary; in a "
          "complete block they take their places at its end", None if kept and replaced else
          f"kept {kept}, replaced {replaced}, folder {os.listdir(folder)}")


def check_family_files(env):
    """--family's twelve files (untrained models: FAMILY_EPOCHS = 0, for speed): their headers and sizes, each .pth
    converting without torch to its .bin byte for byte; and a failure part way leaves nothing."""
    what = "--family's files: weights and dump headers carry 784/H1/Z and H3, sizes match, .pth -> .bin bitwise"
    failed = "--family failing part way (the last dump) leaves no file, temporary or folder"
    if torch is None:
        return skip(what, NO_TORCH), skip(failed, NO_TORCH)
    folder = env.folder("family_dumps")
    images = write(os.path.join(folder, "t10k-images-idx3-ubyte"),
                   gzip.decompress(read(os.path.join(env.src, "t10k-images-idx3-ubyte.gz"))))
    epochs, pw.FAMILY_EPOCHS = pw.FAMILY_EPOCHS, 0
    try:
        out = os.path.join(folder, "family")
        with contextlib.redirect_stdout(io.StringIO()):  # its 'wrote' lines
            pw.make_family(out, images)
        names = [pw.family_name(d) for d in pw.FAMILY_DIMS]
        problems = []
        if sorted(os.listdir(out)) != sorted(n + s for n in names for s in pw.FAMILY_SUFFIXES):
            problems.append(f"wrote {sorted(os.listdir(out))}")
        for name, dims in zip(names, pw.FAMILY_DIMS):
            problems += dump_problems(out, name, dims)
            problem, got = convert(env, os.path.join(out, name + ".pth"), os.path.join(folder, name + ".bin"))
            if problem or got != read(os.path.join(out, name + ".bin")):
                problems.append(f"{name}.pth: {problem or 'converts to another file than ' + name + '.bin'}")
        check(what, "; ".join(problems) or None)

        def broken(*_):
            raise RuntimeError("disk full")
        write_iwae_state, pw.write_iwae_state = pw.write_iwae_state, broken
        out = os.path.join(folder, "failed", "family")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                pw.make_family(out, images)
        except RuntimeError:
            pass
        finally:
            pw.write_iwae_state = write_iwae_state
        # folders_for removes the folders it made only when they are empty: no file and no temporary stayed
        check(failed, f"left {os.listdir(os.path.dirname(out))}" if os.path.exists(os.path.dirname(out)) else None)
    finally:
        pw.FAMILY_EPOCHS = epochs


def os_system_pickle(command):
    """A pickle of os.system(command), written opcode by opcode: GLOBAL, the argument, TUPLE1, REDUCE, STOP."""
    return b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(command)) + command.encode() + b"\x85R."


def check_damaged(env, real):
    """Damaged or foreign legacy checkpoints that need no torch to make."""
    folder = env.folder("damaged")

    def refused(what, name, data, *fragments):
        check(f"reader refuses {what}", refusal_problem(write(os.path.join(folder, name), data), *fragments))

    refused("an empty file", "empty.pth", b"", "empty")
    refused("a file that starts as a zip archive but is none", "zip.pth", b"PK\x03\x04" + bytes(range(256)) * 4,
            "zip archive", "truncated or damaged")
    magic = bytearray(real)
    magic[4] ^= 0xFF  # a byte inside the magic number's pickled long
    refused("a wrong magic number", "magic.pth", bytes(magic), "magic number")
    refused("bytes after the last storage", "trailing.pth", real + b"\0", "after its last storage")
    # opcodes whose argument would size an allocation: a memo slot (2**24 here, harmless were it allowed; the
    # reader must refuse 2**32 alike), a protocol-5 bytearray
    memo = legacy_pickles() + b"\x80\x02)r" + struct.pack("<I", 1 << 24) + b"."
    refused("a pickle memo slot far beyond the pickle", "memo.pth", memo, f"memo slot {1 << 24}")
    # a pickle of a newer protocol than torch.save's default: said in words, with the command that saves it again
    resave = ("HINT: save it again with that default: ", '-c \'import torch; torch.save(torch.load("')
    refused("a protocol-5 pickle (a bytearray8)", "bytearray8.pth",
            legacy_pickles() + b"\x80\x05\x96" + struct.pack("<Q", 3) + b"abc.",
            "it was saved with pickle protocol 5, and this converter reads only protocol 2", *resave)
    refused("a protocol-4 pickle", "protocol4.pth", legacy_pickles() + pickle.dumps({"epoch": 1}, protocol=4),
            "it was saved with pickle protocol 4, and this converter reads only protocol 2", *resave)

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
        refused("a view past its storage's end", "view.pth", bytes(shifted), "fc1.bias reaches element 400")
    # the file's last storage is fc22.weight's
    refused("a non-finite value", "nan.pth", real[:-4] + struct.pack("<I", 0x7FC00000),
            "fc22.weight[19, 399] is nan", "non-finite")


def check_torch_made(env, state):
    """Foreign and damaged state_dicts written by torch.save, and views the reader must follow."""
    whats = ["a state_dict with a key renamed", "a state_dict with a key missing", "a state_dict with an extra key",
             "a tensor of the wrong shape", "an int64 tensor", "a whole model rather than its state_dict"]
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
        (save("renamed.pth", variant(rename={"fc1.weight": "fc1.weights"})), ("missing ['fc1.weight']",
                                                                              "unexpected ['fc1.weights']")),
        (save("missing.pth", variant(**{"fc4.bias": None}), zip_format=True), ("missing ['fc4.bias']",)),
        (save("extra.pth", variant(**{"fc5.weight": torch.zeros(3, 4)})), ("unexpected ['fc5.weight']",)),
        (save("shape.pth", variant(**{"fc3.weight": base["fc3.weight"].t().contiguous()}), zip_format=True),
         ("fc3.weight has shape [20, 400], expected [H3, Z] = [20, 20] (Z from fc21.weight)",)),
        (save("int64.pth", variant(**{"fc1.bias": base["fc1.bias"].long()})), ("fc1.bias has dtype int64",)),
        (save("model.pth", torch.nn.Sequential(torch.nn.Linear(2, 2)), zip_format=True),
         ("torch.nn.modules.container.Sequential", "refused")),
    ]
    for what, (path, fragments) in zip(whats, cases):
        check(f"reader refuses {what}", refusal_problem(path, *fragments))

    # fc1.weight transposed in memory (stride (1, 400)); fc21 and fc22 weights in one storage, the
    # second at offset 8000; fc4.bias at offset 5 of a longer storage
    encoders = torch.cat([base["fc21.weight"], base["fc22.weight"]])
    views = variant(**{"fc1.weight": base["fc1.weight"].t().contiguous().t(),
                       "fc21.weight": encoders[:20], "fc22.weight": encoders[20:],
                       "fc4.bias": torch.cat([torch.zeros(5), base["fc4.bias"]])[5:]})
    for zip_format in (False, True):
        what = f"reader follows strided, offset and shared-storage views ({'zip' if zip_format else 'legacy'} format)"
        try:
            got = pw.read_checkpoint(save(f"views_{zip_format}.pth", views, zip_format))
        except Exception as e:
            not_ok(what, f"{type(e).__name__}: {e}")
            continue
        check(what, state_problem(got, state))


def check_resave_hint(env, state):
    """A state_dict that torch.save wrote with pickle_protocol=4 is refused, and the hint's command, run as written
    in a shell, saves the file again as one that converts to the same weights."""
    what = "a protocol-4 torch.save: the hint's command, run as written, saves it again as a file that converts"
    if torch is None:
        return skip(what, NO_TORCH)
    folder = env.folder("resave")
    path = os.path.join(folder, "it's protocol 4.pth")  # a space and a quote, for the shell and for Python
    torch.save(collections.OrderedDict((k, torch.from_numpy(v)) for k, v in state.items()), path, pickle_protocol=4)
    try:
        pw.read_checkpoint(path)
        return not_ok(what, "accepted")
    except pw.CheckpointError as e:
        msg = str(e)
    _, _, hint = msg.partition("HINT: save it again with that default: ")
    command, _, converted = hint.partition("; then convert ")
    out = os.path.join(folder, "it's protocol 4_protocol2.pth")
    if not command or converted != shlex.quote(out):
        return not_ok(what, f"no command and file to convert in {msg!r}")
    ran = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300)
    if ran.returncode:
        return not_ok(what, f"{command} exited {ran.returncode}: {ran.stderr[-300:]!r}")
    try:
        check(what, state_problem(pw.read_checkpoint(out), state))
    except pw.CheckpointError as e:
        not_ok(what, str(e))


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
    after = read(os.path.join(out, "vae_weights.bin"))
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
    kept = read(path) == b"old" and os.listdir(folder) == ["file.bin"]
    with pw.replace_when_complete(path) as f:
        f.write(b"new")
    replaced = read(path) == b"new" and os.listdir(folder) == ["file.bin"]
    check("an output interrupted part way leaves the earlier file and no temporary; a complete one replaces it",
          None if kept and replaced else f"kept {kept}, replaced {replaced}, folder {os.listdir(folder)}")

    # the folders a new output needs: removed again when the block fails, kept when it completes
    path = os.path.join(folder, "new", "sub", "file.bin")
    for error in (RuntimeError("disk full"), SystemExit(1)):
        try:
            with pw.folders_for(path), pw.replace_when_complete(path) as f:
                f.write(b"half")
                raise error
        except (RuntimeError, SystemExit):
            pass
    removed = sorted(os.listdir(folder)) == ["file.bin"]
    with pw.folders_for(path), pw.replace_when_complete(path) as f:
        f.write(b"new")
    check("the folders an output needs are removed when it fails part way, and kept when it completes",
          None if removed and read(path) == b"new" and os.listdir(os.path.dirname(path)) == ["file.bin"]
          else f"removed {removed}, folder {os.listdir(folder)}")


# ----------------------------------------------------------------------------
# --checkpoint: other sizes, formats, structures and dtypes

def convert(env, path, out, **kwargs):
    """Runs --checkpoint path --out out with torch hidden; returns (problem or None, the output's bytes)."""
    tripwire = os.path.join(env.root, "torch_imported")
    proc = env.run("--checkpoint", path, "--out", out, tripwire=tripwire, **kwargs)
    if os.path.exists(tripwire):
        os.remove(tripwire)
        return "it tried to import torch", None
    if proc.returncode != 0 or proc.stderr or not os.path.isfile(out):
        return f"exit {proc.returncode}: {proc.stderr[-300:]!r}", None
    return None, read(out)


def check_offline(env):
    """A run that cannot download (a proxy on a closed port stands in for no network) stops in one line with the
    --src hint, and leaves neither its --out folder nor a downloads/ folder behind."""
    out = os.path.join(env.folder("offline"), "new", "data")
    proc = subprocess.run([sys.executable, SCRIPT, "--only", "inputs", "--out", out], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, https_proxy="http://127.0.0.1:9",
                                                HTTPS_PROXY="http://127.0.0.1:9", no_proxy="", NO_PROXY=""))
    lines = proc.stderr.strip().splitlines()
    left = os.path.exists(os.path.dirname(out))
    check("offline, a download fails in one line naming --src, and leaves no --out or downloads/ folder",
          None if proc.returncode == 1 and len(lines) == 1 and "--src FOLDER" in lines[0] and not left
          else f"exit {proc.returncode}, {os.path.dirname(out)} {'left' if left else 'gone'}: {proc.stderr[-300:]!r}")


def check_family(env):
    """VAEs of other sizes, each written in the three formats: all convert to the same file, the right one. The
    first size's three run as processes of their own, so that an import of torch anywhere in the script shows."""
    folder = env.folder("family")
    for i, dims in enumerate(FAMILY):
        vae = random_vae(dims, SEED + i)
        name = f"784-{dims.h1}-{dims.z}-{dims.h3}"
        want = weights_file(vae)
        problems = []
        for fmt in FORMATS:
            path = write(os.path.join(folder, f"{name}.{fmt}"), checkpoint_file(fmt, as_raw(vae)))
            problem, got = convert(env, path, os.path.join(folder, f"{name}_{fmt}.bin"), process=i == 0)
            if problem or got != want:
                problems.append(f"{fmt}: {problem or 'differs from the expected file'}")
        check(f"{name}: legacy, zip and safetensors convert, without torch{' (as a process)' if i == 0 else ''}, "
              f"to one file: its header (H1 {dims.h1}, Z {dims.z}, H3 {dims.h3}) and tensors",
              "; ".join(problems) or None)
        if i == 0:
            what = f"{name}: the reader's tensors and dims from each format"
            problems = [f"{fmt}: {state_problem(pw.read_checkpoint(os.path.join(folder, f'{name}.{fmt}')), vae)}"
                        for fmt in FORMATS]
            dims_read = pw.dims_of(pw.read_checkpoint(os.path.join(folder, f"{name}.zip")))
            problems = [p for p in problems if not p.endswith(": None")]
            check(what, "; ".join(problems) or (None if dims_read == dims else f"dims {dims_read}"))

    # without --out: data/<the checkpoint's name without its suffix>.bin, data/ made for it
    cwd = env.folder("default_out")
    vae = random_vae(FAMILY[2], SEED + 2)
    path = write(os.path.join(folder, "my_vae.v3.pt"), zip_file(as_raw(vae)))
    proc = env.run("--checkpoint", path, cwd=cwd)
    out = os.path.join(cwd, "data", "my_vae.v3.bin")
    check("--checkpoint without --out writes data/<its stem>.bin, creating data/, and nothing else",
          f"exit {proc.returncode}: {proc.stderr[-300:]!r}" if proc.returncode else
          None if os.listdir(cwd) == ["data"] and os.listdir(os.path.join(cwd, "data")) == ["my_vae.v3.bin"]
          and read(out) == weights_file(vae) else f"wrote {os.listdir(cwd)}")


def check_structures(env):
    """Wrappers, the DataParallel prefix and every dtype, in each format that can hold them."""
    folder = env.folder("structures")
    vae = random_vae(pw.Dims(48, 5, 40), SEED + 10)
    raws = as_raw(vae)
    optimizer = {"state": {0: {"step": Raw("int64", np.array(3, dtype=np.int64)),
                               "exp_avg": Raw("float32", np.zeros((48, 784), np.float32))}},
                 "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "amsgrad": False,
                                   "foreach": None, "params": [0, 1, 2]}]}
    prefixed = {"module." + name: raw for name, raw in raws.items()}
    cases = [
        ("a bare state_dict", raws),
        ("'state_dict' beside epoch, loss, optimizer", {"epoch": 25, "loss": 103.5, "state_dict": raws,
                                                        "optimizer": optimizer, "note": "run 7"}),
        ("'model' beside epoch and an int64 tensor", {"model": raws, "epoch": 3, "seen": Raw("int64", np.arange(4))}),
        ("keys prefixed 'module.' (DataParallel)", prefixed),
        ("'state_dict' holding keys prefixed 'module.'", {"state_dict": prefixed, "epoch": 1, "big": 1 << 70}),
    ]
    for what, obj in cases:
        for fmt in ("legacy", "zip"):
            path = write(os.path.join(folder, f"case.{fmt}"), checkpoint_file(fmt, obj))
            try:
                check(f"reader takes {what} ({fmt})", state_problem(pw.read_checkpoint(path), vae))
            except pw.CheckpointError as e:
                not_ok(f"reader takes {what} ({fmt})", str(e))
    path = write(os.path.join(folder, "prefixed.safetensors"),
                 safetensors_file(prefixed, metadata={"format": "pt", "epoch": "25"}))
    try:
        check("reader takes keys prefixed 'module.' and __metadata__ (safetensors)",
              state_problem(pw.read_checkpoint(path), vae))
    except pw.CheckpointError as e:
        not_ok("reader takes keys prefixed 'module.' and __metadata__ (safetensors)", str(e))

    # each dtype, all tensors in it, and the three mixed; f64 values drawn in float64, so rounding shows
    rng = np.random.default_rng(SEED + 11)
    f64 = {name: Raw("float64", rng.standard_normal(v.shape) * 0.05) for name, v in vae.items()}
    f64["fc1.bias"] = Raw("float64", np.full(48, 1e-50))  # below float32's smallest subnormal: rounds to 0
    mixed = dict(as_raw(vae, "float16"))
    mixed.update({n: as_raw(vae, "bfloat16")[n] for n in ("fc21.weight", "fc3.bias")})
    mixed.update({n: f64[n] for n in ("fc4.weight", "fc22.bias")})
    dtype_cases = [("float16", as_raw(vae, "float16")), ("bfloat16", as_raw(vae, "bfloat16")),
                   ("float64", f64), ("float16, bfloat16, float64 and float32 mixed", mixed)]
    for what, obj in dtype_cases:
        want = as_float32(obj)
        for fmt in FORMATS:
            path = write(os.path.join(folder, f"dtype.{fmt}"), checkpoint_file(fmt, obj))
            try:
                check(f"reader converts {what} to float32 exactly ({fmt})", state_problem(pw.read_checkpoint(path),
                                                                                          want))
            except pw.CheckpointError as e:
                not_ok(f"reader converts {what} to float32 exactly ({fmt})", str(e))

    # the line that reports a conversion says what it is: bit for bit from float32, exact from float16 or float64
    # values that float32 holds, and from float64 that float32 rounds, how many tensors and their largest change
    def largest_change(raws):
        return max(float(np.abs(as_float32(raws)[n] - r.values).max()) for n, r in raws.items() if r.dtype == "float64")

    ending = "matches the rounded values bit for bit"
    for what, obj, want in (
            ("float32", raws, "matches the checkpoint bit for bit"),
            ("float16", as_raw(vae, "float16"), "float16 converted to float32 exactly, matches the checkpoint's "
                                                "values exactly"),
            ("float64 holding float32 values", as_raw(vae, "float64"),
             "float64 converted to float32 exactly, matches the checkpoint's values exactly"),
            ("float64", f64, f"10 of 10 tensors rounded from float64 to float32 (largest change "
                             f"{largest_change(f64):.2g}), {ending}"),
            ("two float64 tensors among others", mixed, f"2 of 10 tensors rounded from float64 to float32 (largest "
                                                        f"change {largest_change(mixed):.2g}), {ending}")):
        path = write(os.path.join(folder, "report.zip"), checkpoint_file("zip", obj))
        out = os.path.join(folder, "report.bin")
        proc = env.run("--checkpoint", path, "--out", out)
        lines = proc.stdout.strip().splitlines()
        check(f"--checkpoint of {what}: its one line says how the file compares with the checkpoint",
              f"exit {proc.returncode}: {proc.stderr[-300:]!r}" if proc.returncode or proc.stderr else
              "converted to another file" if read(out) != weights_file(as_float32(obj)) else
              None if len(lines) == 1 and lines[0].endswith(f" floats, {want}") else
              f"printed {proc.stdout!r}, expected a line ending {want!r}")

    bf16 = as_raw(vae, "bfloat16")["fc1.weight"].values
    check("bfloat16 to float32 is the bits shifted left by 16 (numpy has no bfloat16)",
          None if np.array_equal(as_float32({"w": Raw("bfloat16", bf16)})["w"].view(np.uint32) >> 16, bf16)
          and np.array_equal(as_float32({"w": Raw("bfloat16", bf16)})["w"].view(np.uint32) & 0xFFFF, 0 * bf16)
          else "differ")

    # other zip layouts: the folder named after the file (PyTorch 1.6 to 2.0), no byteorder record (before 1.13)
    for what, data in (("a zip whose folder is named after the file", zip_file(raws, folder="my_vae")),
                       ("a zip without a byteorder record", zip_file(raws, byteorder=False))):
        path = write(os.path.join(folder, "layout.pt"), data)
        check(f"reader takes {what}", state_problem(pw.read_checkpoint(path), vae))


def check_torch_saved(env):
    """A real nn.Module's state_dict, saved by torch.save in both formats and in float32, float16 and
    bfloat16, converts to the same bytes as this test's hand-written files of the same values."""
    whats = [f"torch.save of a {dtype} nn.Module's state_dict, zip and legacy, converts as the hand-written "
             f"legacy, zip and safetensors files do" for dtype in ("float32", "float16", "bfloat16")]
    if torch is None:
        for what in whats:
            skip(what, NO_TORCH)
        return
    folder = env.folder("torch_saved")
    dims = FAMILY[2]
    vae = random_vae(dims, SEED + 2)
    torch_dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    for what, dtype in zip(whats, torch_dtypes):
        raws = as_raw(vae, dtype)
        model = pw.vae_class()(dims).to(torch_dtypes[dtype])
        tensors = {n: torch.from_numpy(r.values.view(np.int16) if dtype == "bfloat16" else r.values)
                   for n, r in raws.items()}
        if dtype == "bfloat16":
            tensors = {n: t.view(torch.bfloat16) for n, t in tensors.items()}
        model.load_state_dict(tensors)
        outputs, problems = {}, []
        for fmt in ("zip", "legacy"):
            path = os.path.join(folder, f"torch_{dtype}_{fmt}.pt")
            torch.save(model.state_dict(), path, _use_new_zipfile_serialization=fmt == "zip")
            problem, outputs[f"torch {fmt}"] = convert(env, path, path + ".bin")
            problems += [f"torch {fmt}: {problem}"] if problem else []
        for fmt in FORMATS:
            path = write(os.path.join(folder, f"hand_{dtype}.{fmt}"), checkpoint_file(fmt, raws))
            problem, outputs[f"hand {fmt}"] = convert(env, path, path + ".bin")
            problems += [f"hand {fmt}: {problem}"] if problem else []
        want = weights_file(as_float32(raws))
        problems += [f"{name} differs from the expected file" for name, got in outputs.items()
                     if got is not None and got != want]
        check(what, "; ".join(problems) or None)


# ----------------------------------------------------------------------------
# --checkpoint: refusals

def check_checkpoint_refusals(env):
    """Each malformed checkpoint: one error line naming what is wrong, exit 1, and no file or folder left."""
    folder = env.folder("refusals")
    vae = random_vae(pw.Dims(400, 20, 400), SEED + 20)
    raws = as_raw(vae)

    def changed(**changes):
        d = dict(raws)
        for name, value in changes.items():
            if value is None:
                del d[name]
            else:
                d[name] = value if isinstance(value, Raw) else Raw("float32", value)
        return d

    def renamed(old, new):
        return {new if name == old else name: raw for name, raw in raws.items()}

    def zeros(*shape):
        return np.zeros(shape, np.float32)

    nan = changed(**{"fc3.bias": np.where(np.arange(400) == 7, np.nan, vae["fc3.bias"]).astype(np.float32)})
    inf = changed(**{"fc4.weight": np.where(np.arange(400) == 2, -np.inf, vae["fc4.weight"]).astype(np.float32)})
    good_st = safetensors_file(raws)
    header_len = struct.unpack_from("<Q", good_st)[0]
    st_header = json.loads(good_st[8:8 + header_len])
    overlap = json.loads(json.dumps(st_header))
    overlap["fc1.weight"]["data_offsets"] = [o - 4 for o in overlap["fc1.weight"]["data_offsets"]]
    gap = json.loads(json.dumps(st_header))
    gap["fc1.weight"]["data_offsets"] = [o + 4 for o in gap["fc1.weight"]["data_offsets"]]
    zipped = zip_file(raws)
    # the limits, and a hint that names them and the published checkpoint, as the converter's docstring gives them
    limits = "(1 <= H1, H3 <= 4096 and 1 <= Z <= 64)"
    size_hint = ("HINT: train the VAE with 1 <= H1, H3 <= 4096 and 1 <= Z <= 64 (the published one is "
                 "784-400-20-400), or use the published checkpoint, https://")
    cases = [
        ("a wrong key", "zip", renamed("fc22.bias", "fc22.b"), ["missing ['fc22.bias']", "unexpected ['fc22.b']"]),
        ("a missing key", "safetensors", changed(**{"fc4.bias": None}), ["missing ['fc4.bias']"]),
        ("an extra key", "legacy", changed(**{"fc5.weight": zeros(2, 2)}), ["unexpected ['fc5.weight']"]),
        ("a wrong shape", "zip", changed(**{"fc1.bias": zeros(400, 1)}),
         ["fc1.bias has shape [400, 1], expected [H1] = [400] (H1 from fc1.weight)"]),
        ("an input other than 784", "legacy", changed(**{"fc1.weight": zeros(400, 785)}),
         ["fc1.weight has shape [400, 785], expected [H1, 784]: the input must be 784 (28x28 images)"]),
        ("H1 out of bounds", "safetensors", changed(**{"fc1.weight": zeros(4097, 784)}),
         ["fc1.weight has shape [4097, 784]: H1 = 4097 is outside the sizes that vae.cu runs " + limits, size_hint]),
        ("H1 = 5000", "zip", changed(**{"fc1.weight": zeros(5000, 784), "fc1.bias": zeros(5000)}),
         ["fc1.weight has shape [5000, 784]: H1 = 5000 is outside the sizes that vae.cu runs " + limits, size_hint]),
        ("H3 out of bounds", "zip", changed(**{"fc3.weight": zeros(0, 20)}),
         ["fc3.weight has shape [0, 20]: H3 = 0 is outside the sizes that vae.cu runs " + limits, size_hint]),
        ("Z out of bounds", "legacy", changed(**{"fc21.weight": zeros(65, 400)}),
         ["fc21.weight has shape [65, 400]: Z = 65 is outside the sizes that vae.cu runs " + limits, size_hint]),
        ("Z = 100", "legacy", changed(**{"fc21.weight": zeros(100, 400), "fc21.bias": zeros(100)}),
         ["fc21.weight has shape [100, 400]: Z = 100 is outside the sizes that vae.cu runs " + limits, size_hint]),
        ("an encoder inconsistent with fc1", "zip", changed(**{"fc21.weight": zeros(20, 512)}),
         ["fc21.weight has shape [20, 512], expected [Z, H1] = [20, 400] (H1 from fc1.weight)"]),
        ("fc22 inconsistent with fc21", "safetensors", changed(**{"fc22.weight": zeros(19, 400)}),
         ["fc22.weight has shape [19, 400], expected [Z, H1] = [20, 400] (Z from fc21.weight, H1 from fc1.weight)"]),
        ("a decoder inconsistent with fc3", "legacy", changed(**{"fc4.weight": zeros(784, 300)}),
         ["fc4.weight has shape [784, 300], expected [784, H3] = [784, 400] (H3 from fc3.weight)"]),
        ("a NaN", "zip", nan, ["fc3.bias[7] is nan", "non-finite"]),
        ("an infinity", "safetensors", inf, ["fc4.weight[0, 2] is -inf", "non-finite"]),
        ("a float64 beyond float32's range", "legacy", changed(**{"fc1.bias": Raw("float64", np.full(400, 1e300))}),
         ["fc1.bias[0] is 1e+300, non-finite as float32"]),
        ("an int64 tensor", "zip", changed(**{"fc21.bias": Raw("int64", np.zeros(20, np.int64))}),
         ["fc21.bias has dtype int64"]),
        ("an int64 tensor", "safetensors", changed(**{"fc21.bias": Raw("int64", np.zeros(20, np.int64))}),
         ["fc21.bias has dtype int64"]),
        ("a truncated zip", None, zipped[:len(zipped) * 2 // 3], ["zip archive", "truncated or damaged"]),
        ("a zip cut before its last 10 bytes", None, zipped[:-10], ["zip archive", "truncated or damaged"]),
        ("a truncated safetensors", None, good_st[:-1000], ["it is truncated", "fc4.weight"]),
        ("a safetensors cut inside its header", None, good_st[:100], ["header length"]),
        ("safetensors with bad JSON", None, good_st[:9] + b"'" + good_st[10:],
         ["safetensors header is no valid JSON"]),
        ("safetensors with overlapping offsets", None, safetensors_file(raws, header=overlap), ["overlap"]),
        ("safetensors with a gap in its data", None, safetensors_file(raws, header=gap), ["belong to no tensor"]),
        ("safetensors with a header length beyond the file", None, struct.pack("<Q", 1 << 40) + good_st[8:],
         ["header length is 1099511627776"]),
        ("a zip whose pickle asks for os.system", None,
         zip_file(raws, pkl=os_system_pickle("touch " + os.path.join(folder, "ran"))), ["os.system", "refused"]),
        ("a wrapper holding an object the reader does not allow", "zip",
         {"state_dict": raws, "args": (Global("argparse", "Namespace"),)}, ["argparse.Namespace", "refused"]),
        ("a dict without a state_dict", "legacy", {"epoch": 3, "optimizer": {}}, ["neither 'state_dict' nor 'model'"]),
        ("a file of none of the formats", None, b"\x00\x01 this is not a checkpoint " * 20, ["none of the formats"]),
        ("an empty file", None, b"", ["the file is empty"]),
    ]
    for what, fmt, obj, fragments in cases:
        name = f"{what} ({fmt})" if fmt else what
        path = write(os.path.join(folder, "bad.pt"), checkpoint_file(fmt, obj) if fmt else obj)
        out_root = env.folder("refused_out")
        proc = env.run("--checkpoint", path, "--out", os.path.join(out_root, "new", "sub", "out.bin"))
        problem = one_error_line(proc)
        missing = [f for f in fragments if f not in proc.stderr]
        if problem is None and missing:
            problem = f"{proc.stderr.strip()!r} lacks {missing}"
        check(f"--checkpoint refuses {name}: one line, exit 1, no file or folder left",
              problem or (f"left {os.listdir(out_root)}" if os.listdir(out_root) else None))
    ran = os.path.exists(os.path.join(folder, "ran"))
    check("the os.system pickle in a zip did not run", "it ran" if ran else None)


def check_checkpoint_cli(env):
    """--checkpoint's arguments and its output file."""
    folder = env.folder("checkpoint_cli")
    vae = random_vae(FAMILY[0], SEED)
    path = write(os.path.join(folder, "vae.pt"), zip_file(as_raw(vae)))
    for what, args in (("--src", ["--src", env.src]), ("--only", ["--only", "inputs"]),
                       ("--reference-loss", ["--reference-loss"]), ("an --out that is a folder", ["--out", folder]),
                       ("an --out that is the checkpoint itself", ["--out", path]),
                       ("a checkpoint that does not exist", ["--checkpoint", os.path.join(folder, "none.pt")])):
        before = sorted(os.listdir(folder))
        proc = env.run("--checkpoint", path, *args)
        check(f"--checkpoint with {what}: one error line, exit 1, nothing written",
              one_error_line(proc) or (None if sorted(os.listdir(folder)) == before else f"wrote {os.listdir(folder)}"))
    what = "--checkpoint replaces an earlier output only when complete, and leaves no temporary"
    out = write(os.path.join(folder, "out.bin"), b"earlier")
    bad = write(os.path.join(folder, "bad.pt"), zip_file(as_raw(vae))[:-1])
    proc = env.run("--checkpoint", bad, "--out", out)
    kept = one_error_line(proc) is None and read(out) == b"earlier"
    problem, got = convert(env, path, out)
    check(what, problem or (None if kept and got == weights_file(vae) and
                            sorted(os.listdir(folder)) == ["bad.pt", "out.bin", "vae.pt"]
                            else f"kept {kept}, folder {os.listdir(folder)}"))


# ----------------------------------------------------------------------------
# corrupt inputs

class Hung(BaseException):
    """Raised by the alarm in a read that takes too long; a BaseException, so that no reader catches it."""


def check_corpus(env, exhaustive):
    """Each format cut at many points and with bytes flipped: the reader accepts the file or raises
    CheckpointError, never another exception, within a second and without allocating far beyond the file. All the
    variants when exhaustive, else a fixed quarter of them (each read is ~1-2 ms under tracemalloc, ~9,000 in all)."""
    folder = env.folder("corpus")
    vae = random_vae(pw.Dims(6, 3, 5), SEED + 30)
    files = {
        "legacy": legacy_file({"state_dict": as_raw(vae, "float16"), "epoch": 9, "opt": {"lr": 0.5}}),
        "zip": zip_file({"model": as_raw(vae, "bfloat16"), "step": Raw("int64", np.arange(3))}),
        "safetensors": safetensors_file(as_raw(vae, "float64"), metadata={"format": "pt"}),
    }

    def on_alarm(*_):
        raise Hung()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    tracemalloc.start()
    try:
        for fmt, good in files.items():
            # where a format's structure lies: its first bytes, and for zip also its end (the central directory)
            structure = list(range(min(len(good), 1500)))
            if fmt == "zip":
                structure += list(range(max(0, len(good) - 600), len(good)))
            cuts = sorted(set(list(range(0, 1500, 3)) + list(range(len(good) - 600, len(good)))
                              + [len(good) * i // 50 for i in range(50)]))
            rng = np.random.default_rng(SEED + 31)
            variants = [good[:n] for n in cuts]
            masks = [0xFF, 0x01, 0x80, 0x20, 0x7F, 0x04]
            for i, pos in enumerate(sorted(set(structure))):
                data = bytearray(good)
                data[pos] ^= masks[i % len(masks)]
                variants.append(bytes(data))
            for _ in range(200):  # a few bytes at random anywhere
                data = bytearray(good)
                for pos in rng.integers(0, len(good), 3):
                    data[pos] = int(rng.integers(0, 256))
                variants.append(bytes(data))
            made = len(variants)
            if not exhaustive:
                keep = np.random.default_rng(SEED + 32).choice(made, made // 4, replace=False)
                variants = [variants[i] for i in sorted(keep)]

            outcomes, problems, worst_time, worst_memory = collections.Counter(), [], 0.0, 0
            path = os.path.join(folder, f"corrupt.{fmt}")
            for data in variants:
                write(path, data)
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
                start = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, 5)
                try:
                    pw.read_checkpoint(path)
                    outcomes["accepted"] += 1
                except pw.CheckpointError as e:
                    outcomes["refused"] += 1
                    if "\n" in str(e):
                        problems.append(f"a message of several lines: {str(e)[:200]!r}")
                except Hung:
                    problems.append(f"a read of {len(data)} bytes ran past 5 s")
                except Exception as e:
                    problems.append(f"{type(e).__name__}: {str(e)[:200]}")
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                worst_time = max(worst_time, time.perf_counter() - start)
                worst_memory = max(worst_memory, tracemalloc.get_traced_memory()[1] - base)
            limit = 16 * len(good) + (4 << 20)
            if worst_memory > limit:
                problems.append(f"a read allocated {worst_memory} bytes, more than {limit}")
            if worst_time > 1:
                problems.append(f"a read took {worst_time:.2f} s")
            check(f"{fmt}: {len(variants)} of {made} corrupt files ({'all' if exhaustive else 'a fixed sample'}; "
                  f"{outcomes['accepted']} accepted, {outcomes['refused']} refused), each read or refused with "
                  f"CheckpointError, at most {worst_time * 1000:.0f} ms and {worst_memory >> 10} KiB",
                  "; ".join(problems[:3]) or None)
    finally:
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, previous)


# values of every kind that pickle and JSON can hold, for the fields of a tensor's record
ODD_VALUES = [None, True, -1, 0, 1.5, 2 ** 70, -2 ** 63, "F32", "", (), (1,), (-1, 2), (2 ** 62, 2 ** 62), [], [3],
              {}, {"a": 1}, Global("torch", "FloatStorage"), Global("collections", "OrderedDict")]


def check_odd_fields(env):
    """Each field of a tensor's record (in the pickles: storage type, key, location, element count, offset,
    size, stride, requires_grad; in safetensors: dtype, shape, data_offsets and the entries themselves) given
    values of every kind: the reader accepts the file or raises CheckpointError, never another exception."""
    folder = env.folder("odd_fields")
    raws = as_raw(random_vae(pw.Dims(6, 3, 5), SEED + 40))
    path = os.path.join(folder, "odd.pt")

    def outcome(data):
        write(path, data)
        try:
            pw.read_checkpoint(path)
            return "accepted"
        except pw.CheckpointError:
            return "refused"
        except Exception as e:
            return f"{type(e).__name__}: {str(e)[:200]}"

    def json_value(v):  # pickle-only values as JSON
        return [json_value(x) for x in v] if isinstance(v, tuple) else repr(v) if isinstance(v, Global) else v

    for fmt in ("legacy", "zip"):
        outcomes, problems = collections.Counter(), []
        for field in ("type", "key", "location", "numel", "offset", "size", "stride", "requires_grad"):
            for index in (0, 1):  # fc1.weight (2-D) and fc1.bias (1-D)
                for value in ODD_VALUES:
                    def tweak(i, fields, field=field, index=index, value=value):
                        return dict(fields, **{field: value}) if i == index else fields
                    data = (legacy_file if fmt == "legacy" else zip_file)(raws, tweak=tweak)
                    result = outcome(data)
                    outcomes[result if result in ("accepted", "refused") else "escaped"] += 1
                    if result not in ("accepted", "refused"):
                        problems.append(f"{field} = {value!r}: {result}")
        check(f"{fmt}: every field of a tensor's record with {len(ODD_VALUES)} kinds of value "
              f"({outcomes['accepted']} accepted, {outcomes['refused']} refused)", "; ".join(problems[:3]) or None)

    good = safetensors_file(raws)
    header = json.loads(good[8:8 + struct.unpack_from("<Q", good)[0]])
    outcomes, problems, variants = collections.Counter(), [], []
    for value in map(json_value, ODD_VALUES):
        variants.append(("the header", value))
        variants.append(("__metadata__", dict(header, __metadata__=value)))
        variants.append(("__metadata__ entry", dict(header, __metadata__={"a": value})))
        for name in ("fc1.weight", "fc1.bias"):
            variants.append((f"{name}", dict(header, **{name: value})))
            for field in ("dtype", "shape", "data_offsets"):
                variants.append((f"{name} {field}", dict(header, **{name: dict(header[name], **{field: value})})))
                if field != "dtype":
                    variants.append((f"{name} {field}[0]", dict(header, **{name: dict(
                        header[name], **{field: [value] + header[name][field][1:]})})))
    for what, h in variants:
        result = outcome(safetensors_file(raws, header=h))
        outcomes[result if result in ("accepted", "refused") else "escaped"] += 1
        if result not in ("accepted", "refused"):
            problems.append(f"{what}: {result}")
    check(f"safetensors: the header and each field of a tensor's entry with {len(ODD_VALUES)} kinds of value "
          f"({outcomes['accepted']} accepted, {outcomes['refused']} refused)", "; ".join(problems[:3]) or None)


def main():
    p = argparse.ArgumentParser(description="Tests prepare_weights.py.")
    p.add_argument("--src", default=os.path.join(HERE, "..", "shared", "data"),
                   help="folder holding vae_epoch_25.pth and the t10k .gz files "
                        "(default: ../shared/data beside this repository)")
    p.add_argument("--exhaustive", action="store_true",
                   help="read every corrupt file of the sweep, not a fixed quarter of them (about four times as long)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="test_prepare_weights_") as root:
        env = Env(root, os.path.abspath(args.src))
        checks = [(check_help, ()), (check_replace_when_complete, ()), (check_all_or_nothing, ()), (check_offline, ()),
                  (check_family, ()),
                  (check_structures, ()),
                  (check_torch_saved, ()), (check_checkpoint_refusals, ()), (check_checkpoint_cli, ()),
                  (check_corpus, (args.exhaustive,)), (check_odd_fields, ())]
        missing = [n for n in pw.SOURCES if not os.path.isfile(os.path.join(env.src, n))]
        if missing:
            skip("every check on the real inputs", f"{env.src} lacks {missing}")
        else:
            real = read(env.checkpoint)
            try:
                state = pw.read_checkpoint(env.checkpoint)
                ok("reader reads the published checkpoint")
            except Exception as e:
                not_ok("reader reads the published checkpoint", f"{type(e).__name__}: {e}")
            else:
                checks += [(check_inputs, (state,)), (check_against_torch, (state,)), (check_torch_made, (state,)),
                           (check_resave_hint, (state,))]
            checks += [(check_without_torch, ()), (check_references, ()), (check_family_cli, ()),
                       (check_family_files, ()), (check_damaged, (real,)),
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
