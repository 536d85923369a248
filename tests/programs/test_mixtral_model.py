"""``programs/mixtral.edl`` and ``programs/mixtral_decode.edl`` against transformers'
``MixtralForCausalLM``, with random weights that transformers itself saves (``save_pretrained``
writes one tensor per expert, ``...block_sparse_moe.experts.{e}.w1.weight``) and edatalog loads
from that directory by the names the programs declare (stacked along the expert axis ``X``).

The configuration is small: 2 layers, 8 experts of which each token takes 2, 4 query heads
sharing 2 key/value heads (GQA), rope theta 1e6 (Mixtral's default), eps 1e-6, no sliding
window (MixtralConfig's default, and Mixtral-8x7B's); float64 throughout.  transformers runs
its RMSNorms, RoPE's angles and the router's softmax in float32 even then, which bounds the
agreement near 4e-7 (max |diff| / max |logit|); with those three in float64 it is 2e-15.
Weights are large enough that routing varies from token to token and every part matters
(matrices ~ N(0, 1.5^2 / fan_in), norm weights ~ N(1, 0.5^2)).
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
from safetensors import safe_open
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral import modeling_mixtral

import edatalog
from edatalog import generation
from edatalog.checkpoint import configured
from edatalog.ir import program as ir
from edatalog.lang.parser import parse_file
from tests.programs.checkpoints import compile_configured, randomized, reference_logits, save

ROOT = Path(__file__).resolve().parents[2]
MIXTRAL = ROOT / "programs" / "mixtral.edl"
DECODE = ROOT / "programs" / "mixtral_decode.edl"
PROMPT = [1, 5, 9, 2, 30, 77, 101]
NEW = 12
TOL = 1e-6
LAYERS, EXPERTS, TOP = 2, 8, 2


def _model(seed: int = 0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    config: Any = cast(Any, MixtralConfig)(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        experts_implementation="eager",  # its loop over the experts (the grouped kernel takes no f64)
    )
    assert config.sliding_window is None  # the programs have no window
    model: Any = cast(Any, MixtralForCausalLM)(config).double().eval()
    return randomized(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MixtralForCausalLM]:
    model = _model()
    return save(tmp_path_factory, model, "mixtral"), model


def _compile(weights: Path, seq: int, **kw: Any) -> edatalog.Program:
    return compile_configured(MIXTRAL, weights, seq, **kw)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| over max |b|."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_the_checkpoint_holds_one_tensor_per_expert(saved: tuple[Path, MixtralForCausalLM]) -> None:
    where, _ = saved
    with safe_open(str(where / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_the_config_sets_the_dims(saved: tuple[Path, MixtralForCausalLM]) -> None:
    where, _ = saved
    for path in (MIXTRAL, DECODE):
        dims, consts = configured(parse_file(str(path)), where)
        assert dims == {"D": 64, "H": 4, "KVH": 2, "F": 96, "L": LAYERS, "V": 128, "X": EXPERTS, "K": TOP}
        assert consts == {"eps": 1e-6, "theta": 1e6}


def test_logits_equal_transformers_from_its_own_checkpoint(saved: tuple[Path, MixtralForCausalLM]) -> None:
    where, model = saved
    prog = _compile(where, len(PROMPT))
    assert [r.name for r in prog.graph.relations if r.kind == "input"] == ["ids"]
    assert prog.outputs == ("logits",) and prog.graph.relation("logits").shape == (1, len(PROMPT), 128)
    params = prog.load_checkpoint(where)
    assert params["layers.1.w1"].shape == (EXPERTS, 96, 64) and params["layers.1.w2"].shape == (EXPERTS, 64, 96)
    values = {**params, "ids": np.array([PROMPT])}
    out = _compile(where, len(PROMPT), outputs=("logits", "layers.route")).run(values)
    ref = reference_logits(model, PROMPT)
    assert _rel(out["logits"], ref) <= TOL
    # The comparison means something: tokens take different experts, every expert is taken
    # somewhere, and another expert's weights change the logits.
    routes = np.concatenate([out[f"layers.{k}.route"].reshape(-1, TOP) for k in range(LAYERS)])
    assert len({tuple(r) for r in routes}) > 4 and set(routes.ravel()) == set(range(EXPERTS))
    other = dict(values)
    other["layers.1.w2"] = other["layers.1.w2"][::-1].copy()
    assert _rel(prog.run(other)["logits"], ref) > 1e-3


def test_logits_equal_transformers_with_its_float32_parts_in_float64(
    saved: tuple[Path, MixtralForCausalLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With transformers' RMSNorm, rotary angles and router softmax computed in float64 (its
    own code, less the casts to float32), the logits agree to rounding: the program is
    Mixtral's computation, exactly (the 4e-7 above is transformers' float32)."""
    where, model = saved
    if not hasattr(modeling_mixtral, "MixtralTopKRouter"):
        pytest.skip("this transformers has another Mixtral router")
    config: Any = model.config
    head = config.hidden_size // config.num_attention_heads
    theta = float(config.rope_parameters["rope_theta"])
    inv_freq = 1.0 / theta ** (torch.arange(0, head, 2, dtype=torch.float64) / head)

    def norm(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].double() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def router(self: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x.reshape(-1, self.hidden_dim), self.weight)
        top, places = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), places

    monkeypatch.setattr(modeling_mixtral.MixtralRMSNorm, "forward", norm)
    monkeypatch.setattr(modeling_mixtral.MixtralRotaryEmbedding, "forward", rotary)
    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", router)
    prog = _compile(where, len(PROMPT))
    out = prog.run({**prog.load_checkpoint(where), "ids": np.array([PROMPT])})["logits"]
    assert _rel(out, reference_logits(model, PROMPT)) <= 1e-12


