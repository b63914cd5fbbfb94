"""Bytes / floor table for permute/unpermute/bias-act (not a test; run by hand):

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/_traffic_table_permute_bias_act.py

Bytes per program / the op's byte floor (mtp.testing.traffic), Triton launches, aten ops with
device work, host syncs; default arguments (validate on), fp32 permute T=256 k=4 E=16 H=512,
bias-act 512x1024.
"""
import os, sys, json
os.environ["TRITON_INTERPRET"] = "1"; os.environ["MTP_POISON_OUTPUTS"] = "0"
import torch
try:
    from mtp.testing.traffic import count_traffic
except ImportError:
    sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "mtp")); from testing_traffic import count_traffic
import mtp.ops as ops
torch.manual_seed(0)
rows = []
def rec(name, t, floor):
    rows.append((name, round(t.ratio(floor), 3), t.num_launches, t.num_aten_ops, t.num_host_syncs))
T, E, k, H = 256, 16, 4, 512
s = 4; N = T * k
logits = torch.randn(T, E); top = logits.topk(k, 1)
rm = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top.indices, True)
probs = torch.zeros(T, E).scatter_(1, top.indices, top.values.softmax(1))
x = torch.randn(T, H, requires_grad=True)
pf = T*H*s + T*E + N*H*s + 8*N
with count_traffic() as t:
    perm, pp, rid = ops.permute(x, rm, None, N, backend="triton")
rec("permute fwd (no probs)", t, pf)
p = probs.clone().requires_grad_()
with count_traffic() as t:
    perm, pp, rid = ops.permute(x, rm, p, N, backend="triton")
rec("permute fwd (probs)", t, pf + T*E*s + N*s)
g = torch.randn(N, H)
with count_traffic() as t:
    torch.autograd.backward((perm,), (g,))
rec("permute bwd", t, N*H*s + 8*N + T*H*s)
y = torch.randn(N, H, requires_grad=True)
uf = N*H*s + 8*N + T*E + N*s + T*H*s
with count_traffic() as t:
    out = ops.unpermute(y, rid, (T, H), p, rm, backend="triton")
rec("unpermute fwd (probs)", t, uf)
go = torch.randn(T, H)
with count_traffic() as t:
    out.backward(go)
rec("unpermute bwd", t, T*H*s + N*H*s + 8*N + T*E + N*s + N*H*s + T*E*s)
with count_traffic() as t:
    out2 = ops.unpermute(perm.detach(), rid, (T, H), backend="triton")
rec("unpermute fwd (no probs)", t, N*H*s + 8*N + T*H*s)
M, Hb = 512, 1024
for dt in (torch.float32, torch.bfloat16):
    sz = torch.empty((), dtype=dt).element_size()
    xb = torch.randn(M, Hb, dtype=dt, requires_grad=True); b = torch.randn(Hb, dtype=dt, requires_grad=True)
    with count_traffic() as t:
        yb = ops.bias_gelu(xb, b, "tanh", backend="triton")
    rec(f"bias_gelu fwd {dt}", t, 2*M*Hb*sz + Hb*sz)
    dyb = torch.randn(M, Hb, dtype=dt)
    with count_traffic() as t:
        yb.backward(dyb)
    rec(f"bias_gelu bwd {dt}", t, 3*M*Hb*sz + 2*Hb*sz)
    xs = torch.randn(M, 2*Hb, dtype=dt, requires_grad=True); bs = torch.randn(2*Hb, dtype=dt, requires_grad=True)
    with count_traffic() as t:
        ys = ops.bias_swiglu(xs, bs, backend="triton")
    rec(f"bias_swiglu fwd {dt}", t, 3*M*Hb*sz + 2*Hb*sz)
    dys = torch.randn(M, Hb, dtype=dt)
    with count_traffic() as t:
        ys.backward(dys)
    rec(f"bias_swiglu bwd {dt}", t, 5*M*Hb*sz + 4*Hb*sz)
print(f"{'op':28s} {'bytes/floor':>11s} {'launches':>8s} {'aten':>5s} {'syncs':>5s}")
for r in rows: print(f"{r[0]:28s} {r[1]:11.3f} {r[2]:8d} {r[3]:5d} {r[4]:5d}")
