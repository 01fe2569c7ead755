"""Run a wfpass program from a C++ program, with no Python in its process.

    python examples/export_cpp.py [FOLDER]

Exports the LSTM language model of ``export_lstm.py`` with a dynamic
sequence length and batch, compiles it with AOTInductor into ``lm_aoti.pt2``, builds
``run_package.cpp`` (``torch::inductor::AOTIModelPackageLoader``) against
this torch, and runs it at lengths and batches the example never had, loading
wfpass's two libraries (the kernels and the ops' definitions); each output
is checked against eager PyTorch. Needs a C++ compiler (the one wfpass's
kernels are built with).
"""
import pathlib
import subprocess
import sys
import tempfile

import torch
from torch.export import Dim

import wfpass
from wfpass.native.program import compile_command, cxx_libraries

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from export_lstm import LM  # noqa: E402  (the same model)


def main(folder: str) -> None:
    torch.manual_seed(0)
    model = LM().eval()
    program = wfpass.export(model, (torch.randint(0, 500, (16, 4)),),
                            dynamic_shapes={"tokens": {0: Dim("T", min=1, max=512), 1: Dim("batch", min=1, max=64)}})
    package = f"{folder}/lm_aoti.pt2"
    torch._inductor.aoti_compile_and_package(program, package_path=package)
    libraries = [str(p) for p in cxx_libraries()]
    exe = f"{folder}/run_package"
    source = str(pathlib.Path(__file__).resolve().parent / "export_cpp" / "run_package.cpp")
    subprocess.run(compile_command(source, exe), check=True)
    for T, B in ((1, 1), (37, 4), (300, 2)):
        tokens = torch.randint(0, 500, (T, B))
        tokens.numpy().tofile(f"{folder}/tokens.bin")
        r = subprocess.run([exe, package, f"{folder}/tokens.bin", str(T), str(B), f"{folder}/out.bin", *libraries],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        with torch.no_grad():
            want = model(tokens)
        got = torch.from_file(f"{folder}/out.bin", size=want.numel(), dtype=torch.float32).view_as(want)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, (T, B, err)
        print(f"T={T:3d} batch {B}: the C++ program ({r.stdout.strip()}) equals eager (relative error {err:.1e})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
