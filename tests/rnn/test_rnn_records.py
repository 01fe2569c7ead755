"""Every RNN wfpass meets gets a record, including the ones Dynamo never
hands to a backend (packed sequences) and cell loops that cannot be folded
(an attention decoder in the style of Tacotron2)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import wfpass


class PackedEncoder(nn.Module):
    """Tacotron2's encoder shape: a packed LSTM, next to an RNN that is captured."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True, bidirectional=True)
        self.post = nn.GRU(16, 8)

    def forward(self, x, lengths):
        p = pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(p)
        y, _ = pad_packed_sequence(out, batch_first=True)
        return self.post(y.transpose(0, 1))[0]


class AttentionDecoder(nn.Module):
    """Two decoder cells fed by attention over the encoder output and by the
    previous frame: every step depends on the one before."""

    def __init__(self, d=8):
        super().__init__()
        self.attention_rnn = nn.LSTMCell(2 * d, d)
        self.decoder_rnn = nn.LSTMCell(2 * d, d)
        self.query, self.proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, memory, steps: int = 4):
        B, _, d = memory.shape
        h1 = c1 = h2 = c2 = memory.new_zeros(B, d)
        frame = memory.new_zeros(B, d)
        frames = []
        for _ in range(steps):
            score = torch.softmax((memory @ self.query(h1).unsqueeze(-1)).squeeze(-1), -1)
            context = (score.unsqueeze(-1) * memory).sum(1)
            h1, c1 = self.attention_rnn(torch.cat([frame, context], -1), (h1, c1))
            h2, c2 = self.decoder_rnn(torch.cat([h1, context], -1), (h2, c2))
            frame = self.proj(h2)
            frames.append(frame)
        return torch.stack(frames, 1)


def test_packed_sequence_rnn_gets_a_record_and_stays_right():
    m = PackedEncoder()
    ref = copy.deepcopy(m)
    x, lengths = torch.randn(3, 5, 4), torch.tensor([5, 2, 4])
    # aot_eager: the records are the pass's (a packed RNN through Inductor: test_varlen_rnn.py).
    out = torch.compile(m, backend=wfpass.backend(inner="aot_eager"))(x, lengths)
    torch.testing.assert_close(out, ref(x, lengths), rtol=1e-5, atol=1e-6)
    recs = {r.params[0].split(".")[0]: r for r in wfpass.report(m).records if r.pattern == "rnn"}
    # The packed LSTM is in the graph (rnn/packed/sequence.py), on every supported
    # torch, 2.11 included; its record replaced the provisional one.
    assert recs["lstm"].action == "rewritten" and "variable-length batch" in recs["lstm"].reason
    assert len(recs["lstm"].params) == 8  # both directions
    assert recs["post"].action == "rewritten"


def test_attention_decoder_cells_are_reported_not_folded():
    m = AttentionDecoder()
    ref = copy.deepcopy(m)
    mem = torch.randn(2, 6, 8)
    # aot_eager: the cells are reported by the fold pass before any inner
    # compiler; Inductor compiling the unrolled attention steps cost seconds.
    out = torch.compile(m, backend=wfpass.backend(inner="aot_eager"))(mem)
    torch.testing.assert_close(out, ref(mem), rtol=1e-5, atol=1e-6)
    recs = [r for r in wfpass.report(m).records if r.pattern == "rnn"]
    named = {p.split(".")[0] for r in recs for p in r.params}
    assert named == {"attention_rnn", "decoder_rnn"}
    assert all(r.action == "skipped" and "depends on an earlier step" in r.reason for r in recs), [r.reason for r in recs]


