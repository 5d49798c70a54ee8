"""The GLM-4.5 model, written once for both frameworks (see ``module.py`` for how).

``glm4_moe.py`` reads like the architecture; one file per concept beside it (linear,
layernorm, rotary, embedding, attention, moe); ``ops.py`` is the interface a framework
implements and the model's maths on top of it; ``loader.py`` fills the parameters.
"""

from glm_fused.model.module import Module, bind
from glm_fused.model.ops import Ops, Routing

__all__ = ["Module", "bind", "Ops", "Routing"]
