"""``edatalog.checkpoint``: params stacked from one tensor per index (mixture-of-experts
checkpoints).

transformers' Mixtral saves each expert as a tensor of its own
(``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight``, ``[F, D]``); a program declares
one param ``w1[E, F, D]`` with the placeholder ``{e}``.  Here a tiny Mixtral saved by
transformers loads into such a program exactly stacked, slices read only their tensors, every
mistake is an error that says what differs, ``configured`` reads the expert counts, and
``edl train`` saves the experts back as transformers reads them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM

import edatalog
from edatalog.checkpoint import Checkpoint, configured, unstacked
from edatalog.cli import main
from edatalog.lang.parser import parse

ROOT = Path(__file__).resolve().parents[2]
V, D, F, E, K, L = 20, 8, 12, 3, 2, 2
IDS = {"ids": np.array([[1, 2, 3, 4], [5, 6, 7, 8]])}
EXPERT = "model.layers.{k}.block_sparse_moe.experts.{e}.{w}.weight"

# A dense mixture (every expert, weighed by its softmaxed gate), enough to use every stacked param.
MOE = """
dim B = 2, S = 4, V = 16 from "vocab_size", D = 4 from "hidden_size", F = 4 from "intermediate_size".
dim E = 2 from "num_local_experts", K = 1 from "num_experts_per_tok", L = 1 from "num_hidden_layers".
input ids[B, S] : i64.
param emb[V, D] : f32 from "model.embed_tokens.weight".
param head[V, D] : f32 from "lm_head.weight".

module moe.
  input x[B, S, D] : f32.
  param gate[E, D] : f32 from "model.layers.{i}.block_sparse_moe.gate.weight".
  param w1[E, F, D] : f32 from "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight".
  param w2[E, D, F] : f32 from "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight".
  param w3[E, F, D] : f32 from "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight".
  g[b, s, e] += x[b, s, d] * gate[e, d].
  gm[b, s] max= g[b, s, e].
  gz[b, s] += exp(g[b, s, e] - gm[b, s]).
  p[b, s, e] = exp(g[b, s, e] - gm[b, s]) / gz[b, s].
  h[b, s, e, f] += x[b, s, d] * w1[e, f, d].
  u[b, s, e, f] += x[b, s, d] * w3[e, f, d].
  o[b, s, d] += p[b, s, e] * h[b, s, e, f] * u[b, s, e, f] * w2[e, d, f].
  y[b, s, d] = x[b, s, d] + o[b, s, d].
  output y.
end.

x0[b, s, d] = emb[v, d] where ids[b, s] = v.
h = moe(x0) repeat L as layers.
logits[b, s, w] += h[b, s, d] * head[w, d].
"""


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral, saved by transformers (one tensor per expert)."""
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=E,
        num_experts_per_tok=K,
    )
    where = tmp_path_factory.mktemp("mixtral") / "model"
    model: Any = MixtralForCausalLM(config)
    model.save_pretrained(where)
    return where


def _compile(text: str, path: Path | None = None, **dims: int) -> edatalog.Program:
    found = configured(parse(text, "moe.edl"), path)[0] if path is not None else {}
    return edatalog.compile_string(text, name="moe.edl", dims={**found, **dims})


def _stacked(tensors: dict[str, torch.Tensor], k: int, w: str, count: int = E) -> torch.Tensor:
    return torch.stack([tensors[EXPERT.format(k=k, e=e, w=w)] for e in range(count)])


def test_configured_reads_the_expert_counts(mixtral: Path) -> None:
    dims, _ = configured(parse(MOE, "moe.edl"), mixtral)
    assert (dims["E"], dims["K"], dims["D"], dims["F"], dims["L"]) == (E, K, D, F, L)


