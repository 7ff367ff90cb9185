"""hfgpt's CPU backend (docs/cpu-backend.md): each decoding step of `generate()` in one call into C where that
computes what the model's own code would, and decoding copies with int8, bfloat16 or float32 weights
(`quantize_for_decoding`). Importing hfgpt installs it for every `GPTForCausalLM` unless the environment sets
`HFGPT_CPU_BACKEND=0`; `unkernelize(model)` and `kernelize(model)` take one model off it and put it on.
"""

import hfgpt.modeling  # noqa: F401  (the models; importing them installs this backend)

from .backend import ENV_SWITCH, enabled_by_default, is_kernelized, kernelize, unkernelize
from .quantization import quantize_for_decoding

__all__ = [
    "ENV_SWITCH", "enabled_by_default", "is_kernelized", "kernelize", "quantize_for_decoding", "unkernelize",
]  # fmt: skip
