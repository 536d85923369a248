"""The imported LLaMA against the hand-written one: transformers' ``LlamaForCausalLM`` at LLaMA-7B's
widths imported by ``edatalog.from_torch`` (weights on the meta device: only shapes are read),
then both programs planned by ``edl plan`` on the same machine, each in its own process.

Prints, for each program: its rule count (``edl check``), the wall time of ``edl plan``
(**measured**, the command's whole run), and the plan's time (**predicted** by the cost model,
composed per layer as ``edl plan`` reports a model with repeated layers).

  .venv/bin/python benchmarks/importer.py                      # 7B widths, 32 layers, S=2048, bf16, a100x8
  .venv/bin/python benchmarks/importer.py --layers 2 --seq 128 --time-limit 10
  .venv/bin/python benchmarks/importer.py --small              # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EDL = [sys.executable, "-m", "edatalog.cli"]
# LLaMA-7B (Meta's config.json): hidden 4096, 32 heads, FFN 11008, 32 layers, vocabulary 32000.
WIDTHS = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128}


def imported_text(layers: int, seq: int, vocab: int, widths: dict[str, int]) -> tuple[str, float]:
    """The .edl text of the transformers model, and the import's wall seconds (measured)."""
    import torch
    import transformers

    import edatalog

    config = transformers.LlamaConfig(
        **widths, num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=max(seq, 64)
    )
    with torch.device("meta"):
        model: Any = transformers.LlamaForCausalLM(config)
    # The rotary frequencies are a buffer computed from the config: the importer folds their
    # values, so they must be real.
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    model.model.rotary_emb = rotary
    ids = torch.zeros((1, seq), dtype=torch.int64)
    began = time.monotonic()
    text = edatalog.to_edl(model.eval(), (), {"input_ids": ids})
    return text, time.monotonic() - began


def plan(program: Path, dims: list[str], topology: str, time_limit: float, dtype: str) -> dict[str, Any]:
    cmd = [*EDL, "plan", str(program), *dims, "--dtype", dtype, "-t", topology, "--time-limit", str(time_limit)]
    began = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"edl plan failed: {done.stderr[-2000:]}")
    ms = re.search(r"predicted ([0-9.]+) ms on \S+: a layer", done.stdout)
    if ms is None:
        ms = re.search(r"^auto\s+([0-9.]+)", done.stdout, re.M)
    check = subprocess.run([*EDL, "check", str(program), *dims], cwd=ROOT, capture_output=True, text=True, check=False)
    rules = re.search(r"ok, (\d+) rules", check.stdout)
    return {
        "wall_s": round(wall, 1),
        "predicted_ms": float(ms.group(1)) if ms else None,
        "rules": int(rules.group(1)) if rules else None,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("-t", "--topology", default="a100x8")
    parser.add_argument("--time-limit", type=float, default=60.0, help="edl plan's --time-limit for each program")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--small", action="store_true", help="tiny widths (a check of the script)")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    widths = SMALL if args.small else WIDTHS
    vocab = 64 if args.small else 32000
    text, import_s = imported_text(args.layers, args.seq, vocab, widths)
    with tempfile.TemporaryDirectory() as tmp:
        imported = Path(tmp) / "imported.edl"
        imported.write_text(text)
        hand_dims = {
            "B": 1,
            "S": args.seq,
            "D": widths["hidden_size"],
            "H": widths["num_attention_heads"],
            "KVH": widths["num_key_value_heads"],
            "F": widths["intermediate_size"],
            "L": args.layers,
            "V": vocab,
        }
        dims = [f"--dim={k}={v}" for k, v in hand_dims.items()]
        rows = {
            "imported": plan(imported, [], args.topology, args.time_limit, args.dtype),
            "programs/llama.edl": plan(
                ROOT / "programs" / "llama.edl", dims, args.topology, args.time_limit, args.dtype
            ),
        }
    rows["imported"]["import_s"] = round(import_s, 1)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'program':<20} {'rules':>5} {'plan wall s':>11} {'predicted ms':>12}")
    for name, row in rows.items():
        print(f"{name:<20} {row['rules']!s:>5} {row['wall_s']:>11} {row['predicted_ms']!s:>12}")
    a, b = rows["imported"], rows["programs/llama.edl"]
    if a["predicted_ms"] and b["predicted_ms"]:
        print(
            f"imported / hand-written: predicted {a['predicted_ms'] / b['predicted_ms']:.3f}, "
            f"plan wall {a['wall_s'] / b['wall_s']:.2f}, rules {a['rules'] / b['rules']:.2f}; "
            f"import took {import_s:.1f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