def test_experts_in_a_repeated_module_load_stacked(mixtral: Path) -> None:
    prog = _compile(MOE, mixtral)
    originals = load_file(str(mixtral / "model.safetensors"))
    params = prog.load_checkpoint(mixtral)
    for k in range(L):
        for w in ("w1", "w2", "w3"):
            rel = f"layers.{k}.{w}"
            assert params[rel].shape == prog.graph.relation(rel).shape
            assert torch.equal(torch.from_numpy(params[rel]), _stacked(originals, k, w)), rel
        assert torch.equal(
            torch.from_numpy(params[f"layers.{k}.gate"]), originals[f"model.layers.{k}.block_sparse_moe.gate.weight"]
        )
    names = Checkpoint(mixtral).names_for(prog.graph)
    assert names["layers.1.w1"] == "model.layers.1.block_sparse_moe.experts.{e}.w1.weight"
    assert names["emb"] == "model.embed_tokens.weight"


def test_a_slice_reads_its_part_and_only_its_tensors(mixtral: Path, tmp_path: Path) -> None:
    """Experts 1 and 2 in one shard, expert 0 in another that is gone once the headers are read:
    a slice of experts 1 .. 2 still reads; one that takes expert 0 does not."""
    originals = load_file(str(mixtral / "model.safetensors"))
    name = "model.layers.0.block_sparse_moe.experts.{e}.w1.weight"
    first = {k: v for k, v in originals.items() if ".experts.0." in k}
    rest = {k: v for k, v in originals.items() if k not in first}
    save_file(first, str(tmp_path / "a.safetensors"))
    save_file(rest, str(tmp_path / "b.safetensors"))
    weight_map = {**dict.fromkeys(first, "a.safetensors"), **dict.fromkeys(rest, "b.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = Checkpoint(tmp_path)
    whole = _stacked(originals, 0, "w1")
    assert torch.equal(ckpt.read(name), whole)
    assert torch.equal(ckpt.read(name, (slice(0, 3), slice(2, 7), slice(1, 5))), whole[:, 2:7, 1:5])
    assert ckpt.read(name, (slice(1, 1), slice(0, F), slice(0, D))).shape == (0, F, D)
    (tmp_path / "a.safetensors").unlink()
    assert torch.equal(ckpt.read(name, (slice(1, 3), slice(0, 4), slice(0, D))), whole[1:3, :4])
    with pytest.raises(FileNotFoundError, match=r"a\.safetensors"):
        ckpt.read(name, (slice(0, 2), slice(0, F), slice(0, D)))


def test_two_placeholders_stack_two_axes(tmp_path: Path) -> None:
    text = """
    dim A = 2, C = 3, N = 4.
    input x[N] : f32.
    param w[A, C, N] : f32 from "blocks.{a}.parts.{c}.w".
    y[a, c] += w[a, c, n] * x[n].
    """
    parts = {f"blocks.{a}.parts.{c}.w": torch.randn(4) for a in range(2) for c in range(3)}
    save_file(parts, str(tmp_path / "model.safetensors"))
    prog = edatalog.compile_string(text, name="two.edl")
    got = prog.load_checkpoint(tmp_path)["w"]
    want = torch.stack([torch.stack([parts[f"blocks.{a}.parts.{c}.w"] for c in range(3)]) for a in range(2)])
    assert torch.equal(torch.from_numpy(got), want)
    part = Checkpoint(tmp_path).read("blocks.{a}.parts.{c}.w", (slice(1, 2), slice(1, 3), slice(0, 2)))
    assert torch.equal(part, want[1:2, 1:3, :2])
    assert set(unstacked("blocks.{a}.parts.{c}.w", want)) == set(parts)
    assert all(torch.equal(v, parts[k]) for k, v in unstacked("blocks.{a}.parts.{c}.w", want).items())


def test_a_planned_executable_loads_the_experts(mixtral: Path) -> None:
    """``exe.load(path)`` with a plan: the outputs the params given whole give."""
    prog = _compile(MOE, mixtral)
    params = prog.load_checkpoint(mixtral)
    plan = edatalog.plan(prog, topology="cpux2", strategy="random", seed=1)
    by_dict = edatalog.executable(prog, plan, device="cpu")
    by_dict.load(params)
    by_file = edatalog.executable(prog, plan, device="cpu")
    by_file.load(mixtral)
    assert torch.equal(by_file(IDS)["logits"], by_dict(IDS)["logits"])


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_read_their_slices_of_the_experts(mixtral: Path, tmp_path: Path) -> None:
    """``edl run --nproc 2`` of a plan that splits the experts unevenly (random, seed 1: the
    rules over ``w1`` and ``w2`` cut ``e`` at 1 and 2): each rank reads only its slices of the
    stacked params, and the logits are the reference's."""
    program = tmp_path / "moe.edl"
    program.write_text(MOE, encoding="utf-8")
    np.savez(tmp_path / "ids.npz", ids=IDS["ids"])
    prog = _compile(MOE, mixtral)
    plan = edatalog.plan(prog, topology="cpux2", strategy="random", seed=1)
    assert plan.ir.node("layers.0.h").tile.splits[2].cuts == (0, 1, 2, 3)
    plan.save(tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "edatalog.cli", "run", str(program), "--weights", str(mixtral)]
    cmd += ["--plan", str(tmp_path / "plan.json"), "--backend", "torch", "--device", "cpu", "--nproc", "2"]
    cmd += ["--inputs", str(tmp_path / "ids.npz"), "-o", str(tmp_path / "out.npz")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    want = prog.run({**prog.load_checkpoint(mixtral), **IDS})["logits"]
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_allclose(out["logits"], want, rtol=1e-5, atol=1e-6)


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("decl", "message", "help_text"),
    [
        (
            'param w[E, D] : f32 from "experts.{e}.w.{e}".',
            "'{e}' twice in the checkpoint name of 'w'",
            "write it once",
        ),
        (
            'param w[E, D] : f32 from "experts.{e}.parts.{p}.rows.{r}.w".',
            "the checkpoint name of 'w' stacks 3 axes ('{e}', '{p}', '{r}'), but 'w' has 2",
            "declare those axes, or drop a placeholder",
        ),
        (
            'param w[E, D] : f32 from "experts.{e}.w", "moe.{x}.w".',
            "the checkpoint names of 'w' stack different axes: '{x}' here, '{e}' in \"experts.{e}.w\"",
            "use the same placeholders, in the same order, in each",
        ),
        (
            'param w[E, D] : f32 from "layers.{i}.experts.{e}.w".',
            "'{i}' in the checkpoint name of 'w'",
            "in a module's params only",
        ),
        (
            'param w[E, D] : f32 from "experts.{1}.w".',
            "'{1}' in the checkpoint name of 'w'",
            "a placeholder is a name in braces",
        ),
    ],
)
def test_a_wrong_placeholder_is_an_error_at_its_name(decl: str, message: str, help_text: str) -> None:
    text = f"dim E = 2, D = 3.\ninput x[D] : f32.\n{decl}\ny[e] += x[d] * w[e, d].\n"
    with pytest.raises(edatalog.EdlError) as caught:
        edatalog.compile_string(text, name="bad.edl")
    d = caught.value.diagnostic
    assert d.message == message
    assert d.help is not None and help_text in d.help
    assert d.span is not None and text[d.span.start : d.span.end].startswith('"')  # the string's span


def test_a_wrong_placeholder_in_a_module_is_an_error() -> None:
    text = MOE.replace("experts.{e}.w2.weight", "experts.{e}.w2.{e}")
    with pytest.raises(edatalog.EdlError, match=r"'\{e\}' twice in the checkpoint name of 'w2'"):
        edatalog.compile_string(text, name="moe.edl")


def test_fewer_experts_than_the_program_has_is_one_error(mixtral: Path) -> None:
    prog = _compile(MOE, mixtral, E=8)
    with pytest.raises(edatalog.EdlError) as caught:
        prog.load_checkpoint(mixtral)
    text = str(caught.value)
    assert f"{4 * L} params of the checkpoint {mixtral} do not match the program" in text
    for k in range(L):
        for w in ("w1", "w2", "w3"):
            line = (
                f"layers.{k}.{w} (model.layers.{k}.block_sparse_moe.experts.{{e}}.{w}.weight): "
                f"3 tensors in the checkpoint ({{e}} = 0 .. 2), 8 here (E = 8)"
            )
            assert line in text
    assert (
        "layers.0.gate (model.layers.0.block_sparse_moe.gate.weight): shape [3, 8] in the checkpoint, [8, 8] here"
        in text
    )


def test_a_gap_wrong_shapes_and_dtypes_of_experts_are_errors(tmp_path: Path) -> None:
    text = """
    dim E = 3, N = 4.
    input x[N] : f32.
    param w[E, N] : f32 from "experts.{e}.w".
    y[e] += w[e, n] * x[n].
    """
    prog = edatalog.compile_string(text, name="gap.edl")

    def fails(tensors: dict[str, torch.Tensor]) -> str:
        save_file(tensors, str(tmp_path / "model.safetensors"))
        with pytest.raises(edatalog.EdlError) as caught:
            prog.load_checkpoint(tmp_path)
        return str(caught.value)

    gap = fails({f"experts.{e}.w": torch.zeros(4) for e in (0, 1, 3)})
    assert "w (experts.{e}.w): 3 tensors in the checkpoint ({e} = 0, 1, 3), 3 here (E = 3)" in gap
    shape = fails({f"experts.{e}.w": torch.zeros(4 if e != 1 else 5) for e in range(3)})
    assert "w (experts.1.w): shape [5] in the checkpoint, [4] here (one of 3 stacked as [3, 4])" in shape
    dtype = fails({f"experts.{e}.w": torch.zeros(4, dtype=torch.float64) for e in range(3)})
    assert "holds f64 params, but the program's are f32" in dtype and "w (experts.{e}.w): f64" in dtype
    missing = fails({"other.w": torch.zeros(4)})
    assert "w: none of experts.{e}.w, w" in missing


# -- saving ------------------------------------------------------------------------------------


def test_training_saves_the_experts_as_transformers_reads_them(
    capsys: pytest.CaptureFixture[str], mixtral: Path, tmp_path: Path
) -> None:
    """``edl train --save`` writes each stacked param back as its experts' tensors: transformers
    loads them (its own save writes the same values back), and they load stacked again."""
    program = tmp_path / "moe.edl"
    program.write_text(MOE, encoding="utf-8")
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, V, size=200))
    argv = ["train", str(program), "--weights", str(mixtral), "--data", str(tmp_path / "tokens.npy")]
    argv += ["--steps", "1", "--batch", "2", "--seq", "4", "--lr", "1e-2", "--save", str(tmp_path / "out")]
    assert main([*argv, "--backend", "reference", "--json"]) == 0, capsys.readouterr().err
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not [k for k in saved if "{" in k]
    originals = load_file(str(mixtral / "model.safetensors"))
    for k in range(L):
        for w in ("w1", "w2", "w3"):
            for e in range(E):
                name = EXPERT.format(k=k, e=e, w=w)
                assert saved[name].shape == originals[name].shape
            assert not torch.equal(_stacked(saved, k, w), _stacked(originals, k, w))  # trained
    again = edatalog.compile_string(MOE, name="moe.edl", dims=configured(program, tmp_path / "out")[0])
    params = again.load_checkpoint(tmp_path / "out")
    assert torch.equal(torch.from_numpy(params["layers.1.w2"]), _stacked(saved, 1, "w2"))

    model: Any = MixtralForCausalLM.from_pretrained(tmp_path / "out")
    model.save_pretrained(tmp_path / "resaved")
    with safe_open(str(tmp_path / "resaved" / "model.safetensors"), framework="pt") as fh:
        for k in range(L):
            for w in ("w1", "w2", "w3"):
                for e in range(E):
                    name = EXPERT.format(k=k, e=e, w=w)
                    assert torch.equal(fh.get_tensor(name), saved[name]), name
