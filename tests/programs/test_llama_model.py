"""``programs/llama.edl`` and ``programs/llama_decode.edl`` against transformers'
``LlamaForCausalLM``, with random weights that transformers itself saves (``save_pretrained``,
safetensors) and edatalog loads from that directory by the names the programs declare.

The configuration is small and odd where the model allows: 3 layers, 6 query heads sharing 2
key/value heads (GQA), rope theta 5000, eps 1e-6, a vocabulary of 37; float64 throughout
(transformers computes RoPE's angles and RMSNorm's variance in float32 even then, which bounds
the agreement near 1e-7).  Weights are large enough that every part matters (matrices ~
N(0, 1.5^2 / fan_in), norm weights ~ N(1, 0.5^2)).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import edatalog
from edatalog import generation
from edatalog.checkpoint import configured
from edatalog.lang.parser import parse_file
from tests.programs.checkpoints import compile_configured, randomized, reference_logits, save

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "programs" / "llama.edl"
PROMPT = [1, 5, 9, 2, 30]
NEW = 16
TOL = 1e-6


def _model(layers: int = 3, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings: dict[str, Any] = {  # rope_theta: transformers 4 and 5 both take it
        "vocab_size": 37,
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_hidden_layers": layers,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "rope_theta": 5000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
    }
    model: Any = cast(Any, LlamaForCausalLM)(LlamaConfig(**settings)).double().eval()
    return randomized(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    model = _model()
    return save(tmp_path_factory, model, "llama"), model


def _compile(weights: Path, seq: int, **kw: Any) -> edatalog.Program:
    return compile_configured(LLAMA, weights, seq, **kw)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_config_sets_the_dims(saved: tuple[Path, LlamaForCausalLM]) -> None:
    where, _ = saved
    dims, consts = configured(parse_file(str(LLAMA)), where)
    assert dims == {"D": 24, "H": 6, "KVH": 2, "F": 40, "L": 3, "V": 37}
    assert consts == {"eps": 1e-6, "theta": 5000.0}


def test_logits_equal_transformers_from_its_own_checkpoint(saved: tuple[Path, LlamaForCausalLM]) -> None:
    where, model = saved
    prog = _compile(where, len(PROMPT))
    assert [r.name for r in prog.graph.relations if r.kind == "input"] == ["ids"]
    assert prog.outputs == ("logits",) and prog.graph.relation("logits").shape == (1, len(PROMPT), 37)
    params = prog.load_checkpoint(where)
    out = prog.run({**params, "ids": np.array([PROMPT])})["logits"]
    ref = reference_logits(model, PROMPT)
    assert _rel(out, ref) <= TOL
    # The comparison means something: another layer's weights change the logits.
    other = dict(params)
    other["layers.1.wq"] = other["layers.2.wq"]
    assert _rel(prog.run({**other, "ids": np.array([PROMPT])})["logits"], ref) > 1e-3


def test_a_sharded_checkpoint_loads_as_one(saved: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    where, model = saved
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    prog = _compile(where, len(PROMPT))
    one, many = prog.load_checkpoint(where), prog.load_checkpoint(tmp_path)
    assert one.keys() == many.keys()
    assert all(np.array_equal(one[k], many[k]) for k in one)


def test_tied_embeddings_give_the_head_the_embedding(tmp_path: Path) -> None:
    model = _model(layers=2, tied=True, seed=1)
    model.save_pretrained(tmp_path)
    prog = _compile(tmp_path, len(PROMPT))
    params = prog.load_checkpoint(tmp_path)
    assert np.array_equal(params["lm_head"], params["tok_emb"])
    out = prog.run({**params, "ids": np.array([PROMPT])})["logits"]
    assert _rel(out, reference_logits(model, PROMPT)) <= TOL


def _hf_generate(model: LlamaForCausalLM) -> list[int]:
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    out: list[int] = ids[0, len(PROMPT) :].tolist()
    return out


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_greedy_generation_equals_transformers(saved: tuple[Path, LlamaForCausalLM], backend: str) -> None:
    where, model = saved
    want = _hf_generate(model)
    gen = edatalog.generate(LLAMA, where, PROMPT, NEW, dtype="f64", backend=backend)
    assert gen.ids == want
    assert len(set(want)) > 3  # not one token over and over: the comparison means something
    assert gen.tokens_per_second > 0 and gen.prefill_seconds > 0


@pytest.mark.gpu
def test_greedy_generation_on_a_gpu_replays_cuda_graphs(saved: tuple[Path, LlamaForCausalLM]) -> None:
    """On one GPU the generator's steps replay as CUDA graphs (compile auto) and give
    transformers' tokens, call after call (each call's prefill and steps replay the captures)."""
    where, model = saved
    want = _hf_generate(model)
    gen = edatalog.Generator(LLAMA, where, dtype="f64", device="cuda")
    for _ in range(3):  # interpreted, compiled and captured, replayed
        assert gen(PROMPT, NEW).ids == want
    _, prefill, step = next(iter(gen._runs.values()))
    assert all(e._impl.mode.value == "cudagraph" for e in (prefill, step))


@pytest.mark.distributed
@pytest.mark.slow
def test_greedy_generation_on_two_processes_with_solved_plans(saved: tuple[Path, LlamaForCausalLM]) -> None:
    """``edl generate --nproc 2``: both programs solved for 2 CPU devices, each rank running its
    device's programs over gloo and reading only its slices of the checkpoint."""
    where, model = saved
    cmd = [sys.executable, "-m", "edatalog.cli", "generate", str(LLAMA), "--weights", str(where)]
    cmd += ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new", str(NEW), "--dtype", "f64"]
    cmd += ["--nproc", "2", "--time-limit", "3", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["ids"] == _hf_generate(model)


def test_a_decode_step_equals_the_model_at_the_next_position(saved: tuple[Path, LlamaForCausalLM]) -> None:
    """One step of llama_decode.edl over the cache of a prefix gives the logits the whole model
    gives at that position."""
    where, model = saved
    req = generation.request(LLAMA, where, PROMPT[:-1], 2, dtype="f64", backend="reference")
    progs = generation.programs(dataclasses.replace(req, buckets=False))  # the prompt's and cache's own lengths
    params = progs.prefill.load_checkpoint(where)
    pre = progs.prefill.run({**params, "ids": np.array([PROMPT[:-1]])})
    t = len(PROMPT) + 1
    inputs: dict[str, Any] = {"ids": np.array([PROMPT[-1]]), "pos": np.array(len(PROMPT) - 1)}
    for rel, cache, _ in progs.caches:
        buf = np.zeros((1, t, *pre[rel].shape[2:]))
        buf[:, : len(PROMPT) - 1] = pre[rel]
        inputs[cache] = buf
    step = progs.decode.run({**progs.decode.load_checkpoint(where), **inputs})
    ref = reference_logits(model, PROMPT)[0, -1]
    assert _rel(step["logits"][0], ref) <= TOL


def test_layers_are_solved_once_and_every_instance_takes_the_plan(tmp_path: Path) -> None:
    prog = edatalog.compile(LLAMA, dims={"S": 8, "D": 32, "H": 4, "KVH": 2, "F": 48, "L": 4, "V": 40})
    plan = edatalog.plan(prog, topology="a100x4", time_limit=4)
    lay = plan.layered
    assert lay is not None and lay.count == 4 and lay.stages == 1
    rep = prog.graph.repeats[0]
    tiles = [[plan.ir.node(name).tile for name in rep.instance(k)] for k in range(rep.count)]
    assert all(t == tiles[0] for t in tiles[1:])
    # The prediction is per layer x L, give or take the program around the layers.
    assert plan.summary()["layers"]["layers_times_count_ms"] == pytest.approx(lay.layer_ms * 4)
    assert (
        0.9 * lay.layer_ms * lay.count <= plan.report.seconds * 1e3 <= 1.1 * (lay.layer_ms * lay.count + lay.outer_ms)
    )


def _small() -> edatalog.Program:
    text = LLAMA.read_text().replace(": f32", ": f64")
    return edatalog.compile_string(
        text, name="llama.edl", dims={"S": 6, "D": 24, "H": 6, "KVH": 2, "F": 40, "L": 3, "V": 37}
    )


def test_a_pipeline_split_plan_equals_the_reference() -> None:
    """Two stages on two devices: layers 0 and 1 on device 0, layer 2 on device 1 (the layers'
    plan solved on one device), in the simulator and on two torch logical devices."""
    prog = _small()
    plan = edatalog.plan(prog, topology="cpux2", stages=2, time_limit=3)
    rep = prog.graph.repeats[0]
    devices = [{d for name in rep.instance(k) for ds in plan.ir.node(name).tile.devices for d in ds} for k in range(3)]
    assert devices == [{0}, {0}, {1}]
    values = prog.random_inputs(0)
    ref = prog.run(values)["logits"]
    np.testing.assert_allclose(prog.run(values, plan=plan, backend="sim")["logits"], ref, rtol=1e-12, atol=1e-12)
    out = prog.run(values, plan=plan, backend="torch")["logits"]
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.distributed
def test_a_pipeline_split_plan_runs_on_two_processes(tmp_path: Path) -> None:
    prog = _small()
    plan = edatalog.plan(prog, topology="cpux2", stages=2, time_limit=3)
    values = prog.random_inputs(3)
    path, inputs, out = tmp_path / "plan.json", tmp_path / "in.npz", tmp_path / "out.npz"
    plan.save(path)
    savez: Any = np.savez  # numpy's stub types **arrays as the allow_pickle flag
    savez(inputs, **values)
    text = LLAMA.read_text().replace(": f32", ": f64")
    source = tmp_path / "llama.edl"
    source.write_text(text)
    dims = ["--dim", "S=6", "--dim", "D=24", "--dim", "H=6", "--dim", "KVH=2", "--dim", "F=40", "--dim", "L=3"]
    cmd = [sys.executable, "-m", "edatalog.cli", "run", str(source), *dims, "--dim", "V=37"]
    cmd += ["--plan", str(path), "--backend", "torch", "--nproc", "2", "--inputs", str(inputs), "-o", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as got:
        np.testing.assert_allclose(got["logits"], prog.run(values)["logits"], rtol=1e-10, atol=1e-10)


def test_the_plan_json_of_a_model_round_trips(tmp_path: Path) -> None:
    prog = _small()
    plan = edatalog.plan(prog, topology="cpux2", time_limit=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = edatalog.load_plan(path, prog)
    assert again.ir == plan.ir
    assert again.graph.repeats == prog.graph.repeats
