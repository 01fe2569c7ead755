"""Packed weights: HF LLaMA ``generate()`` and training steps under eager,
Inductor, Inductor ``freezing=True`` and wformat, each variant in its own
process, rounds interleaved.

    python benchmarks/prepack/bench_pack.py --out docs/results/prepack_generate.md --json docs/results/data/prepack_generate.json [--rounds 5] [--threads 1 2]

Per config and thread count, one worker process per variant compiles
``model.forward = torch.compile(model.forward, ...)`` (Dynamo's cache is per
code object: variants sharing a process would share it, and a later one can
silently run eagerly) and answers the coordinator's requests, so the
rounds interleave the variants: round r times eager, then Inductor, then
freezing, then wformat, each one ``generate()`` of 48 new tokens after 16.
Cells: median over rounds, ms per new token. Also per variant: the first
``generate()`` (compile included, Inductor's caches off) and, after the
weights change between two ``generate()`` calls (an optimizer step, then
a ``load_state_dict``), the largest difference of its logits from eager's
with the same new weights.

``--train``: a training step (forward, ``(logits * R).sum()`` backward, SGD
step) of the bf16 decoder at 8, 64 and 512 rows, Inductor default against
wformat (packing off in training, its default) and wformat with
``prepack.training=True``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _worker.py
import _worker  # noqa: E402

CONFIGS = {
    "d512-bf16": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=1408, vocab_size=8000, dtype="bfloat16"),
    "d1024-bf16": dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
                       intermediate_size=2816, vocab_size=8000, dtype="bfloat16"),
    "d512-fp32": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=1408, vocab_size=8000, dtype="float32"),
}
VARIANTS = ("eager", "inductor", "freezing", "wformat")
PROMPT, NEW = 16, 48


# -- the worker: one variant, one process -------------------------------------------


def _model(cfg: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(cfg)
    dtype = getattr(torch, cfg.pop("dtype"))
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**cfg, max_position_embeddings=1024, attn_implementation="sdpa"))
    return m.to(dtype).eval(), dtype


def _compile(model, variant: str):
    import torch

    import wfpass

    if variant == "eager":
        return
    if variant == "freezing":
        import torch._inductor.config as ic

        ic.freezing = True
    backend = {"inductor": "inductor", "freezing": "inductor", "wformat": "wformat"}[variant]
    model.forward = torch.compile(model.forward, backend=backend)
    _ = wfpass  # registers nothing new: "wformat" comes from the entry point


def worker(config: str, variant: str, threads: int, train: bool) -> None:
    import torch

    from wfpass._torch.aot import disable_compile_caches, stop_compile_workers

    torch.set_num_threads(threads)
    disable_compile_caches()
    torch._dynamo.config.recompile_limit = 64
    model, dtype = _model(CONFIGS[config])
    out = sys.stdout
    if train:
        _train_worker(model, variant, out)
        return
    import copy

    ref = copy.deepcopy(model)  # eager, for the weight-change check
    _compile(model, variant)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=g)

    def gen():
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)

    t = time.perf_counter()
    gen()
    first = time.perf_counter() - t
    gen()  # the decode graphs' recompile for a growing cache, if any
    stop_compile_workers()
    print(json.dumps({"ready": True, "first_s": first}), file=out, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "time":
            t = time.perf_counter()
            gen()
            print(json.dumps({"ms_per_token": (time.perf_counter() - t) * 1e3 / NEW}), file=out, flush=True)
        elif cmd == "stale":
            print(json.dumps(_stale_check(model, ref, prompt)), file=out, flush=True)
        elif cmd == "quit":
            break


def _stale_check(model, ref, prompt):
    """Change the weights twice (an SGD step, a load_state_dict) between
    two ``generate()`` calls; the largest logit difference from eager with
    the same weights after each, and whether the tokens match."""
    import torch

    def logits(m):
        with torch.no_grad():
            out = m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits).float()

    res = {}
    s0, l0 = logits(model)
    r0, lr0 = logits(ref)
    res["before"] = {"max_logit_diff": (l0 - lr0).abs().max().item(), "tokens_equal": bool(torch.equal(s0, r0))}
    # An optimizer step on both (same gradient: a fixed projection of the logits).
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        with torch.enable_grad():
            x = prompt
            out = m.model(x).last_hidden_state  # the decoder, uncompiled entry; the same weights
            g = torch.Generator().manual_seed(2)
            R = torch.randn(out.shape, generator=g).to(out.dtype)
            (out.float() * R.float()).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    s1, l1 = logits(model)
    r1, lr1 = logits(ref)
    res["after_step"] = {"max_logit_diff": (l1 - lr1).abs().max().item(), "tokens_equal": bool(torch.equal(s1, r1)),
                         "logits_changed_by": (lr1 - lr0).abs().max().item()}
    g = torch.Generator().manual_seed(3)
    sd = {k: (v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v
          for k, v in ref.state_dict().items()}
    model.load_state_dict(sd)
    ref.load_state_dict(sd)
    s2, l2 = logits(model)
    r2, lr2 = logits(ref)
    res["after_load"] = {"max_logit_diff": (l2 - lr2).abs().max().item(), "tokens_equal": bool(torch.equal(s2, r2)),
                         "logits_changed_by": (lr2 - lr1).abs().max().item()}
    return res


def train_steps(model, fwd, rows=(8, 64, 512)) -> dict:
    """One training step per row count (forward through ``fwd``,
    ``(h.float() * R).sum()`` backward, SGD step), each run twice, in the
    order given: the second row count makes Dynamo recompile with dynamic
    shapes, as a training loop with varying batches does."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    steps = {}
    for n in rows:
        x = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        R = torch.randn(1, n, model.config.hidden_size, generator=torch.Generator().manual_seed(7))

        def step(x=x, R=R):
            h = fwd(x).last_hidden_state
            (h.float() * R).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[n] = step
        step()
        step()
    return steps


