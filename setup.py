"""Builds torch_ln/lib/libtorch_ln.so, the operator library (no Python in it: C++ programs link it through the CMake
package in torch_ln/share/cmake, and `import torch_ln` loads it): the CPU kernels always, the CUDA kernels whenever
nvcc and a CUDA build of torch are present; and torch_ln._C, the Python module that calls its operators directly.

Environment:
  TORCH_LN_FORCE_CPU=1    build the CPU-only extension even where CUDA could be built
  TORCH_CUDA_ARCH_LIST    GPU architectures, e.g. "8.0;9.0"; default DEFAULT_ARCH_LIST when no GPU is visible
  TORCH_LN_LOCAL_VERSION=1  a local version label naming torch and CUDA (scripts/build_wheels.py)
  MAX_JOBS                parallel compile jobs (ninja)
  NVCC_THREADS            threads nvcc uses per compile (default 2)
"""

import importlib.util
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# With no GPU visible: Ampere (A100), Hopper (H100/H200), Blackwell (B200: sm_100; RTX 50xx, RTX PRO: sm_120) and
# sm_120's PTX, which later GPUs JIT-compile. scripts/run.sh builds "8.0;9.0" only (the architectures tested).
DEFAULT_ARCH_LIST = "8.0;9.0;10.0;12.0+PTX"


def _find_cuda_home() -> str | None:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            return candidate
    nvcc = shutil.which("nvcc")
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


# cpp_extension reads CUDA_HOME when it is imported.
if _find_cuda_home():
    os.environ.setdefault("CUDA_HOME", _find_cuda_home())

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

# Not a Python module: a plain shared library, found by torch_ln/_extension.py and torch_lnConfig.cmake.
LIBRARY = "torch_ln.lib.libtorch_ln"
# The Python module of eager calls (csrc/python), linked against LIBRARY.
MODULE = "torch_ln._C"
VERSION = "0.1.0"
# The installed torch's public release (2.14.1 of 2.14.1+cu130): what the range, the label and the pin name.
TORCH_RELEASE = torch.__version__.split("+")[0]


