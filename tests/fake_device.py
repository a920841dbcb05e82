"""Test-only: an accelerator on a CPU-only torch, to catch host/device mixes and device syncs in CI (no GPU).

Inside :func:`fake_device`, a tensor moved to :data:`DEVICE` becomes a :class:`OnDevice`: a tensor subclass that
reports a non-CPU device and holds a real CPU tensor, so every op computes the real numbers (a test can compare them
with a plain CPU run). A dispatch mode sees every op and:

- raises :class:`DeviceMismatch` when device tensors meet host tensors (other than 0-dim ones, as CUDA allows), as
  CUDA raises ``Expected all tensors to be on the same device``; copies (``copy_``, ``.to``) cross freely;
- raises it too for a host ``torch.Generator`` drawing device numbers, or a device generator drawing host ones;
- records every device -> host copy and value read (``.cpu()``, ``copy_`` into a host tensor, ``.item()``, ``int()``,
  ``.tolist()``, ``nonzero``, ``unique``, boolean-mask indexing and assignment, ...): on a GPU each waits for the
  device (:attr:`FakeDevice.syncs`);
- records every host -> device copy, with whether it was non-blocking from pinned memory (:attr:`FakeDevice.uploads`).

Why not PyTorch's ``FakeTensorMode``: its tensors hold no data, so data-dependent code (``nonzero``, a loop that stops
when every row has produced eos, shapes read from lengths) cannot run under it, and autograd on a fake ``cuda``
tensor aborts the process on a CPU-only build (autograd asks the CUDA device guard for a stream). The fake device
here is therefore ``meta`` (a device type whose guard the CPU build has): the product code treats every non-CPU
device alike (``rl.precision.on_accelerator``). Not covered: what only a CUDA device does (CUDA kernels, streams,
``torch.cuda`` calls, the ``device.type == "cuda"`` branches, autocast on CUDA: ``torch.autocast`` has no ``meta``
device, so bf16 mixed precision runs only with precision ``float32`` here), strides and real pinning, a non-blocking
copy to the host read before the device is done, and ops reached through ``torch.tensor(..., device=)`` in C++
without Python. Stricter than CUDA: indexing a device tensor with host index tensors raises here (CUDA copies the
indices over, which is slow but allowed).
"""

from __future__ import annotations

import contextlib
import sysconfig
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
aten = torch.ops.aten

_CROSSING = {aten.copy_.default, aten._to_copy.default}
"""Ops that may take a host and a device tensor together (the copy itself)."""
_READS = {
    aten._local_scalar_dense.default,  # .item(), int(), float(), bool()
    aten.nonzero.default,  # output size depends on the data
    aten.masked_select.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
}
"""Device ops whose result the host must wait for."""


class DeviceMismatch(RuntimeError):
    """Device tensors met host tensors in one op (CUDA: ``Expected all tensors to be on the same device``)."""


class OnDevice(torch.Tensor):
    """A real CPU tensor (``elem``) that says it lives on :data:`DEVICE`."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[return-value]
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=DEVICE,
            requires_grad=elem.requires_grad,
        )

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __repr__(self) -> str:  # noqa: D105
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        return NotImplemented  # the mode handles every op


_DEVICE_SEED_SALT = 0x5DEECE66D
"""Device generators draw another stream than host ones seeded alike (as CUDA's Philox differs from the CPU's)."""


class _Generator(torch._C.Generator):
    """``torch.Generator``: a device one draws from a CPU generator whose state :func:`_is_device_generator` knows
    (torch hands a dispatch mode a new Python object for the same generator, so it is recognised by its state)."""

    device_generators: list[_Generator] = []

    def __new__(cls, device: torch.device | str = "cpu") -> _Generator:
        g = super().__new__(cls, "cpu")
        if torch.device(device).type != "cpu":
            cls.device_generators.append(g)
        return g

    def manual_seed(self, seed: int) -> _Generator:
        salted = seed ^ _DEVICE_SEED_SALT if any(self is g for g in self.device_generators) else seed
        super().manual_seed(salted)
        return self


def _is_device_generator(g: torch._C.Generator) -> bool:
    state = g.get_state()
    return any(torch.equal(state, d.get_state()) for d in _Generator.device_generators)


@dataclass
class Transfer:
    """One copy or read across the host/device boundary, with where the product code asked for it."""

    op: str
    shape: tuple[int, ...]
    where: str
    non_blocking: bool = False
    pinned: bool = False


def _caller() -> str:
    """The innermost frame outside torch, this module and the standard library: where the code asked for the op."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if "/torch/" not in f and not f.endswith("fake_device.py") and not f.startswith(stdlib):
            return f"{'/'.join(f.split('/')[-3:])}:{frame.lineno} {frame.name}"
    return "?"


