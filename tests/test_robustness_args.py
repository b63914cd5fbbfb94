"""Bad arguments in one process: each case raises the exact error type with a message
naming the argument, or gives the right result; plus the rank generator and CLIs at scale."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from import_graph import run_importing

import mtp.parallel as mp
import mtp.tensor_parallel as tp
from mtp.ops.grouped_gemm import grouped_gemm
from mtp.parallel import agreement
from mtp.parallel.__main__ import main as parallel_main
from mtp.testing import count_host_syncs


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group (the layers then run as plain single-device layers)."""
    created = not dist.is_initialized()
    if created:
        from mtp.testing import free_port

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    yield dist.group.WORLD
    if created:  # other tests in this process expect no default group
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Tensor-parallel layers: constructor arguments
# --------------------------------------------------------------------------------------------

LINEAR_ARGS = [
    (dict(input_size=2.5), TypeError, "input_size"),
    (dict(input_size="4"), TypeError, "input_size"),
    (dict(input_size=True), TypeError, "input_size"),
    (dict(output_size=0), ValueError, "output_size"),
    (dict(stride=2.0), TypeError, "stride"),
    (dict(stride=[]), TypeError, "stride"),
    (dict(seq_dim="0"), TypeError, "seq_dim"),
    (dict(seq_dim=1.5), TypeError, "seq_dim"),
    (dict(dtype=torch.int64), TypeError, "dtype"),
    (dict(dtype=torch.complex64), TypeError, "dtype"),
    (dict(dtype="float32"), TypeError, "dtype"),
    (dict(device="nope"), ValueError, "device"),
    (dict(group="tp"), TypeError, "group"),
    (dict(init_method=3), TypeError, "init_method"),
    (dict(bias="yes"), TypeError, "bias"),
    (dict(sequence_parallel=1), TypeError, "sequence_parallel"),
    (dict(skip_bias_add=None), TypeError, "skip_bias_add"),
]


@pytest.mark.parametrize("layer", ["ColumnParallelLinear", "RowParallelLinear"])
@pytest.mark.parametrize("kwargs, error, name", LINEAR_ARGS)
def test_linear_constructor_arguments(group, layer, kwargs, error, name):
    args = {"input_size": 4, "output_size": 4, "group": group, **kwargs}
    if kwargs.get("group") == "tp":
        args["group"] = "tp"
    with pytest.raises(error, match=rf"{layer}: {name}\b"):
        getattr(tp, layer)(**args)


@pytest.mark.parametrize(
    "layer, kwargs, name",
    [
        ("ColumnParallelLinear", dict(gather_output="no"), "gather_output"),
        ("RowParallelLinear", dict(input_is_parallel=0), "input_is_parallel"),
        ("VocabParallelEmbedding", dict(num_embeddings=8.0), "num_embeddings"),
        ("VocabParallelEmbedding", dict(padding_idx=1.0), "padding_idx"),
        ("VocabParallelEmbedding", dict(dtype=torch.int32), "dtype"),
        ("ParallelSelfAttention", dict(num_heads=2.0), "num_heads"),
        ("ParallelSelfAttention", dict(causal="yes"), "causal"),
        ("ParallelSelfAttention", dict(output_layer_init_method=1), "output_layer_init_method"),
    ],
)
def test_other_constructor_arguments(group, layer, kwargs, name):
    base = {
        "ColumnParallelLinear": dict(input_size=4, output_size=4),
        "RowParallelLinear": dict(input_size=4, output_size=4),
        "VocabParallelEmbedding": dict(num_embeddings=8, embedding_dim=4),
        "ParallelSelfAttention": dict(hidden_size=8, num_heads=2),
    }[layer]
    with pytest.raises(TypeError, match=rf"{layer}: {name}\b"):
        getattr(tp, layer)(**{**base, **kwargs, "group": group})


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_attention_softmax_scale(group, scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        tp.ParallelSelfAttention(8, 2, softmax_scale=scale, group=group)


# --------------------------------------------------------------------------------------------
# Integer / complex / mismatched inputs to float layers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_float_layers_reject_non_float_inputs(group, dtype):
    torch.manual_seed(0)
    layers = [
        (tp.ColumnParallelLinear(4, 6, group=group), "input_", (3, 4)),
        (tp.RowParallelLinear(4, 6, group=group), "input_", (3, 4)),
        (tp.ParallelMLP(4, 8, group=group), "input_", (2, 3, 4)),
        (tp.ParallelSelfAttention(8, 2, group=group), "hidden_states", (5, 2, 8)),
    ]
    for layer, name, shape in layers:
        with pytest.raises(TypeError, match=rf"{name} must be a floating-point tensor"):
            layer(torch.ones(shape, dtype=dtype))


def test_float_layer_dtype_mismatch_and_autocast(group):
    torch.manual_seed(0)
    layer = tp.ColumnParallelLinear(4, 6, group=group)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="input_ has dtype torch.float64 but the layer's weight"):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: accepted
        y = layer(x.float())
    expected = x @ layer.weight.detach().double().t() + layer.bias.detach().double()
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------------------------
# Attention masks
# --------------------------------------------------------------------------------------------