def _load_torch_range():
    # scripts/torch_range.py by its path: the package itself cannot be imported before it is built.
    spec = importlib.util.spec_from_file_location("torch_range", ROOT / "scripts" / "torch_range.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


supported_torch = _load_torch_range().supported_torch


def _check_torch() -> None:
    # --no-build-isolation builds against whatever torch is installed: refuse one outside the supported range.
    from packaging.specifiers import SpecifierSet

    if TORCH_RELEASE not in SpecifierSet(supported_torch()):
        raise RuntimeError(
            f"torch_ln supports torch{supported_torch()} (pyproject.toml), but torch {torch.__version__} is installed"
        )


def _version() -> str:
    """The package version; TORCH_LN_LOCAL_VERSION=1 (scripts/build_wheels.py) adds a local label naming the torch
    and the CUDA the wheel is built for (0.1.0+pt211cu130, 0.1.0+pt211cpu), so wheels for several torch releases
    can lie side by side in one folder or index."""
    if os.environ.get("TORCH_LN_LOCAL_VERSION", "0") in ("", "0"):
        return VERSION
    major, minor = TORCH_RELEASE.split(".")[:2]
    cuda = f"cu{torch.version.cuda.replace('.', '')}" if _with_cuda() else "cpu"
    return f"{VERSION}+pt{major}{minor}{cuda}"


def _with_cuda() -> bool:
    if os.environ.get("TORCH_LN_FORCE_CPU", "0") not in ("", "0"):
        return False
    return torch.version.cuda is not None and _find_cuda_home() is not None


def _cuda_wheel_include_dirs() -> list[str]:
    """Headers that torch's CUDA headers need (cuBLAS, cuSPARSE, ...) but a minimal toolkit may lack:
    take them from the nvidia-* wheels that a CUDA build of torch installs."""
    if (Path(os.environ["CUDA_HOME"]) / "include" / "cublas_v2.h").exists():
        return []
    import nvidia

    return [str(p.parent) for root in nvidia.__path__ for p in Path(root).glob("cu*/include/cublas_v2.h")]


def _extension():
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cpu").glob("*.cpp"))
    # The public header <torch_ln/torch_ln.h> ships with the package.
    include_dirs = [str(ROOT / "torch_ln" / "include")]
    # -fopenmp: at::parallel_for is inlined into our code, and only runs in parallel when OpenMP is on.
    # -ffp-contract=off: no implicit a*b+c fusion, so g = dy*w is rounded once wherever it is used
    # (with D=1, dx = rstd*(g - mean(g)) is then exactly 0, as torch's).
    # -fno-trapping-math: floating-point compares may run unconditionally (no FP traps are enabled, so no result
    # changes), which lets GCC turn the quantized outputs' saturate-and-convert selects into vector code; with the
    # default, each element was a branch (csrc/quantize.h: 10x the norm's own time)
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]
    if not _with_cuda():
        ext = CppExtension(
            LIBRARY,
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    else:
        if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
        cuda_dir = ROOT / "csrc" / "cuda"
        sources += sorted(str(p.relative_to(ROOT)) for p in [*cuda_dir.glob("*.cu"), *cuda_dir.glob("*.cpp")])
        nvcc_flags = ["-O3", "--threads", os.environ.get("NVCC_THREADS", "2"), "-lineinfo"]
        ext = CUDAExtension(
            LIBRARY,
            sources,
            include_dirs=include_dirs + _cuda_wheel_include_dirs(),
            extra_compile_args={"cxx": cxx_flags + ["-DTORCH_LN_WITH_CUDA"], "nvcc": nvcc_flags},
            extra_link_args=["-fopenmp"],
        )
    # LibTorch only: the library must load in a process without a Python interpreter.
    ext.libraries.remove("torch_python")
    return ext


def _write_build_info() -> None:
    (ROOT / "torch_ln" / "_build_info.py").write_text(
        '"""Written by setup.py: what this build of torch_ln was compiled against."""\n\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"WITH_CUDA = {_with_cuda()!r}\n"
        f"CUDA_ARCH_LIST = {os.environ.get('TORCH_CUDA_ARCH_LIST', '') if _with_cuda() else ''!r}\n"
    )


def _module():
    # $ORIGIN/lib: the operator library beside the module in the package (already loaded by then; found for the link
    # by BuildExtensions).
    return CppExtension(
        MODULE,
        ["csrc/python/module.cpp"],
        include_dirs=[str(ROOT / "torch_ln" / "include")],
        libraries=["torch_ln"],
        extra_compile_args={"cxx": ["-O3"]},
        extra_link_args=["-Wl,-rpath,$ORIGIN/lib"],
    )


def _library_runpath(editable: bool) -> list[str]:
    """Where libtorch_ln.so finds LibTorch and the CUDA runtime at load time, whichever libraries a program loaded
    before it: torch/lib and the nvidia wheel's libcudart beside torch, relative to $ORIGIN (a wheel installs
    torch_ln/lib at the same depth as torch/lib, in the same site-packages), and for an editable install, whose
    library stays in this tree, their absolute paths on this machine too."""
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    site_packages = torch_lib.parent.parent
    dirs = [torch_lib]
    if _with_cuda():
        dirs += sorted({p.parent for p in site_packages.glob("nvidia/*/lib/libcudart.so*")})
    relative = [f"$ORIGIN/../../{d.relative_to(site_packages)}" for d in dirs]
    if not editable:
        return relative
    toolkit = [Path(os.environ["CUDA_HOME"]) / "lib64"] if _with_cuda() else []
    return relative + [str(d) for d in dirs + toolkit]


class BuildExtensions(BuildExtension):
    """The operator library keeps its plain name (C++ programs and CMake find libtorch_ln.so); the Python module,
    built after it, links against it where it was just built."""

    def get_ext_filename(self, ext_name):
        filename = super().get_ext_filename(ext_name)
        # ext_name: the full name, or only its last part (when setuptools asks for the output path).
        is_library = ext_name.split(".")[-1] == LIBRARY.split(".")[-1]
        return str(Path(filename).with_name("libtorch_ln.so")) if is_library else filename

    def build_extension(self, ext):
        if ext.name == MODULE:
            ext.library_dirs.append(str(Path(self.get_ext_fullpath(LIBRARY)).parent))
        else:  # RUNPATH (new dtags), not RPATH: LD_LIBRARY_PATH still overrides it
            editable = self.inplace or getattr(self, "editable_mode", False)
            runpath = ":".join(_library_runpath(editable))
            ext.extra_link_args += ["-Wl,--enable-new-dtags", f"-Wl,-rpath,{runpath}"]
        super().build_extension(ext)


_check_torch()
ext = _extension()
_write_build_info()
# build_ext --inplace (an editable install) copies the library here, but does not create the folder.
(ROOT / "torch_ln" / "lib").mkdir(exist_ok=True)
setup(
    version=_version(),
    ext_modules=[ext, _module()],
    # A binary extension works with the torch it was compiled against, and no other. The public version only: pip
    # rejects a local label (+cu130) against the index's torch and the torch<=X caps some installations carry;
    # import torch_ln still checks the full version (CUDA or CPU build) and says how to rebuild.
    install_requires=[f"torch=={TORCH_RELEASE}"],
    cmdclass={"build_ext": BuildExtensions.with_options(use_ninja=True)},
)
