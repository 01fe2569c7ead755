"""Every wfpass op's schema, in one place: the Python modules that
register an op's kernels, fakes and gradient formulas define it from here
(:func:`define`), and the C++ sources that define one (the ops a C++
function serves alone: the prepacked linear's per-call check, the
``native_*`` probes) read the same text from the header the build writes
from this table (:func:`cxx_header`, ``#include "wfpass_schemas.h"``).

Each RNN op ``NAME`` listed with ``NAME_backward`` also has ``NAME_fw``
(the same schema: the twin without an autograd formula that compiled
forward graphs call) and, for the cuDNN ops, ``_NAME_python`` /
``_NAME_backward_python`` (the same schemas, the Python bodies a C++ kernel
calls): :func:`twins` says which, ``rnn/ops.define_rnn_op`` defines them.

Names with a leading underscore are wfpass's own plumbing (never in a
graph); the others are what a rewritten or exported graph calls.
"""
from __future__ import annotations

from typing import Dict, Iterable, Sequence

import torch

__all__ = ["SCHEMAS", "schema", "define", "twins", "all_schemas", "all_names", "cxx_header"]

#: op name -> ``"(args) -> returns"``, by the format that calls it.
SCHEMAS: Dict[str, str] = {
    # prepack
    'packed_linear': '(Tensor x, Tensor[] weights, Tensor[] biases, int rows, int site) -> Tensor',
    'packed_linear_train': '(Tensor x, Tensor[] weights, Tensor[] biases, int rows, int site) -> Tensor',
    'packed_linear_slow': '(Tensor x, Tensor[] weights, Tensor[] biases, int rows, int site) -> Tensor',
    '_pack_put': '(int site, int m, int kernel, Tensor? packed, Tensor[] weights, int rows, int sample, int eager_training) -> ()',
    '_pack_take_counts': '(int site) -> int[]',
    '_pack_forget': '(int site) -> ()',
    '_panel_pack': '(Tensor w) -> Tensor',
    '_panel_linear': '(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor',
    # linear
    'linear_by_rows': '(Tensor x, Tensor w_block, Tensor? b_block, int[] sizes, int max_rows) -> Tensor',
    'linear_group': '(Tensor x, Tensor[] params, bool[] has_bias, int direct_rows) -> Tensor[]',
    '_direct_linear': '(Tensor x, Tensor w, Tensor? bias) -> Tensor',
    'native_direct': '() -> bool',
    'native_direct_isa': '() -> str',
    'native_direct_amx': '() -> bool',
    'native_direct_bf16dot': '() -> bool',
    'native_direct_skew': '() -> bool',
    # rnn
    'lstm_layer': '(Tensor input, Tensor w_ih, Tensor w_hh, Tensor b_ih, Tensor b_hh, Tensor? hx, Tensor? cx, bool reverse, int hidden_size, bool has_biases, bool train) -> (Tensor, Tensor, Tensor, Tensor)',
    'lstm_layer_backward': '(Tensor input, Tensor w_ih, Tensor w_hh, Tensor b_ih, Tensor b_hh, Tensor? hx, Tensor? cx, Tensor output, Tensor hy, Tensor cy, Tensor? grad_output, Tensor? grad_hy, Tensor? grad_cy, bool reverse, int hidden_size, bool has_biases, Tensor workspace) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)',
    'rnn_layer': '(Tensor input, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? hx, str mode, bool reverse) -> (Tensor, Tensor)',
    'rnn_layer_backward': '(Tensor input, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? hx, Tensor output, Tensor? grad_output, Tensor? grad_hy, str mode, bool reverse) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)',
    '_gru_grad_loop': '(Tensor k_h, Tensor z, Tensor w_hh, Tensor? grad_output, Tensor? grad_hy) -> (Tensor, Tensor, Tensor)',
    '_lstm_pack_ask': '(Tensor input, Tensor w_ih, Tensor w_hh, bool reverse, int hidden_size, bool has_biases) -> ()',
    '_lstm_pack_put': '(int id, Tensor w_ih, Tensor w_hh, bool reverse, Tensor? p_ih, Tensor? p_hh, int sample) -> ()',
    '_lstm_pack_take_calls': '(int[] ids) -> int',
    '_lstm_pack_forget': '(int id, Tensor? w_ih, Tensor? w_hh) -> ()',
    # varlen
    'packed_rnn': '(Tensor data, Tensor batch_sizes, Tensor[] hx, Tensor[] weights, str mode, bool has_biases, int num_layers, float dropout, bool train, bool bidirectional, int proj_size) -> (Tensor, Tensor, Tensor)',
    'packed_zero_state': '(Tensor batch_sizes, int rows, int hidden, ScalarType dtype, Device device) -> Tensor',
    'pack_padded': '(Tensor input, Tensor lengths, bool batch_first, Tensor? order=None) -> (Tensor, Tensor)',
    'pack_padded_backward': '(Tensor grad, Tensor batch_sizes, SymInt[] input_size, bool batch_first, Tensor? order=None) -> Tensor',
    'pad_packed': '(Tensor data, Tensor batch_sizes, bool batch_first, float padding_value, SymInt total_length, Tensor? order=None) -> (Tensor, Tensor)',
    'pad_packed_backward': '(Tensor grad, Tensor batch_sizes, SymInt rows, bool batch_first, Tensor? order=None) -> Tensor',
    'packed_layer': '(Tensor data, Tensor batch_sizes, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? w_hr, Tensor? h0, Tensor? c0, str mode, bool reverse, bool train) -> (Tensor, Tensor, Tensor, Tensor)',
    'packed_layer_backward': '(Tensor data, Tensor batch_sizes, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? w_hr, Tensor? h0, Tensor? c0, Tensor out, Tensor h_n, Tensor c_n, Tensor workspace, Tensor? grad_out, Tensor? grad_hn, Tensor? grad_cn, str mode, bool reverse) -> (Tensor d_data, Tensor d_w_ih, Tensor d_w_hh, Tensor d_b_ih, Tensor d_b_hh, Tensor d_w_hr, Tensor d_h0, Tensor d_c0)',
    'packed_bilayer': '(Tensor data, Tensor batch_sizes, Tensor[] weights, Tensor? h0, Tensor? c0, str mode, bool has_biases, bool has_proj, bool train) -> (Tensor, Tensor, Tensor, Tensor, Tensor)',
    'packed_bilayer_backward': '(Tensor data, Tensor batch_sizes, Tensor[] weights, Tensor? h0, Tensor? c0, Tensor out, Tensor h_n, Tensor c_n, Tensor ws_f, Tensor ws_b, Tensor? grad_out, Tensor? grad_hn, Tensor? grad_cn, str mode, bool has_biases, bool has_proj) -> (Tensor d_data, Tensor[] d_weights, Tensor d_h0, Tensor d_c0)',
    'packed_lstm_runs': '(Tensor data, Tensor batch_sizes, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? h0, Tensor? c0, bool reverse, bool train) -> (Tensor, Tensor, Tensor, Tensor)',
    'packed_lstm_runs_backward': '(Tensor data, Tensor batch_sizes, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? h0, Tensor? c0, Tensor workspace, Tensor? grad_out, Tensor? grad_hn, Tensor? grad_cn, bool reverse) -> (Tensor d_data, Tensor d_w_ih, Tensor d_w_hh, Tensor d_b_ih, Tensor d_b_hh, Tensor d_h0, Tensor d_c0)',
    'native_fast_loop': '() -> bool',
    'native_fast_isa': '() -> str',
    'native_openmp': '() -> bool',
    'native_short_lstm_rows': '() -> int',
    # cuda
    'cudnn_rnn': '(Tensor input, Tensor[] weights, Tensor? hx, Tensor? cx, int mode, int hidden_size, int proj_size, int num_layers, bool train, bool bidirectional, int[] offsets, float dropout) -> (Tensor, Tensor, Tensor, Tensor)',
    'cudnn_rnn_backward': '(Tensor input, Tensor[] weights, Tensor? hx, Tensor? cx, Tensor output, Tensor? grad_output, Tensor? grad_hy, Tensor? grad_cy, Tensor reserve, int mode, int hidden_size, int proj_size, int num_layers, bool bidirectional, int[] offsets, bool[4] output_mask, float dropout) -> (Tensor, Tensor, Tensor, Tensor)',
    'cudnn_packed_rnn': '(Tensor data, Tensor batch_sizes, Tensor[] weights, Tensor? hx, Tensor? cx, int mode, int hidden_size, int proj_size, int num_layers, bool train, bool bidirectional, int[] offsets, float dropout) -> (Tensor, Tensor, Tensor, Tensor)',
    'cudnn_packed_rnn_backward': '(Tensor data, Tensor batch_sizes, Tensor[] weights, Tensor? hx, Tensor? cx, Tensor output, Tensor? grad_output, Tensor? grad_hy, Tensor? grad_cy, Tensor reserve, int mode, int hidden_size, int proj_size, int num_layers, bool bidirectional, int[] offsets, bool[4] output_mask, float dropout) -> (Tensor, Tensor, Tensor, Tensor)',
    '_cudnn_flat_buffer': '(Tensor[] weights, int[] offsets) -> Tensor[]',
    '_cudnn_grad_buffer': '(Tensor[] dw, Tensor[] weights, int[] offsets, Tensor like) -> Tensor',
    '_cudnn_python_bodies': '(Tensor x, Tensor data, Tensor batch_sizes, Tensor[] weights, int[] offsets) -> Tensor[]',
}

