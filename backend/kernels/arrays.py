"""Array namespaces: the array operations the evaluator needs, on numpy arrays or torch tensors.

The evaluator (:mod:`edatalog.backend.kernels.joinagg`, :mod:`~edatalog.backend.kernels.operands`,
:mod:`~edatalog.backend.kernels.contract`, :mod:`~edatalog.backend.kernels.reference`) is written once, against
an :class:`ArrayOps` passed to it explicitly: :data:`NUMPY`, the reference and ground truth, or
:data:`TORCH`, so that a runtime computes exactly the reference's algorithm (same contraction
order, same masks, same rounding points) on CPU or CUDA tensors.  Only what numpy and torch spell
or behave differently is a method here: strided views, padding, dtype names, in-place writes,
reductions to a Python bool.  The scalar ops and aggregations live in :mod:`edatalog.backend.kernels.ops`.

Nothing here copies a tensor to the host or asks where its cells are (no ``nonzero``, no boolean
indexing): a CUDA evaluation never waits on the device except where it must decide a path
(:meth:`ArrayOps.all`).  torch is imported on first use of :data:`TORCH`, never on import, so
``import edatalog`` stays fast and numpy-only runs never load it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from edatalog.ir import dtypes

Array = Any  # a numpy.ndarray (or numpy scalar) with NUMPY, a torch.Tensor with TORCH
Pads = Sequence[tuple[int, int]]


@functools.cache
def torch_module() -> Any:
    """torch, imported on first use (a second or so): only torch evaluations and ops that need it
    (erf) pay for it."""
    import torch

    return torch


def wire_dtype(dtype: Any) -> Any:
    """The torch dtype a tensor of ``dtype`` travels as between ranks: half floats as 16-bit
    integers and bools as bytes, which every torch.distributed backend carries (moved
    bitwise, never reduced); anything else as itself."""
    torch = torch_module()
    if dtype in (torch.bfloat16, torch.float16):
        return torch.int16
    if dtype == torch.bool:
        return torch.uint8
    return dtype


class ArrayOps:
    """The operations of one array library, as the evaluator uses them.  ``device`` arguments are
    where new arrays go (None: the library's default); numpy ignores them."""

    name: str
    # Whether a kernel may read values back to the host to choose its shapes (a loop over what
    # the values say); False while a graph is being recorded, whose replays must not depend on them.
    reads_back: bool = True

    # -- dtypes -------------------------------------------------------------------------------

    def dtype(self, name: str) -> Any:
        """The library's dtype for an edatalog dtype name (``bf16`` included)."""
        raise NotImplementedError

    @property
    def bool_(self) -> Any:
        return self.dtype("bool")

    def native_matmul(self, dtype: str, device: Any) -> bool:
        """Whether a matmul of two ``dtype`` arrays on ``device`` accumulates in f32 and rounds
        its result once, at a speed worth having (what a ``bf16`` rule computes, per
        docs/language.md 10.2): then a half-precision sum of two products runs natively."""
        return False

    def is_float(self, dtype: Any) -> bool:
        raise NotImplementedError

    def limits(self, dtype: Any) -> tuple[float | int | bool, float | int | bool]:
        """The least and greatest value of ``dtype`` (infinities for floats): what ``max`` and
        ``min`` start from."""
        raise NotImplementedError

    def constant(self, value: float | int | bool, dtype: Any) -> Any:
        """``value`` as a scalar that ``where`` and arithmetic keep in ``dtype``."""
        raise NotImplementedError

    # -- making arrays ------------------------------------------------------------------------

    def device_of(self, arrays: Sequence[Array | None]) -> Any:
        """Where the results of an evaluation on ``arrays`` go: the first array's device."""
        return None

    def asarray(self, x: Any, dtype: Any = None, device: Any = None) -> Array:
        """``x`` (an array of either library, or a number) as this library's array, in ``dtype``
        when given; no copy when it already is one."""
        raise NotImplementedError

    def is_copy(self, made: Array, source: Any) -> bool:
        """Whether ``made`` (``asarray(source, ...)``) is a new array that nothing else holds, so
        an evaluator may overwrite it.  The reference (numpy) never overwrites: False."""
        return False

    def broadcast_shape(self, shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
        return tuple(np.broadcast_shapes(*(tuple(s) for s in shapes)))

    def is_dense(self, a: Array) -> bool:
        """Whether ``a`` is contiguous: every cell its own memory, so it can take results."""
        raise NotImplementedError

    def to_numpy(self, a: Array) -> np.ndarray:
        """A copy on the host, for results handed to users and tests (never in evaluation)."""
        raise NotImplementedError

    def cast(self, a: Array, dtype: Any) -> Array:
        """``a`` in ``dtype``; ``a`` itself when it already is."""
        raise NotImplementedError

    def scalar(self, value: float | int | bool, dtype: Any, device: Any = None) -> Array:
        """A 0-d array."""
        return self.full((), value, dtype, device)

    def full(self, shape: Sequence[int], fill: float | int | bool, dtype: Any, device: Any = None) -> Array:
        raise NotImplementedError

    def empty(self, shape: Sequence[int], dtype: Any, device: Any = None) -> Array:
        raise NotImplementedError

    def arange(self, lo: int, hi: int, dtype: Any, device: Any = None) -> Array:
        raise NotImplementedError

    # -- views and layout ---------------------------------------------------------------------

    def contiguous(self, a: Array) -> Array:
        raise NotImplementedError

    def as_strided(self, a: Array, shape: Sequence[int], strides: Sequence[int], offset: int) -> Array:
        """A read-only view of the contiguous ``a``: element ``offset + sum(i_k * strides[k])`` at
        index ``i``; strides in elements, possibly negative or zero."""
        raise NotImplementedError

    def pad(self, a: Array, pads: Pads, fill: float | int | bool) -> Array:
        """``a`` with ``pads[k] = (before, after)`` cells of ``fill`` around axis ``k``."""
        raise NotImplementedError

    def view(self, a: Array, shape: Sequence[int]) -> Array:
        """``a`` reshaped without a copy (an error where that needs one): writes go to ``a``."""
        raise NotImplementedError

    def transpose(self, a: Array, axes: Sequence[int]) -> Array:
        raise NotImplementedError

    def broadcast_to(self, a: Array, shape: Sequence[int]) -> Array:
        raise NotImplementedError

    # -- computing ----------------------------------------------------------------------------

    def where(self, cond: Array, a: Array, b: Array) -> Array:
        raise NotImplementedError

    def logical_and(self, a: Array, b: Array) -> Array:
        raise NotImplementedError

    def logical_or(self, a: Array, b: Array) -> Array:
        raise NotImplementedError

    def isfinite(self, a: Array) -> Array:
        raise NotImplementedError

    def matmul(self, a: Array, b: Array) -> Array:
        raise NotImplementedError

    def any(self, a: Array, axes: tuple[int, ...]) -> Array:
        """Logical or over ``axes`` (at least one)."""
        raise NotImplementedError

    def all(self, a: Array) -> bool:
        """Whether every element is true: a host decision (on CUDA it waits for the device)."""
        raise NotImplementedError

    def all_finite(self, a: Array) -> bool:
        """Whether every element of ``a`` is finite: a host decision that picks a faster path
        when it holds.  A tracer may assume it, and check the assumption after the graph runs."""
        return self.all(self.isfinite(a))

    def take_along(self, a: Array, index: Array, axis: int) -> Array:
        """``a`` read along ``axis`` at ``index`` (int64, of size 1 along ``axis``), the other
        axes broadcast between the two: a gather, the result of size 1 along ``axis``."""
        raise NotImplementedError

    def argwhere_first(self, a: Array) -> tuple[int, ...] | None:
        """The first position where ``a`` holds, in row-major order, or None."""
        raise NotImplementedError

    # -- writing in place ---------------------------------------------------------------------

    def assign(self, view: Array, values: Array | bool, where: Array | None) -> None:
        """``view = values`` (an array or a number) where ``where`` holds (everywhere when None),
        in place."""
        raise NotImplementedError

    def masked_fill(self, a: Array, mask: Array, value: float | int | bool) -> None:
        """``a = value`` where ``mask`` holds, in place."""
        raise NotImplementedError

    def add_rows(self, target: Array, index: Array, values: Array) -> None:
        """``target[index[i], ...] += values[i, ...]`` for every ``i``, in place, repeated rows
        summed (a scatter-add): ``target`` is 2-d, ``values`` 2-d with as many columns, and
        ``index`` int64, 1-d (one row per value row) or of ``values``' shape (a row per element)."""
        raise NotImplementedError

    def ignore_fp_errors(self) -> AbstractContextManager[object]:
        """IEEE semantics without warnings: overflow gives inf, 0/0 gives nan."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"<array namespace {self.name}>"


class NumpyOps(ArrayOps):
    """numpy: the reference.  bf16 arrays use ``ml_dtypes.bfloat16``."""

    name = "numpy"

    def is_dense(self, a: Array) -> bool:
        return bool(a.flags.c_contiguous)

    def dtype(self, name: str) -> np.dtype:
        return dtypes.to_numpy(name)

    def is_float(self, dtype: Any) -> bool:
        return np.dtype(dtype).kind == "f"

    def limits(self, dtype: Any) -> tuple[float | int | bool, float | int | bool]:
        dtype = np.dtype(dtype)
        if dtype.kind == "f" or dtypes.from_numpy(dtype) == "bf16":
            return -math.inf, math.inf
        if dtype.kind == "b":
            return False, True
        info = np.iinfo(dtype)
        return int(info.min), int(info.max)

    def constant(self, value: float | int | bool, dtype: Any) -> Any:
        return np.dtype(dtype).type(value)

    def asarray(self, x: Any, dtype: Any = None, device: Any = None) -> Array:
        if type(x).__module__.split(".")[0] == "torch":
            x = TORCH.to_numpy(x)
        a = np.asarray(x)
        return a if dtype is None else a.astype(dtype, copy=False)

    def to_numpy(self, a: Array) -> np.ndarray:
        return np.array(a)

    def cast(self, a: Array, dtype: Any) -> Array:
        return np.asarray(a).astype(dtype, copy=False)

    def full(self, shape: Sequence[int], fill: float | int | bool, dtype: Any, device: Any = None) -> Array:
        return np.full(tuple(shape), fill, dtype=dtype)

    def empty(self, shape: Sequence[int], dtype: Any, device: Any = None) -> Array:
        return np.empty(tuple(shape), dtype=dtype)

    def arange(self, lo: int, hi: int, dtype: Any, device: Any = None) -> Array:
        return np.arange(lo, hi, dtype=dtype)

    def contiguous(self, a: Array) -> Array:
        return np.ascontiguousarray(a)

    def as_strided(self, a: Array, shape: Sequence[int], strides: Sequence[int], offset: int) -> Array:
        flat = a.reshape(-1)
        base = flat[offset:] if a.size else flat
        return as_strided(base, shape=tuple(shape), strides=[s * a.itemsize for s in strides], writeable=False)

    def pad(self, a: Array, pads: Pads, fill: float | int | bool) -> Array:
        return np.pad(a, [tuple(p) for p in pads], constant_values=fill)

    def view(self, a: Array, shape: Sequence[int]) -> Array:
        out = a.reshape(tuple(shape))
        assert not a.size or np.may_share_memory(out, a), "reshape copied: the array must be contiguous"
        return out

    def transpose(self, a: Array, axes: Sequence[int]) -> Array:
        return np.transpose(a, tuple(axes))

    def broadcast_to(self, a: Array, shape: Sequence[int]) -> Array:
        return np.broadcast_to(a, tuple(shape))

    def where(self, cond: Array, a: Array, b: Array) -> Array:
        return np.where(cond, a, b)

    def logical_and(self, a: Array, b: Array) -> Array:
        return np.logical_and(a, b)

    def logical_or(self, a: Array, b: Array) -> Array:
        return np.logical_or(a, b)

    def isfinite(self, a: Array) -> Array:
        return np.isfinite(a)

    def matmul(self, a: Array, b: Array) -> Array:
        return np.matmul(a, b)

    def any(self, a: Array, axes: tuple[int, ...]) -> Array:
        return np.any(a, axis=axes)

    def all(self, a: Array) -> bool:
        return bool(np.all(a))

    def take_along(self, a: Array, index: Array, axis: int) -> Array:
        shape = list(np.broadcast_shapes(a.shape, index.shape))
        wide, at = shape.copy(), shape.copy()
        wide[axis], at[axis] = a.shape[axis], 1
        return np.take_along_axis(np.broadcast_to(a, wide), np.broadcast_to(index, at), axis)

    def argwhere_first(self, a: Array) -> tuple[int, ...] | None:
        if not np.any(a):
            return None
        return tuple(int(x) for x in np.unravel_index(int(np.argmax(a)), np.shape(a)))

    def assign(self, view: Array, values: Array | bool, where: Array | None) -> None:
        np.copyto(view, values, where=True if where is None else where)

    def masked_fill(self, a: Array, mask: Array, value: float | int | bool) -> None:
        np.copyto(a, value, where=mask)

    def add_rows(self, target: Array, index: Array, values: Array) -> None:
        if index.ndim == 1:
            np.add.at(target, index, values)
        else:
            np.add.at(target, (index, np.arange(values.shape[1])[None, :]), values)

    def ignore_fp_errors(self) -> AbstractContextManager[object]:
        return np.errstate(all="ignore")


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    t = torch_module()
    return {
        "f64": t.float64,
        "f32": t.float32,
        "f16": t.float16,
        "bf16": t.bfloat16,
        "i64": t.int64,
        "i32": t.int32,
        "bool": t.bool,
    }


@functools.cache
def _cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's own test: AVX-512 BF16 or AMX)."""
    try:
        return bool(torch_module().ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# An f32 GEMM on a CPU of at least this many multiply-adds (rows x shared x columns) runs as
# oneDNN's linear rather than ATen's ``mm``/``linear`` (MKL's sgemm): see :func:`onednn_linear_op`.
ONEDNN_F32_MIN_MACS = 1 << 22


@functools.cache
def onednn_linear_op() -> Any:
    """oneDNN's f32 linear (``torch.ops.mkldnn._linear_pointwise``), where this torch has it;
    else None.  ATen's f32 ``mm`` on a CPU is MKL's sgemm, and on this project's AMD EPYC (AVX-512)
    MKL took 2.0-2.3x oneDNN's time for a LLaMA block's GEMMs (512 x 1024 x 2816: 13.6 against
    6.3 ms, two threads; 25.1 against 11.7, one), and for every shape of at least 4M multiply-adds
    measured, rows from 1 to 2048; below that, oneDNN's ~10 µs of set-up per call loses (8 x 256
    x 256: 1.4x MKL's time).  The same arithmetic in another order: results differ from MKL's in
    the last bits, as two BLAS libraries' do.  bf16 GEMMs already reach oneDNN through ``mm``."""
    t = torch_module()
    try:
        if not t.backends.mkldnn.is_available():
            return None
        return t.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def overlaps(a: Array) -> bool:
    """Whether two cells of torch tensor ``a`` share memory without a zero stride making them
    copies of one (an ``as_strided`` sliding window: oneDNN refuses such operands, ATen takes
    them): its dims of more than one cell and a stride, by stride, each step past the last
    cell of the one before."""
    dims = sorted((st, n) for n, st in zip(a.shape, a.stride(), strict=True) if n > 1 and st != 0)
    return any(st < prev_st * prev_n for (prev_st, prev_n), (st, _) in itertools.pairwise(dims))


def onednn_takes(a: Array, b: Array) -> bool:
    """Whether the product ``a @ b`` of two torch matrices runs as oneDNN's linear: both f32, on
    a CPU, at least :data:`ONEDNN_F32_MIN_MACS` multiply-adds, where this torch has oneDNN and a
    user has not turned it off (``torch.backends.mkldnn.flags(enabled=False)``), and ``b`` has
    no rows that share memory (a sliding window, which oneDNN refuses).  The one rule, for the
    runtime's GEMMs and for the benchmarks' baselines (``benchmarks/onednn_gemms.py``)."""
    t = torch_module()
    return bool(
        a.dtype == t.float32
        and b.dtype == t.float32
        and a.ndim == 2
        and b.ndim == 2
        and a.device.type == "cpu"
        and a.shape[0] * a.shape[1] * b.shape[1] >= ONEDNN_F32_MIN_MACS
        and onednn_linear_op() is not None
        and t.backends.mkldnn.enabled
        and not overlaps(b)
    )


@functools.cache
def opaque_onednn_linear() -> Any:
    """:func:`onednn_linear_op` as a custom op of its own (``edatalog::onednn_linear(a, w)``), for
    graphs that inductor compiles: inductor lowers ``mkldnn._linear_pointwise`` only for weights
    that are constants of a frozen graph, and calls a custom op as the opaque kernel it is."""
    t = torch_module()
    linear = onednn_linear_op()

    @t.library.custom_op("edatalog::onednn_linear", mutates_args=(), schema="(Tensor a, Tensor w) -> Tensor")
    def onednn_linear(a: Any, w: Any) -> Any:
        return linear(a, w, None, "none", [], "")

    @onednn_linear.register_fake
    def _(a: Any, w: Any) -> Any:
        return a.new_empty((*a.shape[:-1], w.shape[0]))

    return t.ops.edatalog.onednn_linear.default


class TorchOps(ArrayOps):
    """torch tensors on any device.  New arrays go where the inputs are; ``device`` is where those
    with no input to follow go (None: torch's default)."""

    name = "torch"

    def __init__(self, device: Any = None) -> None:
        self.default_device = device

    def dtype(self, name: str) -> Any:
        return _torch_dtypes()[name]

    def native_matmul(self, dtype: str, device: Any) -> bool:
        # bf16 GEMMs accumulate in f32 on GPUs and on CPUs with bf16 instructions (oneDNN on
        # AVX-512 BF16 or AMX); f16 ones are fast only on GPUs.  On a CPU without them a bf16
        # GEMM is emulated: 512 x 1024 x 2816 took 2,961 ms where the same GEMM in f32 took 18.8
        # (an AVX2 EPYC), so the inputs are widened to f32 and the f32 GEMM runs instead (the
        # same arithmetic: products of bf16 values are exact in f32, sums accumulate in f32).
        on_gpu = getattr(device, "type", str(device)) == "cuda"
        if dtype == "f16":
            return on_gpu
        return dtype == "bf16" and (on_gpu or _cpu_has_bf16())

    def is_float(self, dtype: Any) -> bool:
        return bool(dtype.is_floating_point)

    def limits(self, dtype: Any) -> tuple[float | int | bool, float | int | bool]:
        t = torch_module()
        if dtype.is_floating_point:
            return -math.inf, math.inf
        if dtype == t.bool:
            return False, True
        info = t.iinfo(dtype)
        return int(info.min), int(info.max)

    def constant(self, value: float | int | bool, dtype: Any) -> Any:
        # A Python number: torch keeps a tensor's dtype against it, and it needs no device.
        if dtype == torch_module().bool:
            return bool(value)
        return float(value) if dtype.is_floating_point else int(value)

    def device_of(self, arrays: Sequence[Array | None]) -> Any:
        t = torch_module()
        return next((a.device for a in arrays if isinstance(a, t.Tensor)), self.default_device)

    def asarray(self, x: Any, dtype: Any = None, device: Any = None) -> Any:
        t = torch_module()
        if not isinstance(x, t.Tensor):
            a = np.asarray(x, order="C")  # not ascontiguousarray: it makes a 0-d array 1-d
            if not a.flags.writeable:  # torch warns on (and may not write) read-only memory
                a = a.copy()
            if dtypes.from_numpy(a.dtype) == "bf16":  # torch cannot read ml_dtypes' bf16
                x = t.from_numpy(a.view(np.int16)).view(t.bfloat16)
            else:
                x = t.from_numpy(a)
        here = device is None or x.device == (device if isinstance(device, t.device) else t.device(device))
        if here and (dtype is None or x.dtype == dtype):
            return x  # already there: the common case on every call of a runtime
        return x.to(device=device if device is not None else x.device, dtype=dtype if dtype is not None else x.dtype)

    def is_copy(self, made: Array, source: Any) -> bool:
        t = torch_module()
        return isinstance(source, t.Tensor) and made is not source and made.data_ptr() != source.data_ptr()

    def is_dense(self, a: Array) -> bool:
        return bool(a.is_contiguous())

    def to_numpy(self, a: Array) -> np.ndarray:
        t = torch_module()
        a = a.detach().cpu().contiguous()
        if a.dtype == t.bfloat16:
            return a.view(t.int16).numpy().view(dtypes.to_numpy("bf16")).copy()
        return a.numpy().copy()

    def cast(self, a: Array, dtype: Any) -> Any:
        return a if a.dtype == dtype else a.to(dtype)

    def full(self, shape: Sequence[int], fill: float | int | bool, dtype: Any, device: Any = None) -> Any:
        return torch_module().full(tuple(shape), fill, dtype=dtype, device=device or self.default_device)

    def empty(self, shape: Sequence[int], dtype: Any, device: Any = None) -> Any:
        return torch_module().empty(tuple(shape), dtype=dtype, device=device or self.default_device)

    def arange(self, lo: int, hi: int, dtype: Any, device: Any = None) -> Any:
        return torch_module().arange(lo, hi, dtype=dtype, device=device or self.default_device)

    def contiguous(self, a: Array) -> Any:
        return a.contiguous()

    def as_strided(self, a: Array, shape: Sequence[int], strides: Sequence[int], offset: int) -> Any:
        # torch has no negative strides: step along such an axis backwards (from its far end),
        # then flip it, a copy of the view (rare: ``x[N - 1 - i]``, ``x[l - k]``).
        t = torch_module()
        steps = [s if n > 1 else 0 for s, n in zip(strides, shape, strict=True)]
        flip = [k for k, s in enumerate(steps) if s < 0]
        for k in flip:
            offset += steps[k] * (shape[k] - 1)
            steps[k] = -steps[k]
        if not a.numel():
            offset = 0
        out = t.as_strided(a, tuple(shape), tuple(steps), a.storage_offset() + offset)
        return t.flip(out, flip) if flip else out

    def pad(self, a: Array, pads: Pads, fill: float | int | bool) -> Any:
        shape = [n + lo + hi for n, (lo, hi) in zip(a.shape, pads, strict=True)]
        out = self.full(shape, fill, a.dtype, a.device)
        out[tuple(slice(lo, lo + n) for n, (lo, _) in zip(a.shape, pads, strict=True))] = a
        return out

    def view(self, a: Array, shape: Sequence[int]) -> Any:
        return a.view(tuple(shape))

    def transpose(self, a: Array, axes: Sequence[int]) -> Any:
        return a.permute(tuple(axes))

    def broadcast_to(self, a: Array, shape: Sequence[int]) -> Any:
        return torch_module().broadcast_to(a, tuple(shape))

    def where(self, cond: Array, a: Array, b: Array) -> Any:
        return torch_module().where(cond, a, b)

    def logical_and(self, a: Array, b: Array) -> Any:
        return torch_module().logical_and(a, b)

    def logical_or(self, a: Array, b: Array) -> Any:
        return torch_module().logical_or(a, b)

    def isfinite(self, a: Array) -> Any:
        return torch_module().isfinite(a)

    def matmul(self, a: Array, b: Array) -> Any:
        t = torch_module()
        dtype = t.promote_types(a.dtype, b.dtype)
        a, b = a.to(dtype), b.to(dtype)
        if not dtype.is_floating_point and a.device.type != "cpu":  # CUDA has no integer matmul
            return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2, dtype=dtype)
        if onednn_takes(a, b) and not (t.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
            return onednn_linear_op()(a, b.mT, None, "none", [], "")  # no autograd formula: not under it
        if dtype.is_floating_point and a.ndim == 2 and b.ndim == 2 and b.mT.is_contiguous():
            # x @ W.T with W laid out (out, in), as a Linear layer's weight: torch's linear takes
            # a faster way than matmul's for it (oneDNN on CPU; bf16 3.1 against 3.6-4.5 ms).
            return t.nn.functional.linear(a, b.mT)
        return t.matmul(a, b)

    def any(self, a: Array, axes: tuple[int, ...]) -> Any:
        assert axes, "torch reduces every axis for dim=()"
        return torch_module().any(a, dim=axes)

    def all(self, a: Array) -> bool:
        return bool(torch_module().all(a))

    def take_along(self, a: Array, index: Array, axis: int) -> Array:
        torch = torch_module()
        shape = list(torch.broadcast_shapes(a.shape, index.shape))
        wide, at = shape.copy(), shape.copy()
        wide[axis], at[axis] = a.shape[axis], 1
        return torch.gather(a.expand(wide), axis, index.expand(at))

    def argwhere_first(self, a: Array) -> tuple[int, ...] | None:
        torch = torch_module()
        if not bool(torch.any(a)):
            return None
        flat = int(torch.argmax(a.reshape(-1).to(torch.uint8)))
        return tuple(int(x) for x in np.unravel_index(flat, tuple(a.shape)))

    def assign(self, view: Array, values: Array | bool, where: Array | None) -> None:
        t = torch_module()
        if where is not None:
            view.copy_(t.where(where, values, view))
        elif isinstance(values, t.Tensor):
            view.copy_(values)
        else:
            view.fill_(values)

    def masked_fill(self, a: Array, mask: Array, value: float | int | bool) -> None:
        a.masked_fill_(mask, value)

    def add_rows(self, target: Array, index: Array, values: Array) -> None:
        if index.ndim == 1:
            target.index_add_(0, index, values)
        else:
            target.scatter_add_(0, index, values)


NUMPY = NumpyOps()
TORCH = TorchOps()
