"""edatalog.from_torch: modules captured with torch.export become .edl rules whose outputs equal
the module's, layout ops folded into index positions, params under their state_dict names, and
clear errors naming the op, the module and the source line."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import edatalog
from edatalog.importer import from_torch, to_edl, torch_params


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, x: Any) -> Any:
        return self.ln(self.fc2(nn.functional.gelu(self.fc1(x))) + x).softmax(-1)


class Attention(nn.Module):
    """Heads split by view and transpose, q, k and v split from one projection, matmuls."""

    def __init__(self, d: int = 16, h: int = 4) -> None:
        super().__init__()
        self.h, self.qkv, self.o = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: Any) -> Any:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        a = (q @ k.transpose(-1, -2) / math.sqrt(d // self.h)).softmax(-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, d))


class Layout(nn.Module):
    """Layout ops only, around one weight: each must read the right cells."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))

    def forward(self, x: Any) -> Any:
        y = x.reshape(2, 3, 4).permute(2, 0, 1).unsqueeze(0)  # [1, 4, 2, 3]
        y = y.expand(5, 4, 2, 3)[:, 1:3, :, 1:]  # [5, 2, 2, 2]
        z = y.select(0, 2).reshape(2, 4) * self.w.t()[:2, 1:5]
        return z.exp().sum(-1, keepdim=True) - z.amax(0)


def _check(module: Any, x: Any, rel: float) -> edatalog.Program:
    torch.manual_seed(0)
    module = module.eval()
    prog = from_torch(module, (x,))
    values = torch_params(prog, module)
    (name,) = [r.name for r in prog.arguments if r.kind == "input"]
    values[name] = x.numpy()
    got = prog.run(values)["y"]
    want = module(x).detach().numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= rel * np.abs(want).max()
    return prog


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_an_mlp_with_layer_norm_and_softmax_equals_the_module(dtype: Any, rel: float) -> None:
    torch.manual_seed(0)
    prog = _check(MLP().to(dtype), torch.randn(2, 5, 16, dtype=dtype), rel)
    params = {r.name: r.sources for r in prog.graph.relations if r.kind == "param"}
    assert params["fc1_weight"][0] == "fc1.weight" and params["ln_bias"][0] == "ln.bias"


def test_attention_heads_fold_into_index_positions() -> None:
    """The views, transposes and splits that make heads are index positions: no rule copies a
    relation, and the result equals the module's."""
    torch.manual_seed(0)
    module = Attention().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    prog = _check(module, x, 1e-9)
    text = to_edl(module.eval(), (x,))
    copies = [ln for ln in text.splitlines() if re.fullmatch(r"\w+\[[^=]*\] = \w+\[[^\]]*\]\.", ln)]
    assert not copies
    # The projection written apart as q/k/v, heads and features; the bias read so, as a composite.
    assert re.search(r"qkv_mm\[b:2, s:5, \w:3, \w:4, \w:4\] \+=", text), text
    assert re.search(r"qkv_bias\[\(1:3, \w:4, \w:4\)\]", text), text
    assert edatalog.compile_string(text).graph.fingerprint() == prog.graph.fingerprint()


def test_a_transformer_encoder_layer_equals_the_module() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).double()
    _check(layer, torch.randn(2, 5, 16, dtype=torch.float64), 1e-9)


def test_layout_ops_read_the_right_cells() -> None:
    torch.manual_seed(0)
    _check(Layout().double(), torch.randn(6, 4, dtype=torch.float64), 1e-12)


def test_names_come_from_the_forward_and_the_modules() -> None:
    torch.manual_seed(0)
    text = to_edl(MLP().eval(), (torch.randn(2, 5, 16),))
    assert "input x[2, 5, 16] : f32." in text
    assert 'param fc1_weight[32, 16] : f32 from "fc1.weight".' in text
    assert "output y." in text and "fc1_mm[" in text and "ln_var[" in text


class DataDependent(nn.Module):
    def forward(self, x: Any) -> Any:
        if x.sum() > 0:  # control flow on a value: export cannot capture it
            return x
        return -x


def test_a_model_export_cannot_capture_is_a_clear_error() -> None:
    with pytest.raises(edatalog.EdlError, match=r"torch\.export could not capture DataDependent") as err:
        from_torch(DataDependent(), (torch.randn(3),))
    assert err.value.__cause__ is not None