@dataclass
class FakeDevice(TorchDispatchMode):
    """The dispatch mode of :func:`fake_device` and what it recorded."""

    syncs: list[Transfer] = field(default_factory=list)
    uploads: list[Transfer] = field(default_factory=list)
    pinned: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        device_in = any(isinstance(a, OnDevice) for a in flat)
        # CUDA takes a 0-dim host tensor as a scalar in elementwise ops only (cat, index ops, ... refuse it)
        scalars_ok = torch.Tag.pointwise in func.tags
        host_in = [
            a
            for a in flat
            if isinstance(a, torch.Tensor) and not isinstance(a, OnDevice) and (a.dim() > 0 or not scalars_ok)
        ]
        target = kwargs.get("device")
        to_device = target is not None and torch.device(target).type != "cpu"
        to_host = target is not None and torch.device(target).type == "cpu"
        if device_in and host_in and func not in _CROSSING:
            shapes = [tuple(t.shape) for t in host_in]
            msg = f"{func}: device tensors met host tensors of shapes {shapes} at {_caller()}"
            raise DeviceMismatch(msg)
        self._check_generator(func, flat, on_device=device_in or to_device)
        if func is aten._to_copy.default and device_in and to_host or func in _READS and device_in:
            self.syncs.append(Transfer(str(func), tuple(args[0].shape), _caller()))
        if (
            func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)
            and device_in
            and any(i is not None and i.dtype == torch.bool for i in args[1])
        ):
            self.syncs.append(Transfer("boolean-mask index", tuple(args[0].shape), _caller()))
        if func is aten.copy_.default and not isinstance(args[0], OnDevice) and isinstance(args[1], OnDevice):
            self.syncs.append(Transfer("copy to the host", tuple(args[1].shape), _caller()))
        if to_device:
            kwargs = {**kwargs, "device": torch.device("cpu")}
            if func is aten._to_copy.default and not device_in:
                self.uploads.append(self._upload(args[0], kwargs))
        if func is aten.copy_.default and isinstance(args[0], OnDevice) and not isinstance(args[1], OnDevice):
            self.uploads.append(self._upload(args[1], kwargs))

        def unwrap(a):  # noqa: ANN001, ANN202
            return a.elem if isinstance(a, OnDevice) else a

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func is aten.copy_.default:
            return args[0]
        if to_device or device_in and not to_host:
            return tree_map(lambda t: OnDevice(t) if type(t) is torch.Tensor else t, out)
        return out

    def _upload(self, src: torch.Tensor, kwargs: dict) -> Transfer:
        pinned = any(src is p for p in self.pinned)
        return Transfer(
            "upload", tuple(src.shape), _caller(), non_blocking=bool(kwargs.get("non_blocking")), pinned=pinned
        )

    @staticmethod
    def _check_generator(func, flat: list, *, on_device: bool) -> None:  # noqa: ANN001
        for g in flat:
            if isinstance(g, torch._C.Generator) and _is_device_generator(g) != on_device:
                where = "host" if on_device else "device"
                msg = f"{func}: a {where} generator draws {'device' if on_device else 'host'} numbers at {_caller()}"
                raise DeviceMismatch(msg)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """``Tensor.pin_memory`` here: a copy that later uploads recognise as pinned."""
        out = t.clone()
        self.pinned.append(out)
        return out


_to = torch.Tensor.to


def _moved(mode: FakeDevice):  # noqa: ANN202
    """``Tensor.to`` that sends tensors bound for a non-CPU device through the mode as device copies (the real one would
    make a data-less ``meta`` tensor, or fail on a CPU-only build for ``cuda``)."""

    def to(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rest, target = list(args), kwargs.get("device")
        if rest and isinstance(rest[0], (str, torch.device)):
            target = rest.pop(0)
        elif rest and isinstance(rest[0], torch.Tensor):
            target, rest = rest[0].device, [rest[0].dtype, *rest[1:]]
        if target is None or torch.device(target).type == "cpu":
            return _to(self, *args, **kwargs)
        dtype = kwargs.get("dtype") or (rest[0] if rest and isinstance(rest[0], torch.dtype) else None) or self.dtype
        non_blocking = kwargs.get("non_blocking", rest[1] if len(rest) > 1 else False)
        if isinstance(self, OnDevice):
            return self if dtype == self.dtype else aten._to_copy(self, dtype=dtype)
        return aten._to_copy(self, dtype=dtype, device=DEVICE, non_blocking=bool(non_blocking))

    return to


def _factory(original, move):  # noqa: ANN001, ANN202
    """``torch.tensor`` / ``torch.as_tensor`` that build on the host, then move (C++ would skip the mode)."""

    def make(data, *args, device=None, **kwargs):  # noqa: ANN001, ANN202
        t = original(data, *args, **kwargs)
        return t if device is None else move(t, device)

    return make


def move(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``model.to(device)`` that keeps tied parameters tied (a model's shared embedding and LM head). Moving between the
    host and the fake device replaces each parameter by a new one (the two tensor types cannot share a storage), which
    unties them: re-tie every group that shared one parameter before."""
    groups: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                groups.setdefault(id(p), []).append((module, name))
    model.to(device)
    for (first, first_name), *rest in groups.values():
        for module, name in rest:
            module._parameters[name] = first._parameters[first_name]
    return model


@contextlib.contextmanager
def fake_device() -> Iterator[FakeDevice]:
    """Inside this block, ``x.to(DEVICE)`` (also ``model.to(DEVICE)``) and factories with ``device=DEVICE`` make device
    tensors that compute on the CPU; see the module docstring for what is checked and recorded."""
    mode = FakeDevice()
    move = _moved(mode)
    with contextlib.ExitStack() as stack:
        for target, name, value in [
            (torch.Tensor, "to", move),
            (torch.Tensor, "pin_memory", lambda self, *a, **k: mode.pin(self)),
            (torch.Tensor, "is_pinned", lambda self, *a, **k: any(self is p for p in mode.pinned)),
            (torch, "tensor", _factory(torch.tensor, move)),
            (torch, "as_tensor", _factory(torch.as_tensor, move)),
            (torch, "Generator", _Generator),
        ]:
            stack.enter_context(mock.patch.object(target, name, value))
        stack.enter_context(mock.patch.object(_Generator, "device_generators", []))
        stack.enter_context(mode)
        yield mode
