"""Train a small LLaMA on text, bytes as tokens, with ``edl train``; then let it continue a prompt.

    .venv/bin/python examples/train_bytes.py                   # 60 steps, about a minute on 2 cores
    .venv/bin/python examples/train_bytes.py --steps 5 --out /tmp/bytes

Everything is made here, nothing is downloaded: the text is this repository's README, each byte a
token (a vocabulary of 256); the model is a fresh 2-layer LLaMA that transformers initializes and
saves; ``programs/llama.edl`` is the model, ``edl train`` trains it (AdamW, clipping) and saves a
checkpoint that transformers' ``from_pretrained`` loads, and greedy generation from it continues
a prompt.  The loss falls from about ln 256 = 5.5 as the model learns the text's bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument("--out", help="where to keep the data and checkpoints (default: a temporary directory)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(args.out or tmp), args.steps)


def run(out: Path, steps: int) -> list[float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edatalog.cli import main as edl
    from edatalog.generation import generate

    out.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "README.md").read_bytes()
    np.save(out / "tokens.npy", np.frombuffer(text, dtype=np.uint8).astype(np.int64))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(out / "init")

    argv = ["train", str(ROOT / "programs" / "llama.edl"), "--weights", str(out / "init"), "--data"]
    argv += [str(out / "tokens.npy"), "--steps", str(steps), "--batch", "4", "--seq", "32", "--lr", "3e-3"]
    argv += ["--betas", "0.9,0.95", "--weight-decay", "0.1", "--clip", "1.0", "--save", str(out / "trained"), "--json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = edl(argv)
    if code != 0:
        raise SystemExit(code)
    losses = [json.loads(line)["loss"] for line in buf.getvalue().splitlines()]
    shown = sorted({*range(0, len(losses), max(1, len(losses) // 6)), len(losses) - 1})
    for k in shown:
        print(f"step {k + 1:3d}  loss {losses[k]:.3f}")

    prompt = list(b"edatalog ")
    gen = generate(ROOT / "programs" / "llama.edl", out / "trained", prompt, 24, backend="torch")
    print("continues 'edatalog ' as:", repr(bytes(gen.ids)))
    return losses


if __name__ == "__main__":
    main()