def test_frozen_graph_every_module_has_a_record():
    """Inductor's ``freezing=True``: Dynamo keeps the parameters as graph
    attributes. The sibling linears are skipped with the reason, the LSTM is
    lowered, and both appear in the model's report under its own names."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            self.rnn = nn.LSTM(8, 8)

        def forward(self, x):
            return self.rnn(self.q(x) + self.k(x) * self.v(x))[0]

    m = M().eval()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 2, 8)
    # Inductor's own patch context: monkeypatch.setattr leaves the config
    # module without the attribute afterwards.
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        torch.testing.assert_close(torch.compile(m, backend="wformat")(x), ref(x), rtol=1e-5, atol=1e-6)
    recs = {r.pattern: r for r in wfpass.report(m).records}
    assert recs["linear"].action == "skipped" and "freezing=True" in recs["linear"].reason
    assert recs["linear"].params == ["q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias"]
    assert recs["rnn"].action == "rewritten"


def test_rnn_rows_name_the_kernel_per_length_with_its_calls():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.gru = nn.LSTM(4, 8, 2), nn.GRU(8, 8)

        def forward(self, x):
            return self.gru(self.lstm(x)[0])[0]

    from wfpass import native

    m = Two()
    x = torch.randn(12, 3, 4)
    # A small LSTM (hidden 8, batch 3) runs wfpass's C++ loop where its fast
    # steps can run (AVX-512 or AVX2), oneDNN's LSTM elsewhere (cpu_lstm="auto").
    words, counter = (("C++ LSTM loop", "cxx_loop_calls") if native.fast_loop()
                      else ("oneDNN LSTM", "onednn_lstm_calls"))
    plan = {r.params[0].split(".")[0]: r.reason for r in wfpass.explain(Two(), x).records}
    assert f"T=12: {words}" in plan["lstm"] and "threshold N=2" in plan["lstm"], plan
    f = torch.compile(m, backend=wfpass.backend(inner="aot_eager"))
    with torch.no_grad():
        for T in (12, 12, 2):
            f(torch.randn(T, 3, 4))
    recs = {r.params[0].split(".")[0]: r for r in wfpass.report(m).find("rnn", "rewritten")}
    lstm, gru = recs["lstm"], recs["gru"]
    assert f"T=12: {words}" in lstm.reason and f"({counter})" in lstm.reason
    assert "T=2: per-step path (per_step_calls)" in lstm.reason
    assert "threshold N=2" in lstm.reason
    assert lstm.stats[counter] == 2 and lstm.stats["per_step_calls"] == 1
    assert "C++ GRU loop" in gru.reason or "ATen's GRU kernel" in gru.reason
    assert gru.stats["per_step_calls"] == 1 and lstm.stats["fused_calls"] + lstm.stats["unfused_calls"] == 3


def test_packed_rnn_row_names_its_kernel():
    """Without grad a packed LSTM runs oneDNN's LSTM layer run by run
    where the C++ loop has no raw-pointer path for fp32 (else that loop); a
    training call (a second graph) the C++ loop: the row names the kernels,
    each with its count."""
    from wfpass import native
    from wfpass._torch.kernels import mkldnn_rnn_dtype

    m = PackedEncoder()
    f = torch.compile(m, backend=wfpass.backend(inner="aot_eager"))
    x, lengths = torch.randn(3, 5, 4), torch.tensor([5, 2, 4])
    with torch.no_grad():
        f(x, lengths)
    (row,) = [r for r in wfpass.report(m).find("rnn", "rewritten") if r.params[0].startswith("lstm")]
    runs = mkldnn_rnn_dtype(torch.float32) and not native.fast_loop()
    if runs:
        assert "T=variable: oneDNN LSTM over each run of equal batch size" in row.reason, row.reason
        assert row.stats["packed_onednn_calls"] == 1, row.stats
    else:
        assert row.stats["packed_loop_calls"] == 1, row.stats
    if native.fast_loop():
        assert f"oneDNN's small-GEMM kernel and {native.fast_isa_words()} gate math" in row.reason, row.reason
    # a bidirectional LSTM: packed_bilayer_fw runs both directions at once where it can
    assert ("two directions at once" in row.reason) == native.parallel_directions(), row.reason
    f(x.requires_grad_(), lengths)
    (row,) = [r for r in wfpass.report(m).find("rnn", "rewritten") if r.params[0].startswith("lstm")]
    assert "T=variable: C++ variable-length loop" in row.reason, row.reason
    assert row.stats["packed_loop_calls"] == (1 if runs else 2), row.stats
