"""The layers' base class, and ``bind``: one model definition, a native module per framework.

Every layer of the model is written once, as a subclass of ``Module``, against two names:

* ``self.F``  - the framework's ops (``glm_fused.model.ops.Ops``): tensor maths, parameters;
* ``self.nn`` - the framework's layer classes, to build children: ``self.nn.RMSNorm(...)``.

The classes written here are never instantiated. ``bind(ops)`` makes, for one framework, a
twin of each that also derives from that framework's module class, with ``F`` and ``nn`` set:
Paddle's twins are ``paddle.nn.Layer``s, torch's ``torch.nn.Module``s, each with the
framework's parameters, ``state_dict``, ``eval()`` and ``__call__``. Both twins of a class are
also instances of the class written here (``isinstance(m, glm_fused.model.RMSNorm)``).
"""

from __future__ import annotations

from types import SimpleNamespace

# Every layer class written here, in definition order (``Module.__init_subclass__``).
_LAYERS: list[type] = []


class Module:
    F = None   # the framework's ops, set on each twin
    nn = None  # the framework's layer classes (a namespace of twins), set on each twin

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "F" not in cls.__dict__:  # a layer written here, not a twin made by bind()
            _LAYERS.append(cls)

    def __init__(self):
        if self.F is None:
            raise TypeError(f"{type(self).__name__} is framework-neutral: use the Paddle or torch class "
                            "(glm_fused.Glm4MoeForCausalLM, glm_fused.torch_backend.Glm4MoeForCausalLM)")
        super().__init__()  # the framework's module class, next in the twin's MRO

    def param(self, shape: list[int], dtype: str, fill: float | None = None):
        """An inference-only parameter of this layer (no gradient); ``fill`` or uninitialised."""
        return self.F.param(self, list(shape), dtype, fill)


def bind(ops) -> SimpleNamespace:
    """The framework twins of every layer class: ``bind(TorchOps()).Glm4MoeForCausalLM``."""
    import glm_fused.model.glm4_moe  # noqa: F401  (defines every layer class)

    layers = SimpleNamespace(F=ops, ModuleList=ops.ModuleList)
    for cls in _LAYERS:
        twin = type(cls.__name__, (cls, ops.Module), {
            "F": ops, "nn": layers, "__module__": ops.layers_module, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__})
        setattr(layers, cls.__name__, twin)
    return layers
