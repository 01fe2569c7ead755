"""Which kernel one RNN call takes, decided once: the rules (``choose_path``,
``cxx_serves``, ``packed_path``) and their outcome for one call, an
:class:`RnnPlan`, computed from the guards' facts (the spec, the input the
call was traced with, its static length, whether the graph trains, the
autocast dtypes). The rewrite builds its call from the plan, the report row
names the plan's kernel and counter, ``wfpass.explain`` prints it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch

from .._torch import kernels as _kernels
from ..core.graph import static_int
from .cpu import native_layer
from .spec import RnnSpec

__all__ = ["RnnPlan", "plan_call", "choose_path", "cxx_serves", "training_batch_bound", "thread_bound_words",
           "kernel_words", "no_onednn_reason", "paths_differ", "VARLEN_SUMMARY"]


# The C++ loop's rule (``cxx_serves``), as measured:
# Does a call of ``steps`` time steps (None: symbolic) take ``cxx``?
# ``train``: the call is differentiated (a training graph).
# A float32 CPU RNN without projections, the C++ loop's fast steps
# available (the C++ kernels, a CPU with AVX-512F or AVX2 with FMA), and:
#
# * a GRU or plain RNN, static or symbolic sizes: with AVX-512 at any
#   size: the loop ran 1.4-4.1x faster than ATen's kernels (``native``)
#   in training and 1.6-4.7x in inference (one tie, 0.99x, at the largest
#   GRU with 2 threads), from T 4, batch 4, hidden 64 to T 50, batch 64,
#   hidden 512. With AVX2 only (an AMD EPYC without AVX-512) its per-step
#   GEMMs are slower: up to hidden 128 it won both steps (1.39-3.71x); at
#   hidden 256 a plain RNN's both (1.08-1.44x), a GRU's training at 1
#   thread (1.20x, 0.89x at 2) but not its inference (0.77-0.88x); at
#   hidden 512 it lost (0.53-1.00x). So there a GRU takes it up to hidden
#   128 in inference and 256 in training, a plain RNN up to 256;
# * an LSTM with static sizes, only a small one: hidden size <= 64 with
#   batch <= 32, where the loop was faster than oneDNN's layer call in
#   inference and training, at 1 and 2 threads; in training also hidden
#   <= 128 with batch <= 8, where the loop's training call won (1.05-1.54x
#   per layer; at batch 8 close, but the LSTM LM's whole training step
#   ran 1.07-1.45x faster on the loop than on oneDNN at T 16 and 64, 1
#   and 2 threads), though oneDNN's forward ties at 1 thread and wins at
#   2 from batch 8 (0.77-0.83x: two threads splitting its GEMMs), so
#   inference keeps oneDNN there. Larger ones are oneDNN's. The same
#   bounds held with AVX2 (where taken: 1.10-2.35x in training,
#   1.12-1.40x in inference; ties at 0.93-0.98x with 2 threads).
#   With more than one thread (``torch.get_num_threads()`` when the graph
#   compiles) the training bound at hidden 65-128 is batch <= 4: at batch
#   8 with 2 threads the loop's training call lost to oneDNN's
#   (0.84-0.96x per layer at T 16 and 64, and the LM's step 0.89-0.96x
#   in 6 of 7 runs, 1.08x in one,
#   with glibc's malloc thresholds raised, the state of a process that
#   has freed a large block; the 1.07-1.45x above was measured in a fresh
#   process at glibc's defaults, where oneDNN's fresh workspace pages
#   fault on every call); at batch 1-4 it tied or won (0.96-1.70x).
#
# ``cpu_kernel="eager"``: never; ``"cxx"``: wherever it can run.
# ``threads``: the rule at that thread count (default: torch's now).
# Measured: ``benchmarks/rnn/cpu_rnn_kernels.py``, docs/rnn.md.
def cxx_serves(spec: RnnSpec, x: torch.Tensor, steps: Optional[int], train: bool = False,
               threads: Optional[int] = None) -> bool:
    """Does a call of ``steps`` time steps (None: symbolic) take ``cxx``, the
    C++ loop? ``train``: the call is differentiated; ``threads``: the rule at
    that thread count (default: torch's now). The rule and its measurements:
    the comment above."""
    from .. import native as _native

    choice = spec.options.cpu_kernel
    if choice == "eager" or x.device.type != "cpu" or spec.proj_size != 0 or x.dtype != torch.float32:
        return False
    if not _native.fast_loop():
        return False
    if choice == "cxx":
        return True
    if spec.mode != "LSTM":
        if _native.fast_isa() == "avx512f":
            return True
        H = spec.hidden_size
        return H <= 128 or (H <= 256 and (train or spec.mode != "GRU"))
    # A size Dynamo specialized (a training graph recompiled with symbolic
    # sizes: rewrite._must_specialize) is still a SymInt, but a concrete one.
    batch = static_int(x.shape[0 if spec.batch_first else 1])
    if steps is None or batch is None:
        return False
    H = spec.hidden_size
    return (H <= 64 and batch <= 32) or (train and H <= 128 and batch <= training_batch_bound(threads))


def training_batch_bound(threads: Optional[int] = None) -> int:
    """The largest batch at which ``auto`` gives a training LSTM of hidden
    65-128 the C++ loop at ``threads`` (default: torch's now): 8 at 1
    thread, 4 at more (``cxx_serves``)."""
    return 8 if (threads or torch.get_num_threads()) == 1 else 4


def thread_bound_words(spec: RnnSpec, x: torch.Tensor, steps: Optional[int], path: str, train: bool) -> Optional[str]:
    """Why a training call took oneDNN's layer where at 1 thread the rule
    would give it the C++ loop (``training_batch_bound``), in the row's
    words; None where the thread count decided nothing."""
    if not train or path != "mkldnn" or not cxx_serves(spec, x, steps, train, threads=1):
        return None
    batch = static_int(x.shape[0 if spec.batch_first else 1])
    return (f"training at batch {batch} with {torch.get_num_threads()} threads: oneDNN's layer (the C++ loop "
            "takes a training LSTM of hidden 65-128 up to batch 8 at 1 thread, up to 4 at more)")


def choose_path(spec: RnnSpec, x: torch.Tensor, steps: Optional[int], threshold: int, train: bool = False) -> str:
    """The path for a call of ``steps`` time steps (None: symbolic, unknown
    until run time): ``loop`` at or below the threshold, else one op per
    layer: oneDNN's LSTM layer (``mkldnn``) or ATen's native GRU / plain RNN
    (``native``), with or without grad, for static and symbolic shapes
    alike; ``loop`` or ``aten`` for the rest (LSTMs with ``proj_size`` or
    in a dtype oneDNN does not take)."""
    if steps is not None and steps <= threshold:
        return "loop"
    if x.device.type == "cuda" and spec.options.cuda == "cudnn":
        return "cudnn"
    if cxx_serves(spec, x, steps, train):
        return "cxx"
    if x.device.type == "cpu" and spec.mode == "LSTM" and spec.proj_size == 0 and _kernels.mkldnn_rnn_dtype(x.dtype):
        return "mkldnn"
    if x.device.type == "cpu" and spec.mode in native_layer.MODES:
        return "native"
    if steps is not None:
        # No fused kernel for this RNN: the per-step ops, written out here.
        # Not ATen's decomposition of torch.gru/rnn_tanh, which drops the
        # dropout between layers (torch/_decomp/decompositions.py
        # ``_rnn_helper``, torch 2.13.0) and gave wrong h_n gradients for a
        # one-layer nn.RNN whose h_n is read (seen under Inductor).
        return "loop"
    return "aten"


def kernel_words(spec: RnnSpec, path: str, x: torch.Tensor):
    """The kernel a path runs, in words a user knows, and the counter its
    calls are counted in: ``("oneDNN LSTM", "onednn_lstm_calls")``."""
    if path == "mkldnn":
        from .. import native as _native

        rows = _native.short_lstm_rows() if x.device.type == "cpu" and x.dtype == torch.float32 else 0
        if rows:
            # The op's C++ kernel takes the loop for such calls on their real
            # sizes (native/rnn/short_lstm.h): a symbolic T gets it too.
            return (f"oneDNN LSTM (an inference call of at most {rows} rows, T x batch, on wfpass's C++ loop "
                    "reading the weights as they are)"), "onednn_lstm_calls"
        return "oneDNN LSTM", "onednn_lstm_calls"
    if path == "cxx":
        from .. import native as _native

        name = {"LSTM": "LSTM", "GRU": "GRU"}.get(spec.mode, "RNN")
        return (f"C++ {name} loop (per step oneDNN's small-GEMM kernel and {_native.fast_isa_words()} gate math)",
                "cxx_loop_calls")
    if path == "cudnn":
        return "cuDNN", "cudnn_calls"
    if path == "packed":
        from .. import native as _native

        if _native.serves(x):
            both = ("; a layer's two directions at once where torch has 2+ threads"
                    if spec.bidirectional and _native.parallel_directions() else "")
            return ("C++ variable-length loop (each sequence's valid steps; per step oneDNN's small-GEMM kernel and "
                    f"{_native.fast_isa_words()} gate math{both})"), "packed_loop_calls"
        return "C++ variable-length loop (each sequence's valid steps)", "packed_loop_calls"
    if path == "packed_onednn":
        return "oneDNN LSTM over each run of equal batch size (each sequence's valid steps)", "packed_onednn_calls"
    if path == "loop":
        return "per-step path", "per_step_calls"
    if path == "native":
        from .. import native as _native

        if spec.mode == "GRU" and x.dtype in (torch.float32, torch.float64) and _native.is_loaded():
            return "C++ GRU loop", "cxx_gru_calls"
        return f"ATen's {'GRU' if spec.mode == 'GRU' else 'RNN'} kernel", "aten_rnn_calls"
    return "ATen's ops (the RNN decomposed)", "aten_calls"


def no_onednn_reason(spec: RnnSpec, x: torch.Tensor) -> Optional[str]:
    """Why a CPU LSTM that oneDNN could otherwise run takes another kernel
    here, for the report; None where it runs on oneDNN (or is no such LSTM)."""
    if x.device.type != "cpu" or spec.mode != "LSTM" or spec.proj_size != 0 or _kernels.mkldnn_rnn_dtype(x.dtype):
        return None
    if not torch.backends.mkldnn.is_available() or not _kernels.get_mkldnn_enabled():
        return "oneDNN is off in this process: ATen's LSTM kernels, as in eager"
    dtype = str(x.dtype).replace("torch.", "")
    return (f"oneDNN takes no {dtype} LSTM on this CPU (a probe call failed or the CPU lacks the instructions): "
            f"ATen's LSTM kernels, as in eager")


def paths_differ(spec: RnnSpec, x: torch.Tensor) -> bool:
    """Do the two paths run different kernels for this input? On the CPU only
    an LSTM without projections in a dtype oneDNN takes has a fused kernel."""
    if x.device.type != "cpu" or spec.options.unfused_impl == "loop":
        return True
    return spec.mode == "LSTM" and spec.proj_size == 0 and _kernels.mkldnn_rnn_dtype(x.dtype)


#: A variable-length batch's kernel, per path (``varlen.sequence.packed_path``), in the row's words.
VARLEN_SUMMARY = {
    "cudnn": "one cuDNN call in packed mode",
    "packed_onednn": "oneDNN's LSTM layer over each run of equal batch size, per layer and direction",
    "packed": "one C++ loop per layer and direction over each sequence's valid steps",
}


@dataclasses.dataclass(frozen=True)
class RnnPlan:
    """What one RNN call runs, decided once (``plan_call``).

    ``path``: the kernel path (``loop``, ``cxx``, ``mkldnn``, ``native``,
    ``aten``, ``cudnn``; a variable-length batch: ``packed``,
    ``packed_onednn``, ``cudnn``); ``kernel`` and ``counter``: that kernel in
    the report's words and the counter its calls go in; ``bucket``: the
    length it was chosen for (``"T=12"``, ``"T=symbolic"``,
    ``"T=variable"``, with ``", training"`` where training takes a kernel of
    its own); ``threshold``: N (``"auto"`` until measured); ``unfused``: the
    call is at or below N; ``why_not_onednn`` and ``thread_bound``: why an
    LSTM oneDNN could run takes another kernel, and why the thread count
    decided; ``cast``: under autocast, (compute dtype, output dtype)."""

    path: str
    kernel: str
    counter: str
    bucket: str
    varlen: bool
    steps: Optional[int]
    threshold: Union[int, str]
    train: bool
    unfused: bool = False
    why_not_onednn: Optional[str] = None
    thread_bound: Optional[str] = None
    cast: Optional[Tuple[torch.dtype, torch.dtype]] = None

    def words(self) -> str:
        """The plan in the row's words: ``"; T=12: oneDNN LSTM; threshold N=2"``."""
        if self.varlen:
            return f"; {self.bucket}: {self.kernel}"
        if self.threshold == "auto":
            return "; threshold N measured when compiled (seq_threshold='auto')"
        return f"; {self.bucket}: {self.kernel}; threshold N={self.threshold}"


def plan_call(spec: RnnSpec, x: torch.Tensor, steps: Optional[int], threshold: Union[int, str], train: bool,
              varlen: bool = False, cast=None) -> RnnPlan:
    """The plan of one call: ``x`` the input as traced (in the dtype the call
    computes in), ``steps`` its static length (None: symbolic), ``threshold``
    N (or ``"auto"``, not measured: a dry run), ``train`` whether the graph
    differentiates it, ``varlen`` a variable-length batch."""
    if varlen:
        from .varlen.sequence import packed_path

        path = packed_path(spec, x, train)
        kernel, counter = kernel_words(spec, path, x)
        return RnnPlan(path, kernel, counter, "T=variable", True, None, threshold, train, cast=cast)
    n = 0 if threshold == "auto" else threshold
    path = choose_path(spec, x, steps, n, train)
    kernel, counter = kernel_words(spec, path, x)
    bucket = f"T={steps if steps is not None else 'symbolic'}"
    if train and path != choose_path(spec, x, steps, n, False):
        bucket += ", training"  # its own kernel (an LSTM the C++ loop takes in training only)
    return RnnPlan(path, kernel, counter, bucket, False, steps, threshold, train,
                   unfused=steps is not None and steps <= n, why_not_onednn=no_onednn_reason(spec, x),
                   thread_bound=thread_bound_words(spec, x, steps, path, train), cast=cast)
