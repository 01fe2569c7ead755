"""The printed report: it fits the terminal (120 columns when the width is
unknown), never cuts a parameter name, writes a common prefix once, and
renders any pattern or action; ``to_dict()`` keeps every field."""
from __future__ import annotations

import json
import re

import pytest
import torch

import wfpass
from wfpass.core.records import Record, Report

transformers = pytest.importorskip("transformers")


def _records_in(text: str):
    """Parse a rendered report back: for each row, (pattern, action, names)
    with the names rebuilt from ``prefix{a, b}`` over however many lines
    they were wrapped."""
    lines = text.splitlines()
    h = next(i for i, line in enumerate(lines) if line.startswith("pattern "))  # after the (wrapped) title
    assert set(lines[h + 1]) <= {"-", " "}, text
    indent = lines[h].index("parameters")
    rows, cur = [], None
    for line in lines[h + 2:]:
        if line and not line[0].isspace():
            pattern, action = re.match(r"(\S+)\s+(would rewrite|\S+)", line).groups()
            cur = [pattern, action, []]
            rows.append(cur)
            rest = line[indent:] if len(line) > indent else ""
            if rest.strip():
                cur[2].append(rest.strip())
        else:
            cur[2].append(line.strip())
    out = []
    for pattern, action, details in rows:
        param_lines = []
        for d in details:
            if d.startswith(("why: ", "counts: ")):
                break
            param_lines.append(d)
        text_params = " ".join(param_lines).replace("{ ", "{")
        if "{" in text_params:
            prefix, members = text_params.split("{", 1)
            assert members.endswith("}"), text_params
            names = [prefix + m for m in members[:-1].split(", ")]
        else:
            names = text_params.split(", ")
        out.append((pattern, action, names))
    return out


def _check(rep: Report, width: int) -> str:
    text = rep.render(width)
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, "\n".join(too_long)
    parsed = _records_in(text)
    assert [(p, a) for p, a, _ in parsed] == [(r.pattern, r.action) for r in rep.records]
    for (_, _, names), r in zip(parsed, rep.records):
        assert names == r.params, (names, r.params)
    return text


def _bert():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32)
    return transformers.BertModel(cfg).eval(), (torch.randint(0, 100, (1, 8)),)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval(), (torch.randint(0, 100, (1, 1)),)


def _encodec():
    cfg = transformers.EncodecConfig(target_bandwidths=[16.0], sampling_rate=8000, audio_channels=1, hidden_size=16,
                                     num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
                                     codebook_size=16, codebook_dim=16, num_lstm_layers=2)
    return transformers.EncodecModel(cfg).eval(), (torch.randn(1, 1, 64),)


def _resnet_bf16():
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    layer_type="basic")
    return transformers.ResNetModel(cfg).to(torch.bfloat16).eval(), (torch.randn(2, 3, 32, 32, dtype=torch.bfloat16),)


@pytest.mark.parametrize("build,patterns", [(_bert, {"linear"}), (_llama, {"linear"}), (_encodec, {"rnn"}),
                                            (_resnet_bf16, {"batchnorm"})], ids=["bert", "llama", "encodec", "resnet-bf16"])
def test_report_of_real_models_fits_120_and_80_columns_without_cutting_a_name(build, patterns, monkeypatch):
    torch.manual_seed(0)
    model, inputs = build()
    with torch.no_grad():
        torch.compile(model, backend=wfpass.backend(inner="eager"))(*inputs)
    rep = wfpass.report(model)
    assert patterns <= {r.pattern for r in rep.rewritten}, str(rep)
    # The width comes from the terminal; unknown (not a terminal, no COLUMNS) means 120.
    monkeypatch.delenv("COLUMNS", raising=False)
    assert str(rep) == _check(rep, 120)
    monkeypatch.setenv("COLUMNS", "80")
    assert str(rep) == _check(rep, 80)
    longest = max(len(n) for r in rep.records for n in r.params)
    assert longest > 30  # real, long dotted names were rendered whole


def test_common_prefix_is_written_once():
    rep = Report("t")
    names = [f"encoder.layer.0.attention.self.{m}.{w}" for m in ("query", "key", "value") for w in ("weight", "bias")]
    rep.add("linear", "rewritten", "3 linears in one block", names)
    text = _check(rep, 120)
    assert text.count("encoder.layer.0.attention.self.") == 1
    assert "encoder.layer.0.attention.self.{query.weight, query.bias, key.weight" in text