class Pick(nn.Module):
    """index_select by an integer input, of an input's middle axis and of a weight's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: Any, idx: Any) -> Any:
        return x.index_select(1, idx) * 2.0 + self.w.index_select(0, idx).sum()


def test_index_select_is_a_lookup() -> None:
    torch.manual_seed(0)
    module = Pick().double().eval()
    x, idx = torch.randn(2, 6, 3, dtype=torch.float64), torch.tensor([4, 0, 2, 2])
    prog = from_torch(module, (x, idx))
    got = prog.run(torch_params(prog, module) | {"x": x.numpy(), "idx": idx.numpy()})["y"]
    np.testing.assert_allclose(got, module(x, idx).detach().numpy(), rtol=1e-12)
    assert "where idx[" in to_edl(module, (x, idx))


GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "import_errors"


@pytest.mark.parametrize("case", sorted(GOLDEN.glob("*.py")), ids=lambda p: p.stem)
def test_import_errors_match_their_golden_text(case: Path, update_goldens: bool) -> None:
    """Each ``tests/golden/import_errors/NAME.py`` makes a module the importer refuses;
    ``NAME.expected`` is the whole message (paths relative to the repository).  Regenerate with
    ``pytest --update-goldens`` and review the diff."""
    spec = importlib.util.spec_from_file_location(f"import_error_{case.stem}", case)
    assert spec is not None and spec.loader is not None
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    module, args = source.make()
    with pytest.raises(edatalog.EdlError) as err:
        from_torch(module, args)
    root = str(GOLDEN.parents[2]) + "/"
    text = str(err.value).replace(root, "") + "\n"
    expected = case.with_suffix(".expected")
    if update_goldens:
        expected.write_text(text)
    assert text == expected.read_text()


class Embed(nn.Module):
    """A token embedding plus learned positions (arange), as GPT-2 starts."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(11, 8), nn.Embedding(16, 8)

    def forward(self, ids: Any) -> Any:
        positions = torch.arange(ids.shape[1])
        return self.wte(ids) + self.wpe(positions)


def test_embeddings_are_lookups() -> None:
    torch.manual_seed(0)
    module = Embed().double().eval()
    ids = torch.randint(0, 11, (2, 5))
    prog = from_torch(module, (ids,))
    values = torch_params(prog, module) | {"ids": ids.numpy()}
    got = prog.run(values)["y"]
    np.testing.assert_allclose(got, module(ids).detach().numpy(), rtol=1e-12)
    text = to_edl(module, (ids,))
    assert "where ids[" in text  # the rows picked by value: a lookup, not a one-hot contraction


