"""Re-run SGLang's post-load processing for exactly the FP4 layers a weight update wrote into.

Runs inside SGLang's scheduler processes (through the custom-weight-loader hook, custom_loader.py); imports
torch only. A session spans one whole update (all buckets):

begin   every FP4 layer's raw-slot parameters get a forwarding `weight_loader`; nothing is allocated.
load    the release loads the update as usual (`model.load_weights`). The first write into a layer restores its
        checkpoint layout: the installed (kernel-layout) tensors are set aside, the method's `create_weights`
        registers fresh raw parameters (read-only ones are kept), and the write goes there. Later writes, in
        this or a later bucket, land in the same raw parameters.
end     for the touched layers, in first-write order: check every rewritten element arrived, run the method's
        `process_weights_after_loading`, then copy each result into the tensor installed under the same name
        and bind that tensor back -- the installed storage never moves, so captured CUDA graphs keep reading
        it. Untouched layers are never re-processed.

Idempotent: a layer is always processed from a freshly built raw layout holding only the sent bytes (plus
read-only tensors processing never changes), so an identical update installs identical tensors. A layer that did
not receive all of its rewritten tensors is not re-processed: its previous tensors (and read-only values) go back,
and the update fails loudly.
Cost: during a session each touched layer holds one raw copy of its FP4 tensors next to the installed ones.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

from .fp4_layouts import Fp4Layout, layout_of

logger = logging.getLogger(__name__)

SESSION_ATTR = "_qrl_fp4_reload_session"


class IncompleteFp4Update(RuntimeError):
    """A touched FP4 layer did not receive every tensor it needs; its previous weights were put back."""


class Fp4LayoutChanged(RuntimeError):
    """Re-processing produced a tensor of another shape/dtype than the installed one (CUDA graphs would break)."""


def tensor_attributes(module) -> dict[str, torch.Tensor]:
    """The module's own tensors by attribute name: parameters, buffers and plain tensor attributes."""
    out = {n: t for n, t in module._parameters.items() if t is not None}
    out.update({n: t for n, t in module._buffers.items() if t is not None})
    out.update({n: t for n, t in vars(module).items() if isinstance(t, torch.Tensor) and n not in out})
    return out


