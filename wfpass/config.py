"""Options of the wformat backend and of :func:`wfpass.apply`.

A frozen dataclass, checked once when it is built: a bad value raises a
``ValueError``/``TypeError`` that names the option and the allowed values, so a
typo fails at ``torch.compile`` time instead of deep inside a kernel.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, Optional, Tuple, Union

from . import pipeline

__all__ = ["Config", "LinearOptions", "RnnOptions", "PrepackOptions", "PREPACK_MODES", "INNER_BACKENDS", "LINEAR_PATHS", "UNFUSED_IMPLS", "CPU_RNN_KERNELS", "DEFAULT_SEQ_THRESHOLD",
           "default_seq_threshold"]

#: Inner compilers that can be named by string. Any callable backend
#: ``(gm, example_inputs) -> callable`` is accepted too.
INNER_BACKENDS = ("inductor", "eager", "aot_eager")
#: How a fused sibling-linear group computes: one GEMM over the block,
#: one GEMM per member over its view of the block, or chosen from the shape.
LINEAR_PATHS = ("auto", "fused", "split")

#: ``seq_threshold=None``: N per device type, from the measured crossovers
#: (docs/rnn.md). CPU: up to T = 2 ATen's native loop beat oneDNN's fused
#: LSTM or was level for every shape measured. CUDA: cuDNN's fused kernel beat
#: the per-step loop at every length from T = 1 (H100, docs/rnn_cuda_results.md).
DEFAULT_SEQ_THRESHOLD = {"cpu": 2, "cuda": 0}


def default_seq_threshold(device_type: str) -> int:
    """``DEFAULT_SEQ_THRESHOLD`` for a device type; devices never measured get
    the CPU's value."""
    return DEFAULT_SEQ_THRESHOLD.get(device_type, DEFAULT_SEQ_THRESHOLD["cpu"])


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"wfpass option {name!r} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"wfpass option {name!r} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class LinearOptions:
    """Options of the sibling-linear format (``fuse_linears``):
    ``Config(linear=LinearOptions(...))``, or a dict of these fields
    (``wfpass.backend(linear={"path": "fused"})``).

    path:            ``"auto"`` picks per group from the static row count M
                     (``"fused"`` when M <= ``fused_max_rows``), or force
                     ``"fused"`` (one GEMM over the block) or ``"split"``
                     (one GEMM per member over its view of the block).
    fused_max_rows:  largest M for which ``"auto"`` takes the single GEMM.
    min_group_size:  smallest sibling group worth fusing (>= 2).
    """

    path: str = "auto"
    fused_max_rows: int = 4  # measured: docs/targets.md (one GEMM lost at 8 rows in three runs)
    min_group_size: int = 2

    def __post_init__(self) -> None:
        if self.path not in LINEAR_PATHS:
            raise ValueError(f"wfpass option 'linear.path' must be one of {LINEAR_PATHS}, got {self.path!r}")
        _check_int("linear.fused_max_rows", self.fused_max_rows, 0)
        _check_int("linear.min_group_size", self.min_group_size, 2)


#: How the RNN format's unfused path runs where it is called eagerly
#: (``wfpass.apply`` graphs, the ``seq_threshold="auto"`` measurement).
UNFUSED_IMPLS = ("auto", "loop")
CUDA_RNN_PATHS = ("eager", "cudnn")
#: The kernels of a CPU RNN above the threshold (``RnnOptions.cpu_kernel``).
CPU_RNN_KERNELS = ("auto", "eager", "cxx")


