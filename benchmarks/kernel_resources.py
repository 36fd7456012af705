"""What ptxas makes of every CUDA kernel instantiation for sm_90, without a GPU.

Compiles csrc/cuda/*.cu to cubins with `nvcc --resource-usage` (the flags of the extension build), and reads:
- from ptxas: registers per thread, spill stores/loads, stack frame, static shared memory;
- from the SASS (cuobjdump, from Triton's wheel when present): the 16-byte global loads a thread has in flight
  before the first use of any of them, and how many global stores are 16 bytes wide.

nvcc takes minutes on a small machine, so its reports and cubins are cached in build/ptxas/, keyed by a hash of
csrc/cuda and csrc/*.h, the flags and the nvcc version. `python benchmarks/kernel_resources.py` prints a table.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "ptxas"
ARCH = "sm_90"
# The register file and thread limits of an sm_90 SM.
REGISTERS_PER_SM = 65536
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp in units of 256
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SHARED_BYTES_PER_SM = 228 * 1024
RESERVED_SHARED_PER_BLOCK = 1024  # the system's share of each block's shared memory (sm_80 and later)


def nvcc() -> str | None:
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", "/usr/local"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            return str(Path(candidate) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cuobjdump() -> str | None:
    try:
        import triton

        found = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if found.exists():
            return str(found)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    includes = cpp_extension.include_paths(device_type="cuda") + [sysconfig.get_paths()["include"]]
    try:
        import nvidia

        includes += [str(p.parent) for r in nvidia.__path__ for p in Path(r).glob("cu*/include/cublas_v2.h")]
    except ImportError:
        pass
    # As setup.py and torch's extension build compile the kernels.
    return [
        "-O3",
        "-std=c++20",
        f"-arch={ARCH}",
        "-cubin",
        "--resource-usage",
        *cpp_extension.COMMON_NVCC_FLAGS,
        *(f"-I{i}" for i in includes),
    ]


def _source_hash(flags: list[str], compiler: str) -> str:
    h = hashlib.sha256()
    # What nvcc reads: csrc/cuda and the headers above it (not the CPU or emulated sources).
    for path in sorted([*(ROOT / "csrc" / "cuda").iterdir(), *(ROOT / "csrc").glob("*.h")]):
        if path.is_file():
            h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout.encode())
    return h.hexdigest()[:20]


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_resource_usage(text: str) -> dict[str, dict]:
    """ptxas' --resource-usage report -> {mangled kernel: registers, spill/stack bytes, static smem}."""
    kernels: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = kernels.setdefault(m.group(1), {"registers": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0})
            current["static_smem"] = 0
        elif current is not None and (m := _FRAME.search(line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                current["static_smem"] = int(s.group(1))
    return kernels


_SASS_FUNCTION = re.compile(r"Function : (\w+)")
_SASS_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_REG = re.compile(r"\bR(\d+)\b")


def _load_bytes(op: str) -> int:
    for suffix, size in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if suffix in op:
            return size
    return 4


def parse_sass(text: str) -> dict[str, dict]:
    """cuobjdump -sass -> {kernel: loads_in_flight and bytes_in_flight (the most global loads, and their bytes, a
    thread issues before it uses any of them), stores_128, stores_narrow (STG narrower than 16 bytes)}.
    Straight-line reading: branches and loops are not followed."""
    out: dict[str, dict] = {}
    name = None
    pending: set[int] = set()
    loads = nbytes = 0
    for line in text.splitlines():
        if m := _SASS_FUNCTION.search(line):
            name = m.group(1)
            out[name] = {"loads_in_flight": 0, "bytes_in_flight": 0, "stores_128": 0, "stores_narrow": 0}
            pending, loads, nbytes = set(), 0, 0
            continue
        if name is None or not (m := _SASS_INSTR.search(line)):
            continue
        op, operands = m.group(2), m.group(3)
        regs = [int(r) for r in _REG.findall(operands)]
        if op.startswith("STG"):
            out[name]["stores_128" if ".128" in op else "stores_narrow"] += 1
        # (LDGSTS, cp.async, loads into shared memory: no register to wait for)
        if op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR")):
            if pending & set(regs[1:]):  # the address depends on a load in flight
                pending, loads, nbytes = set(), 0, 0
            size = _load_bytes(op)
            pending |= set(range(regs[0], regs[0] + max(1, size // 4)))
            loads, nbytes = loads + 1, nbytes + size
            if nbytes > out[name]["bytes_in_flight"]:
                out[name]["loads_in_flight"], out[name]["bytes_in_flight"] = loads, nbytes
        elif pending & set(regs):
            pending, loads, nbytes = set(), 0, 0
    return out


def compile_all(verbose: bool = False) -> dict[str, dict]:
    """{mangled kernel name: ptxas resources + SASS facts, 'source': the .cu file} for every instantiation.
    The ptxas report and the cubin of each .cu are cached; the parsing runs every time."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found: set CUDA_HOME")
    flags = _flags()
    cache = CACHE / _source_hash(flags, compiler)
    cache.mkdir(parents=True, exist_ok=True)
    dump = cuobjdump()
    kernels: dict[str, dict] = {}
    for source in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
        cubin, report = cache / f"{source.stem}.cubin", cache / f"{source.stem}.ptxas.txt"
        if not report.exists():
            if verbose:
                print(f"nvcc {source.name} ...", file=sys.stderr)
            run = subprocess.run(
                [compiler, *flags, "-o", str(cubin), str(source)], capture_output=True, text=True, check=False
            )
            if run.returncode != 0:
                raise RuntimeError(f"nvcc failed on {source.name}:\n{run.stderr[-4000:]}")
            report.write_text(run.stdout + run.stderr)
        found = parse_resource_usage(report.read_text())
        sass = {}
        if dump and cubin.exists():
            sass = parse_sass(
                subprocess.run([dump, "-sass", str(cubin)], capture_output=True, text=True, check=False).stdout
            )
        for name, res in found.items():
            kernels[name] = {**res, **sass.get(name, {}), "source": source.name}
    return kernels


def blocks_per_sm(registers: int, threads: int, shared_bytes: int) -> int:
    """Resident blocks of `threads` threads per sm_90 SM, limited by registers, threads, shared memory and blocks."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    by_registers = REGISTERS_PER_SM // (regs_per_warp * warps)
    by_threads = MAX_THREADS_PER_SM // threads
    by_shared = SHARED_BYTES_PER_SM // (shared_bytes + RESERVED_SHARED_PER_BLOCK)
    return min(by_registers, by_threads, by_shared, MAX_BLOCKS_PER_SM)


def demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("c++filt")
    if not filt:
        return {n: n for n in names}
    out = subprocess.run(
        [filt], input="\n".join(names), capture_output=True, text=True, check=False
    ).stdout.splitlines()
    return dict(zip(names, out))


def short_name(demangled: str) -> str:
    """'torch_ln::norm_forward_kernel<float, float, float, (NormKind)0, 4, 8>' -> 'norm_forward_kernel<float, ...>'."""
    s = (
        demangled.replace("torch_ln::", "")
        .replace("c10::", "")
        .replace("(NormKind)0", "LN")
        .replace("(NormKind)1", "RMS")
    )
    return s.split("(")[0] if "(" in s and s.index("(") > s.find(">") else s


if __name__ == "__main__":
    kernels = compile_all(verbose=True)
    names = demangle(sorted(kernels))
    print(
        f"{'kernel':<80} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>5} {'LDG in flight':>16} {'STG128/narrow':>13}"
    )
    for mangled in sorted(kernels, key=lambda n: names[n]):
        k = kernels[mangled]
        print(
            f"{short_name(names[mangled]):<80} {k['registers']:>4} {k['spill_stores']:>5}/{k['spill_loads']:<5} "
            f"{k['stack']:>5} {k['static_smem']:>5} {k.get('loads_in_flight', '-'):>6} ({k.get('bytes_in_flight', '-'):>4} B) "
            f"{k.get('stores_128', '-'):>6}/{k.get('stores_narrow', '-')}"
        )
