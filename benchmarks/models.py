"""Whole models: planning time against one block's, and generation against transformers.

Two parts, each printed as a table:

1. Planning (predicted times; wall time measured): ``programs/llama_block.edl`` alone, then
   ``programs/llama.edl`` with all its layers, both LLaMA-7B at S = 2048 in bf16 on ``a100x8``.
   The model's repeated layers are solved once; the table gives both plan calls' wall time,
   their ratio, and the model's predicted time beside one layer's times L.
2. Generation (measured, on --device: the CPU by default): greedy decoding of --new tokens
   after a 32-token prompt, a random LLaMA saved by transformers (--model: ``small``, 4 layers
   of D=256, or ``7b-width``, 4 layers of LLaMA-7B's widths, D=4096, F=11008, V=32000) in
   --dtype, an ``edatalog.Generator`` (torch runtime, one process, each --compile mode) against
   ``LlamaForCausalLM.generate`` on the same device, in one run, all warm: tokens per second of
   each and the ratio (prefill and every decode step counted), at each --threads count
   (torch's intra-op threads, the same for all), the median of --repeat rounds that take
   turns; the token ids must agree (in bf16, random weights make near ties, so the table also
   gives how many leading ids agree).  The generator's warm-up (two short generations, which
   compile its graphs) is timed apart.

    .venv/bin/python benchmarks/models.py                 # both parts
    .venv/bin/python benchmarks/models.py --part plan --time-limit 10
    .venv/bin/python benchmarks/models.py --part generate --new 32
    python benchmarks/models.py --part generate --device cuda --model 7b-width --dtype bf16 \
        --compile graph,cudagraph                          # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import edatalog

ROOT = Path(__file__).resolve().parent.parent
BLOCK, MODEL = ROOT / "programs" / "llama_block.edl", ROOT / "programs" / "llama.edl"
GPU_MEMORY = 80e9
LAYERS_7B = 32


def plan_part(time_limit: float, layers: int) -> list[list[str]]:
    dims = {"S": 2048}
    block = edatalog.compile(BLOCK, dims=dims, dtype="bf16")
    start = time.monotonic()
    b = edatalog.plan(block, topology="a100x8", memory=int(GPU_MEMORY * 0.9 / LAYERS_7B), time_limit=time_limit)
    block_s = time.monotonic() - start
    model = edatalog.compile(MODEL, dims={**dims, "L": layers}, dtype="bf16")
    start = time.monotonic()
    m = edatalog.plan(model, topology="a100x8", memory=int(GPU_MEMORY * 0.9), time_limit=time_limit)
    planned = time.monotonic() - start
    m_ms = m.report.seconds * 1e3  # the whole model's timeline (its programs synthesized)
    checked = time.monotonic() - start
    lay = m.layered
    assert lay is not None
    return [
        [
            "llama_block.edl (7B, S=2048)",
            str(len(block.graph.nodes)),
            f"{block_s:.1f}",
            "",
            f"{b.report.seconds * 1e3:.3f}",
            "",
            "",
        ],
        [
            f"llama.edl (7B, S=2048, L={layers})",
            str(len(model.graph.nodes)),
            f"{planned:.1f}",
            f"{planned / block_s:.2f}",
            f"{m_ms:.3f}",
            f"{lay.layer_ms:.3f} x {layers} = {lay.layer_ms * layers:.3f}",
            f"{lay.stages} (report {checked - planned:.1f}s)",
        ],
    ]


MODELS: dict[str, dict[str, Any]] = {
    "small": {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
    },
    "7b-width": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 256,
    },
}


def generate_part(
    new: int,
    modes: list[str],
    threads: list[int],
    repeat: int,
    model_name: str = "small",
    device: str = "cpu",
    dtype: str = "f32",
) -> list[list[str]]:
    """transformers and a generator per compile mode in ``modes``, at each torch thread count in
    ``threads`` (the same for all, set before they run); ratios against transformers at the
    same count, in the same run: the median of ``repeat`` rounds each."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    with torch.device(device):
        model: Any = cast(Any, LlamaForCausalLM)(LlamaConfig(**MODELS[model_name])).to(tdtype).eval()
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    prompt = list(range(1, 33))
    rows: list[list[str]] = []
    default_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as where:
        model.save_pretrained(where)
        gens, warm_s = {}, {}
        for mode in modes:
            gens[mode] = edatalog.Generator(MODEL, where, compile=mode, device=device, dtype=dtype)
            # Warm, as transformers is after its first call: a generator's first call interprets
            # its prefill and compiles its decode step, its second compiles the prefill (each
            # graph is compiled once per prompt and cache bucket: 32 + 3 and 32 + 32 positions
            # share them).
            start = time.perf_counter()
            for _ in range(2):
                gens[mode](prompt, 3)
            warm_s[mode] = time.perf_counter() - start
        for count in threads:
            torch.set_num_threads(count)
            with torch.no_grad():
                model.generate(
                    torch.tensor([prompt], device=device), max_new_tokens=2, min_new_tokens=2, do_sample=False
                )
            # Rounds interleave the contenders, so that a slow spell of the machine hits them alike.
            rates: dict[str, list[float]] = {name: [] for name in ["transformers", *gens]}
            ids: dict[str, list[int]] = {}
            for _ in range(repeat):
                with torch.no_grad():
                    sync()
                    start = time.perf_counter()
                    out = model.generate(
                        torch.tensor([prompt], device=device), max_new_tokens=new, min_new_tokens=new, do_sample=False
                    )
                    sync()
                    rates["transformers"].append(new / (time.perf_counter() - start))
                ids["transformers"] = out[0, len(prompt) :].tolist()
                for mode, gen in gens.items():
                    run = gen(prompt, new)
                    rates[mode].append(run.tokens_per_second)
                    ids[mode] = run.ids
            hf_tps = statistics.median(rates["transformers"])
            rows.append([f"transformers generate, {count} thread(s)", f"{hf_tps:.1f}", "1.00", "", ""])
            for mode in gens:
                tps = statistics.median(rates[mode])
                agree = next(
                    (k for k, (a, b) in enumerate(zip(ids[mode], ids["transformers"], strict=False)) if a != b), new
                )
                rows.append(
                    [
                        f"edatalog Generator (torch, {mode}), {count} thread(s)",
                        f"{tps:.1f}",
                        f"{tps / hf_tps:.2f}",
                        "yes" if ids[mode] == ids["transformers"] else f"NO (first {agree} agree)",
                        f"{warm_s[mode]:.1f}" if count == threads[0] else "",
                    ]
                )
    torch.set_num_threads(default_threads)
    return rows


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--part", choices=("all", "plan", "generate"), default="all")
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds per plan call (default 10)")
    p.add_argument("--layers", type=int, default=LAYERS_7B, help="layers of the planned model (default 32)")
    p.add_argument("--new", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument(
        "--compile",
        default="graph,inductor",
        help="edatalog's compile modes for generation, comma-separated, of graph, inductor, cudagraph (GPU only) "
        "and none (default graph,inductor; inductor's first compile takes tens of seconds, then it is cached)",
    )
    p.add_argument("--model", choices=tuple(MODELS), default="small", help="the generating model (default small)")
    p.add_argument("--device", default="cpu", help="torch device of both contenders (default cpu; e.g. cuda)")
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32", help="both contenders' dtype (default f32)")
    p.add_argument("--repeat", type=int, default=7, help="generation rounds per contender, the median kept (default 7)")
    p.add_argument(
        "--threads",
        default=None,
        help="torch thread counts, comma-separated: each contender runs at each, the same for both "
        "(default 1,2 on the CPU; torch's own count on a GPU)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part in ("all", "plan"):
        rows = plan_part(args.time_limit, args.layers)
        print("planning: wall time measured, milliseconds predicted (a100x8, bf16)")
        print(_table(["program", "rules", "plan s", "/block", "pred ms", "one layer x L (pred ms)", "stages"], rows))
        print()
    if args.part in ("all", "generate"):
        modes = args.compile.split(",")
        unknown = sorted(set(modes) - {"graph", "inductor", "none", "cudagraph"})
        if unknown:
            raise SystemExit(f"unknown compile mode {unknown[0]!r}: choose among graph, inductor, cudagraph, none")
        threads = args.threads or ("1,2" if args.device == "cpu" else "")
        counts = [int(t) for t in threads.split(",") if t] or [torch_threads()]
        rows = generate_part(args.new, modes, counts, args.repeat, args.model, args.device, args.dtype)
        print(
            f"generation: {args.new} new tokens after 32, measured on this machine "
            f"({args.device}, {args.model}, {args.dtype})"
        )
        print(_table(["", "tokens/s", "/transformers", "same ids", "warm-up s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