@dataclasses.dataclass(frozen=True)
class RnnOptions:
    """Options of the RNN format: ``Config(rnn=RnnOptions(...))``, or a dict
    of these fields (``wfpass.backend(rnn={"unfused_impl": "loop"})``).

    unfused_impl:  the unfused path (T <= ``seq_threshold``) where it runs
                   eagerly: ``"auto"``: on the CPU ATen's own kernel (one
                   call for all steps; oneDNN switched off for an LSTM),
                   elsewhere the per-step loop in PyTorch ops; ``"loop"``:
                   that loop everywhere (it is what compiled graphs trace).
    seq_threshold: RNN calls with at most this many time steps take the
                   unfused per-step path; ``"auto"`` measures once per shape;
                   ``None`` (default): the measured default of the RNN's
                   device, ``DEFAULT_SEQ_THRESHOLD`` (docs/rnn.md).
    auto_lengths:  the sequence lengths ``seq_threshold="auto"`` times, in
                   increasing order; it stops after the fused kernel wins at
                   two lengths in a row.
    cuda:          RNNs on CUDA: ``"eager"`` (default) leaves them to a
                   graph break, and PyTorch's own cuDNN path runs them, as
                   without wfpass (``wfpass.export`` leaves it to
                   ``torch.export``); ``"cudnn"`` puts each into the compiled
                   graph (and the exported program) as one cuDNN call
                   reading the flat block (checked on fake CUDA tensors,
                   not yet measured on a GPU).
    cpu_kernel:    the kernels of a float32 CPU RNN above the threshold:
                   ``"auto"`` (default) wfpass's C++ loop where it was
                   measured faster than eager's kernels (docs/rnn.md): every
                   GRU and plain RNN (with AVX2 only: up to hidden 256, a
                   GRU's inference up to 128), and a small LSTM (hidden
                   size <= 64 with batch <= 32; in training also <= 128
                   with batch <= 8 at 1 thread, <= 4 at more; static
                   sizes, or those a training graph specialized after a
                   dynamic recompile), on a CPU with AVX-512 or AVX2 with
                   FMA; the kernels eager PyTorch
                   runs otherwise (oneDNN's LSTM, ATen's GRU and RNN);
                   ``"eager"``: those kernels always; ``"cxx"``: the C++
                   loop wherever it can run.
    """

    seq_threshold: Union[int, str, None] = None  # per device: DEFAULT_SEQ_THRESHOLD
    unfused_impl: str = "auto"
    auto_lengths: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    cuda: str = "eager"
    cpu_kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.seq_threshold is not None and self.seq_threshold != "auto":
            if isinstance(self.seq_threshold, str):
                raise ValueError(f"wfpass option 'rnn.seq_threshold' must be an int >= 0, 'auto' or None, "
                                 f"got {self.seq_threshold!r}")
            _check_int("rnn.seq_threshold", self.seq_threshold, 0)
        if self.unfused_impl not in UNFUSED_IMPLS:
            raise ValueError(f"wfpass option 'rnn.unfused_impl' must be one of {UNFUSED_IMPLS}, got {self.unfused_impl!r}")
        if self.cuda not in CUDA_RNN_PATHS:
            raise ValueError(f"wfpass option 'rnn.cuda' must be one of {CUDA_RNN_PATHS}, got {self.cuda!r}")
        if self.cpu_kernel not in CPU_RNN_KERNELS:
            raise ValueError(f"wfpass option 'rnn.cpu_kernel' must be one of {CPU_RNN_KERNELS}, "
                             f"got {self.cpu_kernel!r}")
        lengths = self.auto_lengths
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (tuple, list)):
            raise TypeError(f"wfpass option 'rnn.auto_lengths' must be a tuple of ints, got {lengths!r}")
        for n in lengths:
            _check_int("rnn.auto_lengths", n, 1)
        if not lengths or any(a >= b for a, b in zip(lengths, lengths[1:])):
            raise ValueError(f"wfpass option 'rnn.auto_lengths' must be a non-empty, increasing tuple of lengths, got {lengths!r}")
        object.__setattr__(self, "auto_lengths", tuple(lengths))


#: How the packed-weight format chooses: measured per shape, always where a
#: kernel can pack the dtype, or never.
PREPACK_MODES = ("auto", "always", "off")


