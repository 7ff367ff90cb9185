"""hfgpt's CPU backend: each decoding step of `generate()` in one call into C, and decoding copies with int8,
bfloat16 or float32 weights (`quantize_for_decoding`).

Importing hfgpt (`hfgpt.modeling`) installs it for every `GPTForCausalLM`, unless the environment sets
`HFGPT_CPU_BACKEND=0`. A decoding step runs in C only where that computes what the model's own code would,
decided from the model as it is at that call; everything else runs the model file's code.
`unkernelize(model)` takes one model off the backend, `kernelize(model)` puts it on (whatever the default).
"""

import hfgpt.modeling  # noqa: F401  (the models; importing them installs this backend)

from .backend import ENV_SWITCH, enabled_by_default, is_kernelized, kernelize, unkernelize
from .quantization import quantize_for_decoding

__all__ = [
    "ENV_SWITCH",
    "enabled_by_default",
    "is_kernelized",
    "kernelize",
    "quantize_for_decoding",
    "unkernelize",
]
