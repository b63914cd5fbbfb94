"""The tensor-parallel example runs under torchrun on CPU (gloo) and matches the single-device
model it was built from."""

from test_examples import torchrun


def test_tp_parallelize_gpt_example():
    out = torchrun("tp_parallelize_gpt.py", 2, "--check", "--steps", "2", "--n-layer", "1")
    assert "tp=2 dp=1" in out
    assert "step 1: loss" in out
    last = [line for line in out.splitlines() if line.startswith("max |loss")]
    assert len(last) == 1, out
    loss_diff = float(last[0].split("=")[1].split(";")[0])
    assert loss_diff < 1e-9, out