@dataclasses.dataclass(frozen=True)
class PrepackOptions:
    """Options of the prepacked-weight format (``prepack_linears``):
    ``Config(prepack=PrepackOptions(...))``, or a dict of these fields
    (``wfpass.backend(prepack={"max_bytes": 64 << 20})``).

    mode:      ``"auto"``: per linear and row count, the kernel measured
               fastest for that shape on this machine (the plain GEMM where
               no other kernel beats it; first wfpass's ``direct`` kernel,
               float32 on AVX2 or AVX-512, which reads the parameter
               itself and needs no copy, then the packed kernels where
               clearly faster still); ``"always"``: a packed kernel
               wherever one takes the dtype, unmeasured (float32: oneDNN's
               small-GEMM ukernel over a copy in 64-column panels where the
               CPU has AVX2 or AVX-512, else oneDNN's packed linear);
               ``"off"``: no packed copies.
    training:  also pack linears in graphs that compute gradients: the
               forward reads the packed copy, the backward the parameter,
               and the copy is made again after every optimizer step.
               Off by default: measured slower than the plain GEMM for
               training steps (docs/guide/prepack.md).
    The same options govern the copies an inference LSTM on oneDNN's
    layer op keeps of its weights in oneDNN's layout (``fuse_rnn``,
    ``docs/rnn.md``): ``mode="off"`` makes none, and they count against
    ``max_bytes`` with the linears' copies.

    max_bytes: the budget of packed copies alive in the process:
               ``"weights"`` (the default), the bytes of the weights of
               every graph this format rewrote, and of every parameter set
               such a graph ran with (regional compilation: every layer);
               for one model: its weights' bytes, so the copies at most
               double them, and never more than memory leaves: a copy is
               made only where a fifth of the memory the process may use
               (its cgroup's limit, else the machine's) stays free after
               it, read when the copy is made (``core/memory.py``;
               ``python -m wfpass doctor`` shows the bound now); an int, that many bytes (0: no packed copies,
               the ``direct`` kernel where it runs and was measured
               faster, else the plain GEMM); ``None``: no bound. The kernels the library compiles for
               packed calls (oneDNN: one per weight shape and row count,
               0.55-0.6 MiB each on torch 2.13, kept for the process) are bounded by the
               same number on their own (``kernel_bytes`` in the row). A
               copy or kernel that would go over is not made: that linear's
               weights and row count run the kernel that needs no copy
               (``direct`` where measured faster, else the plain GEMM;
               counted ``over_bound_calls``, said in its row).
    """

    mode: str = "auto"
    training: bool = False
    max_bytes: Union[int, str, None] = "weights"

    def __post_init__(self) -> None:
        if self.mode not in PREPACK_MODES:
            raise ValueError(f"wfpass option 'prepack.mode' must be one of {PREPACK_MODES}, got {self.mode!r}")
        if not isinstance(self.training, bool):
            raise TypeError(f"wfpass option 'prepack.training' must be a bool, got {self.training!r}")
        if isinstance(self.max_bytes, str):
            if self.max_bytes != "weights":
                raise ValueError("wfpass option 'prepack.max_bytes' must be 'weights', a number of bytes >= 0 or None, "
                                 f"got {self.max_bytes!r}")
        elif self.max_bytes is not None:
            _check_int("prepack.max_bytes", self.max_bytes, 0)


class _Unset:
    """The default of a deprecated flat option: not given."""

    def __repr__(self) -> str:
        return "<not given>"

    def __reduce__(self):
        return "_UNSET"


_UNSET = _Unset()

#: Deprecated flat option -> (options group, field).
#: Earlier names in ``passes`` (the format and its report pattern) -> today's.
_RENAMED_PASSES = {"pack_linears": "prepack_linears", "pack": "prepack"}