def _train_worker(model, variant: str, out) -> None:
    import torch

    import wfpass
    from wfpass._torch.aot import stop_compile_workers

    model.train()
    if variant == "inductor":
        fwd = torch.compile(model.model.forward, backend="inductor")
    elif variant == "wformat":
        fwd = torch.compile(model.model.forward, backend="wformat")
    elif variant == "wformat-pack-training":
        fwd = torch.compile(model.model.forward, backend=wfpass.backend(prepack={"training": True, "mode": "always"}))
    else:
        fwd = model.model.forward
    steps = train_steps(model, fwd)
    stop_compile_workers()
    print(json.dumps({"ready": True, "first_s": 0.0}), file=out, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd.startswith("time"):
            # One round: the median of 5 steps (a single step swung 2x
            # between runs of this benchmark).
            rows = int(cmd.split()[1])
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                steps[rows]()
                ts.append((time.perf_counter() - t) * 1e3)
            print(json.dumps({"ms": statistics.median(ts)}), file=out, flush=True)
        elif cmd == "quit":
            break


# -- the coordinator ----------------------------------------------------------------


def Worker(config: str, variant: str, threads: int, train: bool) -> _worker.Worker:
    args = ["--worker", variant, "--config", config, "--threads", str(threads)] + (["--train"] if train else [])
    return _worker.Worker(__file__, args, variant, threads)


def run_generate(config: str, threads: int, rounds: int, variants=VARIANTS, stale: bool = True) -> dict:
    res = {"config": config, "threads": threads, "first_s": {}, "ms": {v: [] for v in variants}, "stale": {}}
    workers = []
    for v in variants:  # started one at a time: a compile would disturb another's timing
        w = Worker(config, v, threads, False)
        res["first_s"][v] = w.ask()["first_s"]
        workers.append(w)
    for _ in range(rounds):
        for w in workers:
            time.sleep(0.3)  # let the previous worker's threads go idle
            res["ms"][w.variant].append(w.ask("time")["ms_per_token"])
    if stale:
        for w in workers:
            res["stale"][w.variant] = w.ask("stale")
    for w in workers:
        w.close()
    return res


def run_train(config: str, threads: int, rounds: int) -> dict:
    variants = ("inductor", "wformat", "wformat-pack-training")
    res = {"config": config, "threads": threads, "ms": {v: {r: [] for r in (8, 64, 512)} for v in variants}}
    workers = []
    for v in variants:
        w = Worker(config, v, threads, True)
        w.ask()
        workers.append(w)
    for _ in range(rounds):
        for rows in (8, 64, 512):
            for w in workers:
                time.sleep(0.2)
                res["ms"][w.variant][rows].append(w.ask(f"time {rows}")["ms"])
    for w in workers:
        w.close()
    return res


def _md(results, train_results, command: str) -> str:
    from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor
    import torch

    lines = [f"<!-- made by: {command} -->", "", "# Packed weights: measured", "",
             f"`{command}`, on {cpu_words()} ({os.cpu_count()} cores), torch {torch.__version__}.", ""]
    if results:
        lines += _generate_md(results)
    if train_results:
        lines += _train_md(train_results)
    return "\n".join(lines) + "\n"


def _generate_md(results) -> list:
    from wfpass.tools.tables import markdown_table  # here, not at the top: the workers run this file too

    lines = ["Each variant ran in its own process; rounds interleave them. HF `LlamaForCausalLM` built from a config "
             f"(vocab 8000), `generate()` of {NEW} new tokens after {PROMPT}, greedy, batch 1, "
             "`model.forward = torch.compile(model.forward, backend=...)`.", "",
             "**x faster** = the baseline's time / wformat's time (above 1: wformat is faster).", ""]

    def ms(med, v):  # a variant left out with --variants: "-"
        return f"{med[v]:.2f}" if v in med else "-"

    def ratio(med, v):
        return f"{med[v] / med['wformat']:.2f}" if v in med and "wformat" in med else "-"

    body = []
    for r in results:
        med = {v: statistics.median(ts) for v, ts in r["ms"].items()}
        wf = r["ms"].get("wformat") or [float("nan")]
        body.append([r["config"], r["threads"], ms(med, "eager"), ms(med, "inductor"), ms(med, "freezing"),
                     ms(med, "wformat"), ratio(med, "freezing"), ratio(med, "inductor"), ratio(med, "eager"),
                     f"{min(wf):.2f}-{max(wf):.2f}"])
    lines.append(markdown_table(["model", "threads", "eager ms/token", "Inductor", "Inductor freezing", "wformat",
                                 "x faster than freezing", "x faster than Inductor", "x faster than eager",
                                 "spread of wformat (min-max)"], body))
    lines += ["", "First `generate()`, compile included (Inductor's caches off), seconds:", "",
              markdown_table(["model", "threads", "Inductor", "Inductor freezing", "wformat"],
                             [[r["config"], r["threads"],
                               *(f"{r['first_s'][v]:.1f}" if v in r["first_s"] else "-"
                                 for v in ("inductor", "freezing", "wformat"))] for r in results])]
    lines += ["", "Weights changed between `generate()` calls: largest difference of the logits (8 greedy steps) from "
              "eager's with the same new weights, and whether the tokens match. `changed by`: how far eager's own "
              "logits moved, for scale.", ""]
    body = []
    for r in results:
        for v, s in r["stale"].items():
            cells = []
            for key in ("before", "after_step", "after_load"):
                c = s[key]
                moved = f", changed by {c['logits_changed_by']:.3g}" if "logits_changed_by" in c else ""
                cells.append(f"{c['max_logit_diff']:.3g} (tokens {'equal' if c['tokens_equal'] else 'differ'}{moved})")
            body.append([r["config"], r["threads"], v, *cells])
    lines.append(markdown_table(["model", "threads", "variant", "before", "after an SGD step", "after `load_state_dict`"],
                                body))
    return lines


def _train_md(train_results) -> list:
    from wfpass.tools.tables import markdown_table

    lines = ["", "Training step (forward, backward of a fixed projection of the last hidden state, SGD step), "
             "bf16 decoder, ms, median over rounds of the median of 5 steps; x faster = Inductor's time / the variant's:", ""]
    body = []
    for r in train_results:
        for rows in (8, 64, 512):
            med = {v: statistics.median(r["ms"][v][rows]) for v in r["ms"]}
            body.append([r["config"], r["threads"], rows, f"{med['inductor']:.1f}", f"{med['wformat']:.1f}",
                         f"{med['inductor'] / med['wformat']:.2f}", f"{med['wformat-pack-training']:.1f}",
                         f"{med['inductor'] / med['wformat-pack-training']:.2f}"])
    lines.append(markdown_table(["model", "threads", "rows", "Inductor", "wformat (packing off in training)", "x faster",
                                 "wformat, prepack.training=True", "x faster"], body))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--config", nargs="*", default=["d512-bf16", "d1024-bf16", "d512-fp32"])
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--train", action="store_true", help="also the training steps (bf16 configs)")
    ap.add_argument("--train-only", action="store_true", help="only the training steps (bf16 configs)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--out")
    ap.add_argument("--json", help="also write the raw results here")
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.config[0], a.worker, a.threads[0], a.train)
        return
    a.train = a.train or a.train_only
    results, train_results = [], []
    for config in a.config:
        for threads in a.threads:
            if not a.train_only:
                r = run_generate(config, threads, a.rounds, tuple(a.variants))
                print(json.dumps(r), flush=True)
                results.append(r)
            if a.train and "bf16" in config:
                t = run_train(config, threads, a.rounds)
                print(json.dumps(t), flush=True)
                train_results.append(t)
    command = "python benchmarks/prepack/bench_pack.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = _md(results, train_results, command.strip())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"generate": results, "train": train_results}, f, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