def test_edl_import_writes_a_program_edl_checks(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from edatalog.cli import main

    (tmp_path / "mymodels.py").write_text(
        "from torch import nn\n"
        "def make_mlp():\n"
        "    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["import", "mymodels:make_mlp", "--shape", "2x5x16", "-o", "mlp.edl"]) == 0
    text = (tmp_path / "mlp.edl").read_text()
    assert "input input_[2, 5, 16] : f32." in text  # the forward's argument, a keyword of the language
    assert 'param m0_weight[32, 16] : f32 from "0.weight".' in text
    assert main(["check", "mlp.edl"]) == 0
    capsys.readouterr()
    assert main(["import", "mymodels:make_mlp"]) == 1
    assert "give each with --shape" in capsys.readouterr().err
    assert main(["import", "mymodels:missing", "--shape", "2x16"]) == 1
    assert "mymodels has no callable missing" in capsys.readouterr().err


class Crossing(nn.Module):
    """Two operands whose axes were split in crossing ways ([2, 3] and [3, 2] views of 6), as an
    elementwise op and as a contraction: written whole first, then combined."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))

    def forward(self, x: Any, y: Any) -> Any:
        a = x.view(2, 3).permute(1, 0).permute(1, 0).reshape(6)
        b = y.view(3, 2).reshape(6)
        return (a * b) @ self.w + b.view(3, 2).reshape(6) @ self.w


def test_operands_split_in_crossing_ways_are_written_whole_first() -> None:
    torch.manual_seed(0)
    module = Crossing().double().eval()
    x, y = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    prog = from_torch(module, (x, y))
    values = torch_params(prog, module) | {"x": x.numpy(), "y_": y.numpy()}
    np.testing.assert_allclose(prog.run(values)["y"], module(x, y).detach().numpy(), rtol=1e-12)


def _causal_lm(kind: str, dtype: Any) -> tuple[Any, Any]:
    """A small random transformers causal LM and token ids."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        settings: dict[str, Any] = {
            "vocab_size": 37,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,  # grouped-query attention
            "max_position_embeddings": 64,
            "rope_theta": 500.0,  # transformers 4 and 5 both take it
        }
        model: Any = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    elif kind == "qwen2":  # biased q, k and v projections
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                vocab_size=37,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
        )
    else:  # learned positions, Conv1D projections, tanh GELU, tied head
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=37, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=0, eos_token_id=0
            )
        )
    return model.to(dtype).eval(), torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("kind", "dtype", "rel"),
    [
        ("llama", torch.float32, 1e-5),
        # transformers' LLaMA computes its RMS norms and rotary tables in f32 whatever the
        # model's dtype (hidden_states.to(torch.float32)), which the rules do not: in f64 the
        # two differ by that rounding.
        ("llama", torch.float64, 1e-6),
        ("qwen2", torch.float32, 1e-5),
        ("gpt2", torch.float32, 1e-5),
        ("gpt2", torch.float64, 1e-9),
    ],
)
def test_transformers_causal_lms_import_and_equal_their_logits(kind: str, dtype: Any, rel: float) -> None:
    """Imported as they are (the importer turns their KV cache off): the input is ``input_ids``,
    the output ``logits``.  The causal mask, built from shapes only, folds into a guard of the
    attention scores (``where t <= s``: masked cells are not computed); rotary halves are a
    where() of the two halves, rotary frequencies (a buffer outside the state_dict) a term; heads are
    composites."""
    model, ids = _causal_lm(kind, dtype)
    prog = from_torch(model, (), {"input_ids": ids})
    assert prog.outputs == ("logits",) and [r.name for r in prog.arguments if r.kind == "input"] == ["input_ids"]
    values = torch_params(prog, model) | {"input_ids": ids.numpy()}
    got = prog.run(values)["logits"]
    want = model(input_ids=ids).logits.detach().numpy()
    assert np.abs(got - want).max() <= rel * np.abs(want).max()
    text = to_edl(model, (), {"input_ids": ids})
    # Indices named by the config's sizes: s and t the sequence, b the batch.
    assert re.search(r"_scores\[b:2, .*s:7, t:7\] \+= .* where t <= s\.$", text, re.M), text
    # The decoder layers are one module, repeated: the planner solves one layer.
    (rep,) = prog.graph.repeats
    assert rep.count == 2 and rep.module == {"llama": "llama_decoder_layer", "qwen2": "qwen2_decoder_layer"}.get(
        kind, "gpt2_block"
    )
    assert f"repeat 2 as {'h' if kind == 'gpt2' else 'layers'}." in text
    # Each layer's attention is the five rules the runtime fuses into one kernel.
    from edatalog.ir.attention import attention_chains

    assert len(attention_chains(prog.graph)) == 2
    if kind != "gpt2":  # rotate_half inside the rotation, no copies of the halves
        assert re.search(r"where\(\w+ == 0, -self_attn_\w+\[", text), text
    if kind == "llama":  # the projections' heads written apart, as readers split them: q[b, s, g, r, half, e]
        assert re.search(r"self_attn_q_proj_mm\[b:2, s:7, \w:2, \w:2, \w:2, \w:4\] \+=", text), text


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_llama_and_qwen2_in_f64_agree_to_1e9_without_transformers_f32_rounding(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In an f64 model transformers still rounds its RMS norms and rotary angles to f32
    (``hidden_states.to(torch.float32)``, ``inv_freq.float()``): the 1e-6 above.  With those
    two forwards computing in the model's dtype, the imported rules agree to 1e-9 in f64: the
    import itself adds no error."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    def rms_norm(self: Any, h: Any) -> Any:
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self: Any, x: Any, position_ids: Any) -> Any:
        angles = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
        both = torch.cat((angles, angles), dim=-1)
        return both.cos() * self.attention_scaling, both.sin() * self.attention_scaling

    source, prefix = (modeling_llama, "Llama") if kind == "llama" else (modeling_qwen2, "Qwen2")
    monkeypatch.setattr(getattr(source, f"{prefix}RMSNorm"), "forward", rms_norm)
    monkeypatch.setattr(getattr(source, f"{prefix}RotaryEmbedding"), "forward", rotary)
    model, ids = _causal_lm(kind, torch.float64)
    prog = from_torch(model, (), {"input_ids": ids})
    got = prog.run(torch_params(prog, model) | {"input_ids": ids.numpy()})["logits"]
    want = model(input_ids=ids).logits.detach().numpy()
    assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max()


def test_an_imported_model_loads_its_save_pretrained_checkpoint(tmp_path: Any) -> None:
    """Params declare their state_dict names: the program loads the directory transformers'
    save_pretrained writes, and gives the model's logits."""
    model, ids = _causal_lm("llama", torch.float32)
    model.save_pretrained(tmp_path)
    prog = from_torch(model, (), {"input_ids": ids})
    values = prog.load_checkpoint(tmp_path) | {"input_ids": ids.numpy()}
    want = model(input_ids=ids).logits.detach().numpy()
    assert np.abs(prog.run(values)["logits"] - want).max() <= 1e-5 * np.abs(want).max()