_FLAT = {"linear_path": ("linear", "path"), "fused_max_rows": ("linear", "fused_max_rows"),
         "min_group_size": ("linear", "min_group_size"), "seq_threshold": ("rnn", "seq_threshold")}


def _options(name: str, cls: type, value: Any) -> Any:
    """``value`` as a ``cls`` (an options dataclass), from an instance or a
    dict of its fields, with errors that name the option."""
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"unknown wfpass option(s) {[name + '.' + k for k in unknown]}; allowed: "
                             f"{sorted(name + '.' + k for k in fields)}")
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"wfpass option {name!r} must be a wfpass.{cls.__name__} or a dict of its fields, got "
                        f"{type(value).__name__}")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """All wfpass options. Build with keywords; every field is checked.

    inner:            compiler the rewritten graph goes to: one of
                      ``INNER_BACKENDS`` or a backend callable.
    passes:           names of the formats to run (``None``: every registered
                      one, in pipeline order: ``wfpass/builtin.py``
                      lists the built-ins, users' formats follow), or the
                      report's pattern names, each standing for every format
                      that reports under it (``"rnn"``: ``fold_cells`` and
                      ``fuse_rnn``).
    linear:           the sibling-linear format's options
                      (:class:`LinearOptions`, or a dict of its fields).
    rnn:              the RNN format's options (:class:`RnnOptions`, or a
                      dict of its fields).
    prepack:          the prepacked-weight format's options
                      (:class:`PrepackOptions`, or a dict of its fields).
    fold_batchnorm:   fold eval-mode BatchNorm into the conv/linear before it
                      (inference only).
    dry_run:          decide and report, change nothing (used by ``explain``).
    linear_path, fused_max_rows, min_group_size, seq_threshold:
                      the earlier flat names of ``linear.path``,
                      ``linear.fused_max_rows``, ``linear.min_group_size``
                      and ``rnn.seq_threshold``: still accepted, with a
                      ``DeprecationWarning``, for one release.
    pack:             the earlier name of ``prepack`` (and in ``passes``,
                      ``"pack"`` / ``"pack_linears"`` of ``"prepack"`` /
                      ``"prepack_linears"``): accepted the same way.
    """

    inner: Union[str, Callable] = "inductor"
    passes: Optional[tuple] = None
    linear: LinearOptions = LinearOptions()
    rnn: RnnOptions = RnnOptions()
    prepack: PrepackOptions = PrepackOptions()
    fold_batchnorm: bool = False
    dry_run: bool = False
    # Deprecated flat names (one release): folded into ``linear`` / ``rnn``
    # when given, then reset, so every reader uses the nested options.
    linear_path: Any = dataclasses.field(default=_UNSET, repr=False)
    fused_max_rows: Any = dataclasses.field(default=_UNSET, repr=False)
    min_group_size: Any = dataclasses.field(default=_UNSET, repr=False)
    seq_threshold: Any = dataclasses.field(default=_UNSET, repr=False)
    pack: Any = dataclasses.field(default=_UNSET, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.inner, str):
            if self.inner not in INNER_BACKENDS:
                raise ValueError(
                    f"wfpass option 'inner' must be one of {INNER_BACKENDS} or a backend callable, got {self.inner!r}"
                )
        elif not callable(self.inner):
            raise TypeError(
                f"wfpass option 'inner' must be a string {INNER_BACKENDS} or a callable, got {type(self.inner).__name__}"
            )
        self._take_renamed()
        if self.passes is not None:
            formats = pipeline.registered()
            known = tuple(f.name for f in formats)
            # The report's pattern names ("rnn", "linear", "batchnorm", "prepack")
            # stand for every format that files rows under them.
            by_pattern: Dict[str, list] = {}
            for f in formats:
                by_pattern.setdefault(getattr(f, "pattern", None) or f.name, []).append(f.name)
            allowed = f"format names {list(known)} or the report's pattern names {sorted(by_pattern)}"
            if isinstance(self.passes, str) or not isinstance(self.passes, (tuple, list)):
                raise TypeError(f"wfpass option 'passes' must be a tuple of {allowed}, got {self.passes!r}")
            unknown = [p for p in self.passes if p not in known and p not in by_pattern]
            if unknown:
                raise ValueError(f"wfpass option 'passes' has unknown names {unknown}; allowed: {allowed}")
            chosen = {n for p in self.passes for n in ([p] if p in known else by_pattern[p])}
            object.__setattr__(self, "passes", tuple(n for n in known if n in chosen))
        object.__setattr__(self, "linear", _options("linear", LinearOptions, self.linear))
        object.__setattr__(self, "rnn", _options("rnn", RnnOptions, self.rnn))
        object.__setattr__(self, "prepack", _options("prepack", PrepackOptions, self.prepack))
        for flat, (group, field) in _FLAT.items():
            value = getattr(self, flat)
            if value is _UNSET:
                continue
            warnings.warn(f"wfpass option {flat!r} is now {group}={{'{field}': ...}}; the flat name goes in the "
                          f"next release", DeprecationWarning, stacklevel=3)
            nested = getattr(self, group)
            default = getattr(type(nested)(), field)
            if getattr(nested, field) != default and getattr(nested, field) != value:
                raise ValueError(f"wfpass options {flat!r} and '{group}.{field}' disagree ({value!r} against "
                                 f"{getattr(nested, field)!r}); give '{group}.{field}' only")
            try:
                object.__setattr__(self, group, dataclasses.replace(nested, **{field: value}))
            except (TypeError, ValueError) as e:  # the nested check's message, under the name the caller used
                raise type(e)(str(e).replace(f"'{group}.{field}'", f"{flat!r}")) from None
            object.__setattr__(self, flat, _UNSET)
        for flag in ("fold_batchnorm", "dry_run"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"wfpass option {flag!r} must be a bool, got {getattr(self, flag)!r}")

    def _take_renamed(self) -> None:
        """The earlier names of the prepacked-weight format's option and of
        the format itself in ``passes``, with a ``DeprecationWarning``."""
        if self.pack is not _UNSET:
            warnings.warn("wfpass option 'pack' is now 'prepack'; the old name goes in the next release",
                          DeprecationWarning, stacklevel=4)
            if self.prepack != PrepackOptions() and self.prepack != self.pack:
                raise ValueError("wfpass options 'pack' and 'prepack' are both given; give 'prepack' only")
            try:
                object.__setattr__(self, "prepack", _options("pack", PrepackOptions, self.pack))
            except (TypeError, ValueError) as e:  # the nested check names 'prepack.*'; the caller wrote 'pack'
                raise type(e)(str(e).replace("'prepack.", "'pack.")) from None
            object.__setattr__(self, "pack", _UNSET)
        if isinstance(self.passes, (tuple, list)) and any(p in _RENAMED_PASSES for p in self.passes):
            old = [p for p in self.passes if p in _RENAMED_PASSES]
            warnings.warn(f"wfpass option 'passes': {old} are now {[_RENAMED_PASSES[p] for p in old]}; the old "
                          "names go in the next release", DeprecationWarning, stacklevel=4)
            object.__setattr__(self, "passes", tuple(_RENAMED_PASSES.get(p, p) for p in self.passes))

    def runs(self, name: str) -> bool:
        """Does this config run the format called ``name``?"""
        return self.passes is None or name in self.passes

    @classmethod
    def from_options(cls, **options: Any) -> "Config":
        """``Config(**options)`` with a clear error for an unknown option name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown wfpass option(s) {unknown}; allowed: {sorted(names)}")
        return cls(**options)


def __getattr__(name: str) -> Any:
    # ``PackOptions`` was the earlier name of ``PrepackOptions``.
    if name == "PackOptions":
        warnings.warn("wfpass.PackOptions is now wfpass.PrepackOptions; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return PrepackOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
