"""The C kernels reached through public APIs with tensors they must not read as they are: an int8 decoding
copy whose layer norms or packed weights a user replaced, a float32 model whose weights a user replaced
between decoding steps, and the copy under `torch.func.vmap`. Each case
is refused with a clear error or steps aside to torch, with the torch path's values, and never crashes:
each runs in its own process, so that a crash fails its test rather than the suite. The processes fork from
multiprocessing's fork server, which imported torch, transformers and hfgpt once for all of them."""

import multiprocessing
import os
import textwrap

import pytest

PREAMBLE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from hfgpt.cpu import quantize_for_decoding
    from hfgpt.cpu.quantization import Int8Linear
    from hfgpt.modeling import GPTConfig, GPTForCausalLM
    from hfgpt.modeling.modeling_hfgpt import CACHE_FIELD

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = quantize_for_decoding(GPTForCausalLM(config).eval())
    block = model.transformer.h[0]
    ids = torch.randint(0, 96, (2, 7))

    def torch_path_logits():
        # A forward pre-hook on each block: code the fused kernel path would skip, so every block runs
        # its torch modules (the int8 products included).
        handles = [b.register_forward_pre_hook(lambda module, args: None) for b in model.transformer.h]
        try:
            with torch.no_grad():
                return model(ids).logits
        finally:
            for handle in handles:
                handle.remove()

    def step_logits(change=lambda: None, torch_path=False):
        # The logits of a decoding step (the last token, after a cache of the others; `change` made between
        # them), in one call of the int8 step where it applies, or with every block through its modules.
        handles = []
        if torch_path:
            handles = [b.register_forward_pre_hook(lambda module, args: None) for b in model.transformer.h]
        try:
            with torch.no_grad():
                cache = getattr(model(ids[:, :-1], use_cache=True), CACHE_FIELD)
                change()
                return model(ids[:, -1:], cache=cache).logits
        finally:
            for handle in handles:
                handle.remove()

    def outcome(run):
        try:
            with torch.no_grad():
                return run()
        except (RuntimeError, ValueError, TypeError) as error:
            print("refused:", type(error).__name__, str(error).splitlines()[0])
            raise SystemExit(0)
    """
)

CASES = {
    "strided layer norm weight": """
        width = block.ln_1.weight.shape[0]
        strided = torch.empty(2 * width)
        strided[::2] = block.ln_1.weight.detach()
        block.ln_1.weight = nn.Parameter(strided[::2])
        expected = torch_path_logits()
        got = outcome(lambda: model(ids).logits)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        print("values equal")
    """,
    "expanded layer norm weight": """
        width = block.ln_2.weight.shape[0]
        block.ln_2.weight = nn.Parameter(block.ln_2.weight.detach()[-1:].expand(width))
        expected = torch_path_logits()
        got = outcome(lambda: model(ids).logits)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        print("values equal")
    """,
    "bfloat16 layer norm": """
        block.ln_1.to(torch.bfloat16)
        got = outcome(lambda: model(ids).logits)
        assert torch.isfinite(got).all(), "non-finite logits"
        torch.testing.assert_close(got, torch_path_logits(), atol=1e-5, rtol=1e-5)
        print("values equal")
    """,
    "smaller packed weight": """
        layer = block.attn.c_attn
        assert isinstance(layer, Int8Linear)
        layer.packed = layer.packed[:1].clone()
        outcome(lambda: model(ids).logits)
        raise AssertionError("a product with a truncated packed weight returned values")
    """,
    "packed weight of another dtype": """
        layer = block.mlp.c_fc
        layer.packed = layer.packed.to(torch.int32)  # the same values: torch's ops read them as they are
        got = outcome(lambda: model(ids).logits)
        torch.testing.assert_close(got, torch_path_logits(), atol=0, rtol=0)
        with torch.no_grad():
            x = torch.randn(3, layer.in_features)
            torch.testing.assert_close(layer(x), layer.reference(x), atol=0, rtol=0)
        print("values equal")
    """,
    "strided layer norm weight, set between decoding steps": """
        def change():
            width = block.ln_1.weight.shape[0]
            strided = torch.empty(2 * width)
            strided[::2] = block.ln_1.weight.detach()
            block.ln_1.weight = nn.Parameter(strided[::2])
        weight = block.ln_1.weight
        got = outcome(lambda: step_logits(change))
        block.ln_1.weight = weight
        expected = step_logits(change, torch_path=True)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        print("values equal")
    """,
    "smaller packed weight, set between decoding steps": """
        def change():
            block.mlp.c_proj.packed = block.mlp.c_proj.packed[:1].clone()
        outcome(lambda: step_logits(change))
        raise AssertionError("a step with a truncated packed weight returned values")
    """,
    "final norm of another dtype, set between decoding steps": """
        got = outcome(lambda: step_logits(lambda: model.transformer.ln_f.to(torch.float64)))
        raise AssertionError("a float32 step with a float64 final norm returned values")
    """,
    "float32 model: transposed c_attn weight, set between decoding steps": """
        from hfgpt.cpu import kernelize
        model = kernelize(GPTForCausalLM(config).eval())
        layer = model.transformer.h[1].attn.c_attn
        weight = layer.weight
        def change():
            layer.weight = nn.Parameter(weight.detach().t().contiguous().t())  # the same values, column-major
        got = outcome(lambda: step_logits(change))
        layer.weight = weight
        expected = step_logits(change, torch_path=True)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        print("values equal")
    """,
    "float32 model: smaller c_fc bias, set between decoding steps": """
        from hfgpt.cpu import kernelize
        model = kernelize(GPTForCausalLM(config).eval())
        layer = model.transformer.h[0].mlp.c_fc
        outcome(lambda: step_logits(lambda: setattr(layer, "bias", nn.Parameter(layer.bias.detach()[:-1]))))
        raise AssertionError("a step with a truncated bias returned values")
    """,
    "vmap over the batch": """
        rows = outcome(lambda: torch.func.vmap(lambda row: model(row[None]).logits[0])(ids))
        with torch.no_grad():
            expected = torch.stack([model(row[None]).logits[0] for row in ids])
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)
        print("values equal")
    """,
}

EXPECTED = {
    "strided layer norm weight": "values equal",
    "expanded layer norm weight": "values equal",
    "bfloat16 layer norm": "refused:",
    "smaller packed weight": "refused:",
    "packed weight of another dtype": "values equal",
    "vmap over the batch": "values equal",
    "strided layer norm weight, set between decoding steps": "values equal",
    "smaller packed weight, set between decoding steps": "refused:",
    "final norm of another dtype, set between decoding steps": "refused:",
    "float32 model: transposed c_attn weight, set between decoding steps": "values equal",
    "float32 model: smaller c_fc bias, set between decoding steps": "refused:",
}


FORK_SERVER = multiprocessing.get_context("forkserver")
FORK_SERVER.set_forkserver_preload(["torch", "transformers", "hfgpt.cpu", "hfgpt.modeling"])


def run_script(script: str, output: str) -> None:
    """In a forked process: `script` run as __main__, what it prints (stdout and stderr, Python's and C's)
    written to the file `output`; its exit code is the process's."""
    with open(output, "w") as handle:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
    exec(compile(script, "<case>", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("case", list(CASES))
def test_misused_kernel_inputs_are_refused_or_step_aside(case, tmp_path):
    output = tmp_path / "output.txt"
    process = FORK_SERVER.Process(
        target=run_script, args=(PREAMBLE + textwrap.dedent(CASES[case]), str(output))
    )
    process.start()
    process.join(timeout=300)
    if process.exitcode is None:  # (still running: the timeout)
        process.kill()
        process.join()
    printed = output.read_text() if output.exists() else ""
    assert process.exitcode == 0, f"exit {process.exitcode}\n{printed[-3000:]}"
    last = printed.strip().splitlines()[-1]
    assert last.startswith(EXPECTED[case]), last