def test_edl_import_of_a_save_pretrained_directory_runs_on_its_weights(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from edatalog.cli import main

    model, ids = _causal_lm("llama", torch.float32)
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "llama.edl"
    assert main(["import", str(tmp_path / "model"), "--shape", "2x7", "-o", str(out)]) == 0
    prog = edatalog.compile(out)
    values = prog.load_checkpoint(tmp_path / "model") | {"input_ids": ids.numpy()}
    want = model(input_ids=ids).logits.detach().numpy()
    assert np.abs(prog.run(values)["logits"] - want).max() <= 1e-5 * np.abs(want).max()
    capsys.readouterr()
    assert main(["import", str(tmp_path), "-o", str(out)]) == 1
    assert "has no config.json" in capsys.readouterr().err


class CNN(nn.Module):
    """conv2d (padded; strided), batch norm (eval), ReLU, max pool, flatten and linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.pool = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.MaxPool2d(2)
        self.conv2, self.fc = nn.Conv2d(8, 4, 3, stride=2, padding=1), nn.Linear(4 * 2 * 2, 10)

    def forward(self, x: Any) -> Any:
        return self.fc(self.conv2(self.pool(torch.relu(self.bn(self.conv(x))))).flatten(1))


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_a_small_cnn_equals_the_module(dtype: Any, rel: float) -> None:
    """Convolutions read their input at affine places (padding: reads outside are absent),
    pooling is a maximum over a band, batch norm uses the running statistics."""
    torch.manual_seed(0)
    module = CNN().to(dtype).eval()
    stats: Any = module.bn
    with torch.no_grad():
        stats.running_mean.normal_()
        stats.running_var.uniform_(0.5, 2.0)
    prog = _check(module, torch.randn(2, 3, 8, 8, dtype=dtype), rel)
    text = to_edl(module, (torch.randn(2, 3, 8, 8, dtype=dtype),))
    assert "2 * d + i - 1" in text and "max= " in text and " where h >= 2 * d, h <= 2 * d + 1" in text
    assert "num_batches_tracked" not in text  # a buffer the forward never reads
    assert len(prog.graph.nodes) == 7


def _bar_model(kind: str, tmp_path: Any) -> tuple[Any, dict[str, Any], Any]:
    """One of the issue's models in f32, its forward's arguments by name, and its checkpoint
    (transformers' save_pretrained directory, or a safetensors file of the state_dict)."""
    from safetensors.torch import save_file

    if kind in ("llama", "gpt2", "qwen2"):
        model, ids = _causal_lm(kind, torch.float32)
        model.save_pretrained(tmp_path / "model")
        return model, {"input_ids": ids}, tmp_path / "model"
    torch.manual_seed(0)
    if kind == "encoder":
        module: Any = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
        inputs = {"src": torch.randn(2, 5, 16)}
    else:
        module = CNN().eval()
        with torch.no_grad():
            module.bn.running_mean.normal_()
            module.bn.running_var.uniform_(0.5, 2.0)
        inputs = {"x": torch.randn(2, 3, 8, 8)}
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, tmp_path / "model.safetensors")
    return module, inputs, tmp_path / "model.safetensors"


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2", "encoder", "cnn"])
def test_imported_models_run_under_a_solved_plan_on_two_ranks(kind: str, tmp_path: Any) -> None:
    """The imported program is an ordinary one: solved for 2 devices, run by the torch runtime
    on 2 gloo ranks from the model's own checkpoint, it gives the module's outputs."""
    import os
    import subprocess
    import sys

    module, inputs, weights = _bar_model(kind, tmp_path)
    program = tmp_path / "model.edl"
    program.write_text(to_edl(module, (), inputs))
    np.savez(tmp_path / "inputs.npz", **{k: v.numpy() for k, v in inputs.items()})
    edl = [sys.executable, "-m", "edatalog.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EDL_DIST_TIMEOUT": "60"}
    plan, out = tmp_path / "plan.json", tmp_path / "out.npz"
    run = ["--weights", str(weights), "--inputs", str(tmp_path / "inputs.npz"), "--plan", str(plan)]
    steps = [
        [*edl, "plan", str(program), "-t", "cpux2", "--time-limit", "5", "-o", str(plan), "--json"],
        [*edl, "run", str(program), *run, "--backend", "torch", "--nproc", "2", "-o", str(out)],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        want = module(**inputs)
    name, want = ("logits", want.logits) if kind in ("llama", "gpt2", "qwen2") else ("y", want)
    got = np.load(out)[name]
    assert got.shape == tuple(want.shape)
    assert np.abs(got - want.numpy()).max() <= 1e-5 * np.abs(want.numpy()).max()  # the f32 bar


class Unlike(nn.Module):
    """Two layers of one class with different ops between them: not one module repeated."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: Any) -> Any:
        return self.layers[1](self.layers[0](x).relu()).tanh()


def test_layers_that_differ_are_written_out() -> None:
    torch.manual_seed(0)
    prog = _check(Unlike().double(), torch.randn(3, 8, dtype=torch.float64), 1e-12)
    assert not prog.graph.repeats