def test_any_pattern_and_action_renders_and_to_dict_keeps_every_field(monkeypatch):
    # A pattern the renderer has never heard of, a long name that cannot fit
    # a narrow line, and an action outside the usual three.
    monkeypatch.setattr(Record, "__post_init__", lambda self: None)
    rep = Report("wfpass report (test)")
    long = "model." + ".".join(f"block{i}" for i in range(20)) + ".cell.weight_ih"
    rec = rep.add("rnn_cell_loop", "folded", "12 LSTMCell steps -> one LSTM call", [long, "model.other.weight_hh"])
    rec.bump("loop_calls", 3)
    rep.add("linear", "skipped", "reason; reason", [])
    text = rep.render(60)
    # A name is never cut: the one line allowed past 60 columns holds that name whole.
    assert _records_in(text)[0][2] == [long, "model.other.weight_hh"]
    assert [line for line in text.splitlines() if len(line) > 60] == [next(line for line in text.splitlines() if "block19" in line)]
    assert "rnn_cell_loop" in text and "folded" in text and "loop_calls=3" in text
    assert "why: reason\n" in text + "\n"  # a clause repeated word for word is shown once
    assert "(no parameters)" in text
    d = json.loads(rep.to_json())
    assert d["records"][0] == {"pattern": "rnn_cell_loop", "action": "folded", "reason": "12 LSTMCell steps -> one LSTM call",
                               "params": [long, "model.other.weight_hh"], "stats": {"loop_calls": 3}, "detail": {}}
    assert d["records"][1]["reason"] == "reason; reason"  # to_dict keeps the reason as written


def test_header_counts_actions_and_empty_report():
    rep = Report("wfpass report (x)")
    assert "no pattern" in str(rep)
    rep.add("linear", "rewritten", "r", ["a.weight", "b.weight"])
    rep.add("batchnorm", "skipped", "input is float32", ["bn.weight"])
    assert str(rep).splitlines()[0] == "wfpass report (x): 1 rewritten, 1 skipped"
    long_title = Report("wfpass report for AVeryLongModelName (every graph, recompile and graph break)")
    long_title.records = rep.records
    assert all(len(line) <= 60 for line in long_title.render(60).splitlines())


def test_a_row_over_several_graphs_names_every_path_and_the_report_sums_calls():
    """Two static graphs, one at 1 row (one GEMM) and one at 8 rows (one GEMM
    per member): the one row that counts both names both paths with their
    counters, and the report's first lines say how often each path ran."""
    from models import QKV

    torch._dynamo.reset()
    model = QKV()
    fn = torch.compile(model, backend=wfpass.backend(inner="eager", prepack={"mode": "off"}), dynamic=False)
    for rows in (1, 8, 8):
        fn(torch.randn(rows, 32))
    (rec,) = wfpass.report(model).find("linear", "rewritten")
    assert rec.stats["fused_calls"] == 1 and rec.stats["split_calls"] == 2
    assert "M=1 <= fused_max_rows=4: one GEMM (fused_calls)" in rec.reason
    assert "M=8 > fused_max_rows=4: one GEMM per member over views of the fused block (split_calls)" in rec.reason
    text = wfpass.report(model).render(width=200)
    line = text.splitlines()[1]
    assert line.startswith("calls so far: linear: ") and "fused_calls=1" in line and "split_calls=2" in line


def test_markdown_form_has_one_row_per_record_and_keeps_every_cell_whole():
    """``Report.to_markdown()`` (and Jupyter's ``_repr_markdown_``): a
    heading with the counts, then a markdown table, one row per record,
    nothing cut; a ``|`` inside a reason is escaped so the row keeps its
    five cells."""
    rep = Report("r")
    long_reason = "a reason with a | pipe " + "and many words " * 20
    rep.add("linear", "rewritten", long_reason, ["layers.0.q.weight", "layers.0.k.weight"]).bump("fused_calls", 3)
    rep.add("rnn", "skipped", "short", [])
    md = rep.to_markdown()
    assert md == rep._repr_markdown_()
    lines = md.strip().splitlines()
    assert lines[0] == "**r**: 1 rewritten, 1 skipped" and lines[1] == ""
    table = lines[2:]
    assert len(table) == 2 + len(rep.records)
    assert [c.strip() for c in table[0].strip("|").split("|")] == ["pattern", "action", "parameters", "why", "counters"]
    row = table[2]
    assert len(re.split(r"(?<!\\)\|", row.strip().strip("|"))) == 5  # the escaped pipe splits nothing
    assert "`layers.0.q.weight`, `layers.0.k.weight`" in row and "fused_calls=3" in row
    assert "and many words " * 19 in row.replace("\\|", "|")
    assert Report("empty").to_markdown() == "**empty**: no pattern of any registered format found"