def snapshot(module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (tensor object, its data): re-processing may rebind `.data` of an installed object in place (the
    release's copy_or_rebind_param does when shapes differ), so the storage is remembered separately."""
    return {n: (t, t.data) for n, t in tensor_attributes(module).items()}


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same memory, shape and dtype (`param.data` returns a new tensor object on every access)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


def put_back(module, name: str, obj: torch.Tensor, data: torch.Tensor) -> None:
    """Bind `obj` under `name` again, holding its original storage."""
    if not same_view(obj.data, data):
        obj.data = data
    bind(module, name, obj)


def bind(module, name: str, tensor: torch.Tensor) -> None:
    """setattr that also works when a plain tensor goes back where a Parameter is registered (or vice versa)."""
    if not isinstance(tensor, torch.nn.Parameter) and name in module._parameters:
        del module._parameters[name]
    if isinstance(tensor, torch.nn.Parameter) and name in vars(module):
        delattr(module, name)
    setattr(module, name, tensor)


def loader_attribute(param) -> str:
    """Where a parameter keeps its weight loader: `_weight_loader` behind BasevLLMParameter's read-only property,
    else the plain `weight_loader` attribute set_weight_attrs writes."""
    return "_weight_loader" if "_weight_loader" in vars(param) else "weight_loader"


def weight_loader(param):
    return getattr(param, "weight_loader", None)


_MISSING = object()


def fill_not_written(t: torch.Tensor) -> None:
    """NaN in every element: fp8 block scales as 0xFF, float scales as NaN."""
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0xFF)
    else:
        t.fill_(float("nan"))


def not_written(t: torch.Tensor) -> torch.Tensor:
    """Device bool: some element still holds fill_not_written's NaN."""
    if t.dtype == torch.float8_e4m3fn:
        return (t.view(torch.uint8) == 0xFF).any()
    return torch.isnan(t).any()


class ReprocessSession:
    """One weight update's reload of FP4 layers (see the module docstring)."""

    def __init__(self, model, layout_of: Callable = layout_of):
        self.model = model
        self.layers: dict[int, tuple[str, object, Fp4Layout]] = {}
        for name, module in model.named_modules():
            layout = layout_of(module)
            if layout is not None:
                self.layers[id(module)] = (name, module, layout)
        self.touched: list[object] = []
        self.installed: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.read_only_values: dict[int, dict[str, torch.Tensor]] = {}  # small scales, to undo a failed update
        self.shims: dict[int, list[tuple[str, object, str, object]]] = {}
        for _, module, layout in self.layers.values():
            self._shim(module, layout)

    # --------------------------------------------------------------------------------- forwarding loaders
    def _shim(self, module, layout: Fp4Layout) -> None:
        saved = []
        for slot in layout.raw_slots:
            param = getattr(module, slot, None)
            if param is None:
                continue
            attr = loader_attribute(param)
            saved.append((slot, param, attr, vars(param).get(attr, _MISSING)))
            setattr(param, attr, self._forwarder(module, slot))
        self.shims[id(module)] = saved

    def _unshim(self, module, slots=None) -> None:
        """Give the parameters of `slots` (default: all) their own loaders back."""
        kept = []
        for slot, param, attr, previous in self.shims.pop(id(module), []):
            if slots is not None and slot not in slots:
                kept.append((slot, param, attr, previous))
            elif previous is _MISSING:
                vars(param).pop(attr, None)
            else:
                setattr(param, attr, previous)
        if kept:
            self.shims[id(module)] = kept

    def _forwarder(self, module, slot: str):
        def forward(_installed_param, loaded_weight, *args, **kwargs):
            target = self.raw(module, slot)
            return weight_loader(target)(target, loaded_weight, *args, **kwargs)
        return forward

    # ------------------------------------------------------------------------------------------- restore
    def raw(self, module, slot: str):
        """The layer's raw parameter for `slot`, restoring the layer's checkpoint layout on first use."""
        if id(module) not in self.installed:
            self._restore(module)
        return getattr(module, slot)

    def _restore(self, module) -> None:
        name, _, layout = self.layers[id(module)]
        installed = snapshot(module)
        # read-only parameters stay in use with their own loaders; the set-aside rewritten ones keep forwarding
        # (the release's load_weights looks parameters up once per call, so later writes in this call reach them)
        self._unshim(module, layout.read_only)
        loader = next((weight_loader(installed[s][0]) for s in layout.read_only
                       if s in installed and weight_loader(installed[s][0]) is not None), None)
        if loader is None:
            raise RuntimeError(f"FP4 reload: no read-only parameter of {name} ({layout.read_only}) carries the "
                               "layer's weight_loader")
        module.quant_method.create_weights(**layout.create_weights_kwargs(module, loader))
        for slot in layout.read_only:
            if slot in installed:
                put_back(module, slot, *installed[slot])
        self.read_only_values[id(module)] = {s: installed[s][1].clone() for s in layout.read_only if s in installed}
        for slot in layout.complete:
            fill_not_written(getattr(module, slot).data)
        self.installed[id(module)] = installed
        self.touched.append(module)

    # ----------------------------------------------------------------------------------------------- end
    def finish(self) -> list[str]:
        """Re-process the touched layers; returns their names in order. Raises IncompleteFp4Update after
        re-processing the complete ones and putting the previous tensors back into the incomplete ones."""
        for _, module, _ in list(self.layers.values()):
            self._unshim(module)
        flags = [torch.stack([not_written(getattr(m, s).data) for s in self.layers[id(m)][2].complete]).any()
                 for m in self.touched]
        missing = torch.stack(flags).tolist() if flags else []  # one host sync for the whole update
        done, incomplete = [], []
        for module, lacks in zip(self.touched, missing):
            name = self.layers[id(module)][0]
            installed = self.installed.pop(id(module))
            read_only = self.read_only_values.pop(id(module))
            if lacks:
                for slot, (obj, data) in installed.items():
                    put_back(module, slot, obj, data)
                for slot, value in read_only.items():
                    installed[slot][1].copy_(value)
                incomplete.append(name)
                continue
            module.quant_method.process_weights_after_loading(module)
            self._reinstall(name, module, installed)
            done.append(name)
        self.touched = []
        if incomplete:
            raise IncompleteFp4Update(
                f"FP4 weight update left {len(incomplete)} layer(s) partly unwritten, so they keep their previous "
                f"weights: {incomplete[:4]}{' ...' if len(incomplete) > 4 else ''}. An update must send every "
                "tensor of each FP4 layer it touches (all q/k/v, gate/up parts and all experts, with weight_scale "
                "and weight_scale_2)")
        return done

    @staticmethod
    def _reinstall(name: str, module, installed: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy every produced tensor into the storage installed under its name and bind that back."""
        produced = {n: t.data for n, t in tensor_attributes(module).items()}
        for slot, new in produced.items():
            if slot not in installed:
                continue
            obj, data = installed[slot]
            if not same_view(new, data):
                if data.shape != new.shape or data.dtype != new.dtype:
                    raise Fp4LayoutChanged(f"{name}.{slot}: re-processing produced {tuple(new.shape)} {new.dtype}, "
                                           f"the installed tensor is {tuple(data.shape)} {data.dtype}")
                data.copy_(new)
            put_back(module, slot, obj, data)


def open_session(model, layout_of: Callable = layout_of) -> ReprocessSession:
    """The model's open session, or a new one. An update that died midway leaves its session open; the next
    update continues it, so its layers are re-processed at that update's end."""
    session = getattr(model, SESSION_ATTR, None)
    if session is not None:
        logger.warning("FP4 reload: a weight update session was still open (an earlier update did not finish); "
                       "continuing it")
        return session
    session = ReprocessSession(model, layout_of)
    object.__setattr__(model, SESSION_ATTR, session)
    return session


def close_session(model) -> list[str]:
    """Finish and drop the model's session; [] if none is open."""
    session = getattr(model, SESSION_ATTR, None)
    if session is None:
        logger.warning("FP4 reload: end of update without a begin; nothing to re-process")
        return []
    object.__delattr__(model, SESSION_ATTR)
    return session.finish()


def load(model, named_tensors: Iterable) -> None:
    named_tensors = list(named_tensors)
    if named_tensors:
        model.load_weights(named_tensors)
