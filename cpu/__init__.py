"""hfgpt's CPU backend: oneDNN products, C kernels and a fused LM-head loss that make hfgpt's models fast
on x86 CPUs, plugged into the plain models from outside.

Importing hfgpt (`hfgpt.modeling`) kernelizes every hfgpt model as it is built, unless the environment
sets `HFGPT_CPU_BACKEND=0`. Each swapped layer checks call by call whether its faster path applies (CPU,
float32 or bfloat16, eager) and otherwise runs the plain layer, so a model on another device computes the
plain model. `unkernelize(model)` restores the plain layers of one model; `kernelize(model)` swaps them in.
"""

import hfgpt.modeling  # noqa: F401  (the models; importing them installs this backend)

from .layers import ATTENTION, ENV_SWITCH, enabled_by_default, is_kernelized, kernelize, unkernelize
from .ops import onednn_products, use_onednn_products
from .quantization import quantize_for_decoding

__all__ = [
    "ATTENTION",
    "ENV_SWITCH",
    "enabled_by_default",
    "is_kernelized",
    "kernelize",
    "onednn_products",
    "quantize_for_decoding",
    "unkernelize",
    "use_onednn_products",
]
