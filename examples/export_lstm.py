"""Export an LSTM language model with a dynamic sequence length, compile it
with AOTInductor, and run the package in a fresh process.

    python examples/export_lstm.py [FOLDER]

Writes ``lm_program.pt2`` (the ExportedProgram, ``torch.export.save``) and
``lm_aoti.pt2`` (the AOTInductor package) into FOLDER (default: a temporary
folder), then starts a second Python process that imports only torch and
wfpass, loads both and checks them against eager PyTorch at lengths the
example never had.
"""
import subprocess
import sys
import tempfile

import torch
from torch import nn
from torch.export import Dim

import wfpass


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(500, 128)
        self.lstm = nn.LSTM(128, 128, num_layers=2)
        self.head = nn.Linear(128, 500)

    def forward(self, tokens):  # tokens: [T, batch]
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out)


def export(folder: str) -> None:
    torch.manual_seed(0)
    model = LM().eval()
    tokens = torch.randint(0, 500, (16, 4))
    program = wfpass.export(model, (tokens,), dynamic_shapes={"tokens": {0: Dim("T", min=1, max=512)}})
    print(wfpass.last_report())
    torch.export.save(program, f"{folder}/lm_program.pt2")
    torch._inductor.aoti_compile_and_package(program, package_path=f"{folder}/lm_aoti.pt2")
    torch.save(model.state_dict(), f"{folder}/lm_weights.pt")


def check(folder: str) -> None:
    """In a fresh process: ``import wfpass`` registers the ops the program
    calls (and loads wfpass's C++ kernels where they are built)."""
    model = LM().eval()
    model.load_state_dict(torch.load(f"{folder}/lm_weights.pt"))
    package = torch._inductor.aoti_load_package(f"{folder}/lm_aoti.pt2")
    program = torch.export.load(f"{folder}/lm_program.pt2").module()
    for T in (1, 37, 300):
        tokens = torch.randint(0, 500, (T, 4))
        with torch.no_grad():
            want = model(tokens)
        for name, got in (("AOTInductor package", package(tokens)), ("loaded program", program(tokens))):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= 1e-5, (name, T, err)
            print(f"T={T:3d}: {name} equals eager (relative error {err:.1e})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2])
    else:
        folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
        export(folder)
        subprocess.run([sys.executable, __file__, "--check", folder], check=True)
