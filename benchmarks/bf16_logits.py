"""How far bf16 logits are from f32's, for edatalog and for transformers, on the same weights.

Greedy ids in bf16 can part from transformers' wherever the top two logits are closer than the
rounding either side makes.  This script measures that instead of guessing: a random
``LlamaForCausalLM`` (``benchmarks/models.py``'s --model shapes), its weights rounded to bf16
once and saved; the f32 model on those weights is the reference.  For transformers in bf16 and
for ``programs/llama.edl`` in bf16 (torch runtime, one device) it prints the largest logit
error against the reference and at how many of the prompt's positions the argmax agrees with
it, then the reference's smallest and median top-two margins.

    .venv/bin/python benchmarks/bf16_logits.py                         # small model, CPU
    python benchmarks/bf16_logits.py --model 7b-width --device cuda
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from models import MODEL, MODELS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", choices=tuple(MODELS), default="small")
    p.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    p.add_argument("--prompt", type=int, default=32, help="prompt length: ids 1..N (default 32)")
    args = p.parse_args(argv)

    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as where:
        return _compare(args, where)


def _compare(args: argparse.Namespace, where: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import edatalog
    from edatalog.checkpoint import configured

    model = LlamaForCausalLM(LlamaConfig(**MODELS[args.model])).to(torch.bfloat16)
    model.save_pretrained(where)
    ref = LlamaForCausalLM.from_pretrained(where, torch_dtype=torch.float32).to(args.device).eval()
    hf = LlamaForCausalLM.from_pretrained(where, torch_dtype=torch.bfloat16).to(args.device).eval()
    ids = torch.tensor([list(range(1, args.prompt + 1))], device=args.device)
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits[0].float()
        got_hf = hf(ids, use_cache=False).logits[0].float()
    dims, consts = configured(MODEL, where)
    prog = edatalog.compile(MODEL, dims={**dims, "S": args.prompt}, consts=consts, dtype="bf16")
    exe = prog.executable(backend="torch", device=args.device)
    exe.load(prog.load_checkpoint(where))
    got_ed = exe({"ids": ids.cpu()})["logits"][0].float()
    top = want.topk(2, dim=-1).values
    margin = top[:, 0] - top[:, 1]
    print(f"{args.model} on {args.device}: f32 logits up to {float(want.abs().max()):.3f} in magnitude")
    for who, got in (("transformers bf16", got_hf), ("edatalog bf16", got_ed)):
        err = float((got - want).abs().max())
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        print(f"  {who:<18} max |logit - f32| {err:.4f}; argmax as f32's at {agree:.0%} of positions")
    print(f"  f32 top-two margin: median {float(margin.median()):.4f}, smallest {float(margin.min()):.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