def _attention_reference(attn, x, mask):
    """float64 attention from the layer's weights (independent of its forward)."""
    w_qkv, b_qkv = attn.linear_qkv.weight.double(), attn.linear_qkv.bias.double()
    w_o, b_o = attn.linear_proj.weight.double(), attn.linear_proj.bias.double()
    s, b, h = x.shape
    nh, d = attn.num_heads, attn.head_dim
    q, k, v = (x.double() @ w_qkv.t() + b_qkv).split(h, dim=-1)
    q, k, v = (t.reshape(s, b, nh, d).permute(1, 2, 0, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / d**0.5
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    ctx = scores.softmax(-1) @ v
    return ctx.permute(2, 0, 1, 3).reshape(s, b, h) @ w_o.t() + b_o


def test_attention_masks(group):
    torch.manual_seed(0)
    attn = tp.ParallelSelfAttention(8, 2, group=group, dtype=torch.float64)
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    bad = [
        (torch.ones(2, 1, 4, 4, dtype=torch.bool), ValueError, "shape"),  # wrong s
        (torch.ones(3, 1, 5, 5, dtype=torch.bool), ValueError, "shape"),  # wrong b
        (torch.ones(2, 3, 5, 5, dtype=torch.bool), ValueError, "shape"),  # 3 heads of 2
        (torch.ones(1, 2, 1, 5, 5, dtype=torch.bool), ValueError, "shape"),  # 5-D
        (torch.ones(5, dtype=torch.bool), ValueError, "shape"),  # 1-D
        (torch.ones(2, 1, 5, 5, dtype=torch.int64), TypeError, "bool"),  # 0/1 ints
        ([[True]], TypeError, "torch.Tensor"),
    ]
    for mask, error, what in bad:
        with pytest.raises(error, match=rf"attention_mask.*{what}"):
            attn(x, mask)
    # per-head and broadcast masks give the float64 reference
    per_head = torch.rand(2, 2, 5, 5) > 0.3
    per_head[..., 0] = True  # every row attends somewhere
    for mask in (per_head, per_head[:, :1], per_head[0, 0]):
        expected = _attention_reference(attn, x, mask.expand(2, 2, 5, 5))
        torch.testing.assert_close(attn(x, mask), expected, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------------------
# grouped_gemm out= and counts
# --------------------------------------------------------------------------------------------

LOOP_BACKENDS = ["reference", "sequential", "multistream"]


def _gg_reference(x, w, counts):
    out, row = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64), 0
    for e, m in enumerate(counts):
        out[row : row + m] = x[row : row + m].double() @ w[e].double()
        row += m
    return out


@pytest.mark.parametrize("backend", LOOP_BACKENDS + ["triton", "torch"])
def test_grouped_gemm_out_aliasing(backend):
    torch.manual_seed(0)
    x, w, counts = torch.randn(6, 4), torch.randn(2, 4, 4), torch.tensor([3, 3])
    cases = [
        (lambda: x.clone(), "x", lambda o: (o, w)),  # out is x
        (lambda: w.clone(), "w", lambda o: (x, o)),  # out is a view of w
    ]
    for make, name, args in cases:
        buf = make()
        out = buf if name == "x" else buf.view(-1, 4)[:6]
        xx, ww = args(buf)
        with pytest.raises(ValueError, match=rf"out shares memory with {name}"):
            grouped_gemm(xx, ww, counts, backend=backend, out=out)
    with pytest.raises(ValueError, match="out .* share memory .*expanded"):
        grouped_gemm(x, w, counts, backend=backend, out=torch.zeros(1, 4).expand(6, 4))
    leaf = torch.zeros(6, 4, requires_grad=True)
    with pytest.raises(ValueError, match="out is a leaf tensor that requires grad"):
        grouped_gemm(x, w, counts, backend=backend, out=leaf)
    with torch.no_grad():  # a leaf may be written without autograd, as optimizers do
        grouped_gemm(x, w, counts, backend=backend, out=leaf)
    torch.testing.assert_close(leaf.detach().double(), _gg_reference(x, w, [3, 3]))
    # a disjoint slice of the same storage is fine
    storage = torch.zeros(12, 4)
    got = grouped_gemm(x, w, counts, backend=backend, out=storage[6:])
    torch.testing.assert_close(got.double(), _gg_reference(x, w, [3, 3]))


@pytest.mark.parametrize("backend", LOOP_BACKENDS)
def test_grouped_gemm_meta_counts_on_host_backends(backend):
    x, w = torch.empty(6, 4, device="meta"), torch.empty(2, 4, 4, device="meta")
    with pytest.raises(ValueError, match="tokens_per_expert .* meta tensor"):
        grouped_gemm(x, w, torch.empty(2, dtype=torch.int64, device="meta"), backend=backend)
    y = grouped_gemm(x, w, torch.tensor([3, 3]), backend=backend)  # host counts: fine
    assert y.device.type == "meta" and y.shape == (6, 4)


@pytest.mark.parametrize("backend", LOOP_BACKENDS + ["triton", "torch"])
def test_grouped_gemm_non_contiguous_counts(backend):
    torch.manual_seed(0)
    x, w = torch.randn(7, 4), torch.randn(3, 4, 5)
    counts = torch.tensor([2, 9, 0, 9, 4, 9])[::2]  # [2, 0, 4], stride 2
    assert not counts.is_contiguous()
    got = grouped_gemm(x, w, counts, backend=backend)
    torch.testing.assert_close(got.double(), _gg_reference(x, w, [2, 0, 4]), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# Rank generator and python -m mtp.parallel at scale
# --------------------------------------------------------------------------------------------


def test_rank_generator_million_ranks_fast_and_right():
    start = time.process_time()
    dense, _ = mp.make_rank_generators(1_000_000, tp=8, pp=8)
    dp = dense.get_ranks("dp")
    tp_pp = dense.get_ranks_array("tp-pp")
    assert time.process_time() - start < 1.0
    assert len(dp) == 64 and len(dp[0]) == 15625
    # rank = tp_i + 8 * dp_i + 8 * 15625 * pp_i (tp fastest, pp slowest)
    for g in (0, 5, 63):
        tp_i, pp_i = g % 8, g // 8
        assert dp[g] == [tp_i + 8 * d + 125000 * pp_i for d in range(15625)]
    assert tp_pp.shape == (15625, 64)
    assert tp_pp[7].tolist() == [t + 8 * 7 + 125000 * p for p in range(8) for t in range(8)]


def test_rank_generator_sanity_limit():
    for make in (
        lambda: mp.RankGenerator(tp=8, ep=1, dp=10**8, pp=1, cp=1),
        lambda: mp.make_rank_generators(10**8, tp=8),
        lambda: mp.generate_masked_orthogonal_groups(10**8, [10**8], [True]),
    ):
        with pytest.raises(mp.ParallelConfigError, match="world_size 800000000|world_size 10+ "):
            make()


def test_parallel_cli_million_ranks(capsys):
    start = time.process_time()
    assert parallel_main(["--world-size", "1000000", "--tp", "8", "--pp", "8"]) == 0
    assert time.process_time() - start < 2.0
    out = capsys.readouterr().out
    assert "world 1000000 = tp 8 x cp 1 x dp 15625 x pp 8" in out
    assert "[999992,999993,999994,...,999999]" in out  # last tp group, summarised
    assert parallel_main(["--world-size", "100000000", "--tp", "8"]) == 2
    assert "exceeds the supported maximum" in capsys.readouterr().err


def test_parallel_cli_imports_no_torch():
    """``python -m mtp.parallel`` at a million ranks: no torch among the modules it imports."""
    _, imported = run_importing("-m", "mtp.parallel", "--world-size", "1000000", "--tp", "8",
                                "--pp", "8")
    assert "numpy" in imported and not any(m.split(".")[0] == "torch" for m in imported)


# --------------------------------------------------------------------------------------------
# Agreement helpers, the bench CLI
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [3, 0, None, "tp-cp-ep-dp-pp", "x" * 40, -2, 2.5, (1, 2)])
def test_value_field_prints_every_value(value):
    name, ints, fmt = agreement.value_field("arg", value)
    assert name == "arg" and all(isinstance(i, int) for i in ints)
    text = fmt(list(ints))
    assert text == (str(value) if isinstance(value, int) and value >= 0 else repr(value)[:28]
                    + ("..." if len(repr(value)) >= 28 else ""))  # fmt: skip
    assert agreement.value_field("arg", value)[1] == ints  # the same on every rank


def test_abort_mode_parsing(monkeypatch):
    for text, mode in (("1", "abort"), ("exit", "exit"), ("0", "off"), ("", "off")):
        monkeypatch.setenv(agreement.ABORT_ON_ERROR_ENV, text)
        agreement.set_abort_on_error(None)
        assert agreement.abort_on_error_mode() == mode
    monkeypatch.setenv(agreement.ABORT_ON_ERROR_ENV, "sometimes")
    agreement.set_abort_on_error(None)
    with pytest.raises(ValueError, match="MTP_ABORT_ON_ERROR"):
        agreement.abort_on_error_mode()
    monkeypatch.delenv(agreement.ABORT_ON_ERROR_ENV)
    agreement.set_abort_on_error(None)
    assert agreement.abort_on_error_mode() == "abort"


def test_bench_cli_bad_backends_and_out(tmp_path, capsys):
    from mtp.bench import cli, runner

    runner.load_modules()  # the imports are not what is timed
    start = time.perf_counter()
    out = ["--mode", "cpu", "--no-progress", "--out", str(tmp_path)]
    assert cli.main(["--backends", "nope", *out]) == 2
    err = capsys.readouterr().err
    assert "unknown backend(s) ['nope'] for --backends" in err and "'triton'" in err
    assert cli.main(["nope_op", *out]) == 2
    assert "unknown op(s) ['nope_op']" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["--mode", "cpu", "--out", str(blocker / "sub")]) == 2
    assert f"--out {blocker / 'sub'} is not a writable folder" in capsys.readouterr().err
    assert time.perf_counter() - start < 2.0
    assert list(tmp_path.iterdir()) == [blocker]  # nothing was run or written


def test_embedding_checks_ids_on_the_device_by_default(group):
    """Default arguments: the id range check runs on the device, 0 host syncs; "sync" gives
    the typed error with the values."""
    emb = tp.VocabParallelEmbedding(8, 4, group=group)
    with count_host_syncs() as syncs:
        out = emb(torch.tensor([[0, 7], [3, 1]]))
    assert syncs.count == 0, syncs.events
    assert out.shape == (2, 2, 4)
    with pytest.raises(RuntimeError, match=r"ids must be in \[0, 8\)"):
        emb(torch.tensor([8]))
    typed = tp.VocabParallelEmbedding(8, 4, group=group, validate="sync")
    with pytest.raises(tp.VocabRangeError, match=r"got values in \[-1, 2\]"):
        typed(torch.tensor([2, -1]))
    with pytest.raises(ValueError, match="validate"):
        tp.VocabParallelEmbedding(8, 4, group=group, validate="yes")
