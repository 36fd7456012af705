"""The C++ side (examples/cpp), as a user builds it: CMake against the installed torch's LibTorch and this
torch_ln's CMake package; then its programs run and their outputs are compared with Python's.

The first run configures and builds (about 1-2 minutes on 2 cores) and makes the AOTInductor package (about
a minute); both are cached in build/ (CMake rebuilds what changed; the package is keyed by what it depends on).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from norm_cases import DEVICES

import torch_ln

PACKAGE_ROOT = Path(torch_ln.__file__).resolve().parent.parent  # where `import torch_ln` came from
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpp"

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake (the C++ example builds with it)")


def _run(command: list, timeout: float = 600) -> subprocess.CompletedProcess:
    # The subprocesses import the same torch_ln as this test.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [str(c) for c in command], check=False, capture_output=True, text=True, timeout=timeout, env=env
    )
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, command))} exited {result.returncode}:\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    return result


@pytest.fixture(scope="module")
def example_build() -> Path:
    configure = [
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        # As Ubuntu's compiler links by default: libraries nothing references are dropped. run_aoti references
        # nothing of torch_ln, so it keeps libtorch_ln (and its operators) only through torch_ln::torch_ln.
        "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--as-needed",
    ]
    # A new configuration (not only a rebuild) when these change: CMake does not watch the package's config file.
    inputs = [
        EXAMPLE / "CMakeLists.txt",
        EXAMPLE / "python_env.py",
        *Path(torch_ln.cmake_prefix_path()).rglob("*.cmake"),
    ]
    text = " ".join([torch.__version__, *configure]).encode() + b"".join(p.read_bytes() for p in inputs)
    key = hashlib.sha256(text).hexdigest()[:16]
    build = ROOT / "build" / "cpp_example" / key
    if not (build / "CMakeCache.txt").exists():
        _run(["cmake", "-S", EXAMPLE, "-B", build, *configure])
    _run(["cmake", "--build", build, "--parallel", os.environ.get("MAX_JOBS", "2")])
    return build


@functools.cache
def _model_dir(device: str) -> Path:
    # The package depends on the script, torch, the schemas and the Python side of the operators (fake kernels).
    sources = [EXAMPLE / "make_model.py", ROOT / "csrc" / "norm_ops.cpp", *sorted((ROOT / "torch_ln").glob("*.py"))]
    key = hashlib.sha256(torch.__version__.encode() + b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    out = ROOT / "build" / "cpp_example_model" / f"{device}-{key}"
    if not (out / "python_outputs.pt").exists():  # written last
        _run([sys.executable, EXAMPLE / "make_model.py", out, "--device", device])
    return out


# M=1: a single row; D=257, prime: no vector width or thread count divides it, so the tails run.
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 257)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_api_matches_torch_and_python(example_build, tmp_path, shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    weight, bias = torch.randn(shape[-1], dtype=dtype), torch.randn(shape[-1], dtype=dtype)
    torch.save([x, weight, bias], tmp_path / "inputs.pt")
    result = _run([example_build / "cpp_api", tmp_path / "inputs.pt", tmp_path / "outputs.pt"])
    # The program's own comparison with LibTorch's layer_norm, rms_norm and their gradients.
    assert "all match" in result.stdout and "MISMATCH" not in result.stdout, result.stdout
    layer_norm, rms_norm = torch.load(tmp_path / "outputs.pt")
    # The same kernels in the same library, called from C++ or from Python: bitwise equal.
    torch.testing.assert_close(layer_norm, torch_ln.layer_norm(x, weight.shape, weight, bias), rtol=0, atol=0)
    torch.testing.assert_close(rms_norm, torch_ln.rms_norm(x, weight.shape, weight), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_aoti_package_runs_from_cpp_as_in_python(example_build, tmp_path, device):
    model_dir = _model_dir(device)
    result = _run([example_build / "run_aoti", model_dir / "model.pt2", model_dir / "inputs.pt", tmp_path / "out.pt"])
    # run_aoti calls nothing of torch_ln: linking torch_ln::torch_ln alone registered the operators.
    assert "torch_ln::layer_norm_fwd registered: yes" in result.stdout, result.stdout
    (cpp,) = torch.load(tmp_path / "out.pt")
    eager, python_package = torch.load(model_dir / "python_outputs.pt")
    # The same compiled package on the same input: bitwise equal.
    torch.testing.assert_close(cpp, python_package, rtol=0, atol=0)
    # Inductor fuses the Linear layers' epilogues differently from eager: a few float32 ulps per layer.
    torch.testing.assert_close(cpp, eager, rtol=1e-5, atol=1e-5)