#: Ops a C++ source defines (with the C++ function that serves them);
#: every other op is defined by Python (:func:`define`).
CXX_DEFINED = ("_pack_put", "_pack_take_counts", "_pack_forget", "_panel_pack", "_panel_linear", "_direct_linear",
               "native_direct", "native_direct_isa", "native_direct_amx", "native_direct_bf16dot", "native_direct_skew",
               "_lstm_pack_put", "_lstm_pack_take_calls", "_lstm_pack_forget",
               "_gru_grad_loop", "native_fast_loop", "native_fast_isa", "native_openmp", "native_short_lstm_rows", "_cudnn_flat_buffer",
               "_cudnn_grad_buffer", "_cudnn_python_bodies")


def schema(name: str) -> str:
    """``name(args) -> returns``, as ``torch.library`` takes it."""
    return name + SCHEMAS[name]


def define(lib: torch.library.Library, name: str, tags: Sequence[torch.Tag] = ()) -> None:
    """Define ``wfpass::name`` on ``lib`` with its schema from the table."""
    if name in CXX_DEFINED:
        raise ValueError(f"wfpass::{name} is defined by the C++ kernels (schemas.CXX_DEFINED), not by Python")
    lib.define(schema(name), tags=tuple(tags))


def twins(name: str, python_bodies: bool = False) -> Dict[str, str]:
    """The ops an RNN op ``name`` brings along, each with its schema:
    ``name_fw`` (``name``'s) and, with ``python_bodies``, ``_name_python``
    and ``_name_backward_python`` (``name``'s and ``name_backward``'s)."""
    out = {f"{name}_fw": SCHEMAS[name]}
    if python_bodies:
        out[f"_{name}_python"] = SCHEMAS[name]
        out[f"_{name}_backward_python"] = SCHEMAS[f"{name}_backward"]
    return out


#: The RNN ops with twins, and whether they have Python bodies (cuDNN's).
_WITH_TWINS = {"lstm_layer": False, "rnn_layer": False, "packed_layer": False, "packed_bilayer": False,
               "packed_lstm_runs": False, "cudnn_rnn": True, "cudnn_packed_rnn": True}


def all_schemas() -> Dict[str, str]:
    """Every op wfpass defines, twins included: name -> ``"(args) -> returns"``."""
    out = dict(SCHEMAS)
    for name, bodies in _WITH_TWINS.items():
        out.update(twins(name, bodies))
    return out


def all_names() -> Iterable[str]:
    """Every op wfpass defines, twins included."""
    yield from all_schemas()


def cxx_header() -> str:
    """``wfpass_schemas.h``: one macro per C++-defined op,
    ``WFPASS_SCHEMA_<name>``, holding its ``name(args) -> returns``."""
    lines = ["// Written by wfpass/native/schemas.py (cxx_header) at build time: edit the table there.",
             "#pragma once"]
    for name in CXX_DEFINED:
        text = schema(name).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'#define WFPASS_SCHEMA_{name.lstrip("_")} "{text}"')
    return "\n".join(lines) + "\n"