EXPERT_RULES = {f"layers.{k}.{r}" for k in range(LAYERS) for r in ("h1", "h3", "moe")}


def test_torch_runs_the_experts_as_grouped_gemms(
    saved: tuple[Path, MixtralForCausalLM], routed_calls: list[str]
) -> None:
    where, model = saved
    prog = _compile(where, len(PROMPT))
    out = prog.run({**prog.load_checkpoint(where), "ids": np.array([PROMPT])}, backend="torch")["logits"]
    assert _rel(np.asarray(out), reference_logits(model, PROMPT)) <= TOL
    assert sorted(routed_calls) == sorted(EXPERT_RULES)  # every expert rule, and nothing else


def test_expert_parallel_layers_move_only_the_tokens_and_partial_sums(
    saved: tuple[Path, MixtralForCausalLM], routed_calls: list[str]
) -> None:
    """The ``expert`` plan on 2 logical devices: every layer's expert rows (``h1``, ``h3`` and
    ``act``, which carries the route) stay on their experts' device, the layers after the
    first copied from it (their pieces routed by their own layer's route); only ``moe``'s
    partial sums are reduced.  The logits equal transformers'."""
    where, model = saved
    prog = _compile(where, len(PROMPT))
    plan = edatalog.plan(prog, topology="cpux2", strategy="expert")
    received = {op.relation for _, _, op in plan.schedule.programs.ops() if isinstance(op, ir.Recv)}
    expert_rows = {f"layers.{k}.{r}" for k in range(LAYERS) for r in ("h1", "h3", "act")}
    assert not received & expert_rows and {f"layers.{k}.moe" for k in range(LAYERS)} <= received
    values = {**prog.load_checkpoint(where), "ids": np.array([PROMPT])}
    exe = edatalog.executable(prog, plan, backend="torch", device=["cpu", "cpu"])
    params = {r.name for r in prog.arguments if r.kind == "param"}
    exe.load({k: torch.tensor(v) for k, v in values.items() if k in params})
    out = exe({"ids": torch.tensor(values["ids"])})["logits"].numpy()
    assert _rel(out, reference_logits(model, PROMPT)) <= TOL
    assert set(routed_calls) == EXPERT_RULES


def _hf_generate(model: MixtralForCausalLM) -> list[int]:
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    out: list[int] = ids[0, len(PROMPT) :].tolist()
    return out


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_greedy_generation_equals_transformers(
    saved: tuple[Path, MixtralForCausalLM], backend: str, routed_calls: list[str]
) -> None:
    where, model = saved
    want = _hf_generate(model)
    gen = edatalog.generate(MIXTRAL, where, PROMPT, NEW, dtype="f64", backend=backend)
    assert gen.ids == want
    if backend == "torch":  # the prefill's expert rules and the decode step's (of the same names)
        assert set(routed_calls) == EXPERT_RULES and len(routed_calls) > len(EXPERT_RULES)
    assert len(set(want)) > 3  # not one token over and over: the comparison means something
    assert gen.tokens_per_second > 0 and gen.prefill_seconds > 0


def test_a_decode_step_equals_the_model_at_the_next_position(saved: tuple[Path, MixtralForCausalLM]) -> None:
    """One step of mixtral_decode.edl over the cache of a prefix gives the logits the whole
    model gives at that position."""
    where, model = saved
    req = generation.request(MIXTRAL, where, PROMPT[:-1], 2, dtype="f64", backend="reference")
    assert req.decode == str(DECODE)
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


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "edatalog.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_edl_check_and_generate_from_the_command_line(saved: tuple[Path, MixtralForCausalLM]) -> None:
    where, model = saved
    done = _cli("check", str(MIXTRAL))
    assert done.returncode == 0 and "mixtral.edl: ok" in done.stdout, done.stderr[-3000:]
    args = ["generate", str(MIXTRAL), "--weights", str(where), "--prompt-ids", ",".join(map(str, PROMPT))]
    done = _cli(*args, "--max-new", str(NEW), "--dtype", "f64", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["ids"] == _hf_generate(model)


@pytest.mark.distributed
def test_greedy_generation_on_two_processes_with_solved_plans(saved: tuple[Path, MixtralForCausalLM]) -> None:
    """``edl generate --nproc 2``: both programs solved for 2 CPU devices, each rank running its
    device's programs over gloo and reading only its slices of the checkpoint.  (In f64 the
    recorded graphs run every expert over every row, masked: ``torch._grouped_mm`` takes no f64.)"""
    where, model = saved
    args = ["generate", str(MIXTRAL), "--weights", str(where), "--prompt-ids", ",".join(map(str, PROMPT))]
    args += ["--max-new", str(NEW), "--dtype", "f64", "--nproc", "2", "--time-limit", "3"]
    done = _cli(*args, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["ids"] == _hf_generate(model)


@pytest.mark.distributed
@pytest.mark.slow
def test_f32_generation_on_two_processes_records_the_grouped_gemms(
    saved: tuple[Path, MixtralForCausalLM], tmp_path: Path
) -> None:
    """The same in f32 (a checkpoint saved in f32), the ranks' steps recorded as graphs that
    replay the grouped GEMMs for any routing: the same tokens as transformers in f64."""
    _, model = saved
    f32: Any = _model()
    f32.float().save_pretrained(tmp_path)
    args = ["generate", str(MIXTRAL), "--weights", str(tmp_path), "--prompt-ids", ",".join(map(str, PROMPT))]
    done = _cli(*args, "--max-new", str(NEW), "--nproc", "2", "--time-limit", "3", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["ids"] == _hf_generate(model)


CAPACITY = ROOT / "programs" / "mixtral_capacity.edl"


def test_the_capacity_model_drops_only_what_overflows(saved: tuple[Path, MixtralForCausalLM]) -> None:
    """programs/mixtral_capacity.edl, from the same checkpoint: with a slot for every choice
    (C = S: a token's K choices are distinct experts, so no expert can get more) its logits are
    transformers'; with one slot per sequence and expert, choices are dropped and they differ.
    Under the ``expert`` plan (the sequences split for their rules, the experts for theirs) the
    dispatch and the combine are the slots' all-to-alls, and the run equals the reference."""
    where, model = saved
    ref = reference_logits(model, PROMPT)
    values: dict[str, Any] = {}
    for slots, close in ((len(PROMPT), True), (1, False)):
        prog = compile_configured(CAPACITY, where, len(PROMPT), dims={"C": slots})
        values = {**prog.load_checkpoint(where), "ids": np.array([PROMPT])}
        out = prog.run(values)["logits"]
        assert (_rel(out, ref) <= TOL) == close, _rel(out, ref)
    prog = compile_configured(CAPACITY, where, len(PROMPT), dims={"C": 1, "B": 2})  # two sequences
    values = {**values, "ids": np.array([PROMPT, PROMPT[::-1]])}
    plan = edatalog.plan(prog, topology="cpux2", strategy="expert")
    received = {op.relation for _, _, op in plan.schedule.programs.ops() if isinstance(op, ir.Recv)}
    assert {"layers.0.xe", "layers.0.ye"} <= received  # the slots, both ways
    got = prog.run(values, plan=plan, backend="torch")["logits"]
    np.testing.assert_allclose(np.asarray(got), prog.run(values)["logits"], rtol=1e-10, atol=1e-12)


def test_greedy_generation_of_the_capacity_model_equals_transformers(saved: tuple[Path, MixtralForCausalLM]) -> None:
    """Prefill with room for every choice, then mixtral_decode.edl's steps (one token a step:
    a group of one never overflows)."""
    where, model = saved
    gen = edatalog.generate(
        CAPACITY, where, PROMPT, NEW, decode=DECODE, dims={"C": len(PROMPT)}, dtype="f64", backend="reference"
    )
    assert gen.ids == _hf_generate(model)
