"""Device probe: cost of the MoE combine (weighted sum over the k routed copies) and the fp32
router, fwd+bwd, at the dsv3 layer shape. Candidates for moe.py's combine; prints ms."""
import torch

from benchmarks.timing import bench_us

t, k, d, e = 65536, 2, 7168, 8
dev = "cuda"
y = torch.randn(t, k, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.rand(t, k, device=dev, dtype=torch.float32).softmax(-1).requires_grad_()
g = torch.randn(t, d, device=dev, dtype=torch.bfloat16)


def einsum():
    return torch.einsum("tkd,tk->td", y, w.to(torch.bfloat16))


def bmm():
    return torch.bmm(w.to(torch.bfloat16).unsqueeze(1), y).squeeze(1)


def mulsum():
    return (y * w.to(torch.bfloat16).unsqueeze(-1)).sum(1)


def mulsum32():
    return (y.float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)


for name, fn in [("einsum", einsum), ("bmm", bmm), ("mul+sum bf16", mulsum),
                 ("mul+sum fp32", mulsum32)]:
    ref = torch.einsum("tkd,tk->td", y.float(), w).to(torch.bfloat16)
    out = fn()
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    fwd = bench_us(fn, use_graph=False, reps=5, rounds=3)

    def fb(fn=fn):
        y.grad = None
        w.grad = None
        fn().backward(g)

    both = bench_us(fb, use_graph=False, reps=5, rounds=3)
    print(f"{name:14s} fwd {fwd/1e3:7.2f} ms  fwd+bwd {both/1e3:7.2f} ms  rel err {err:.1e}",
          flush=True)

x = torch.randn(t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
wr = torch.randn(e, d, device=dev, dtype=torch.float32, requires_grad=True)


def router32():
    return torch.nn.functional.linear(x.float(), wr)


def router_mm():
    return torch.mm(x, wr.to(torch.bfloat16).t(), out_dtype=torch.float32)


for name, fn in [("router fp32", router32), ("router bf16 in, fp32 out", router_mm)]:
    try:
        fwd = bench_us(fn, use_graph=False, reps=5, rounds=3)

        def fb(fn=fn):
            x.grad = None
            wr.grad = None
            fn().backward(torch.ones(t, e, device=dev))

        both = bench_us(fb, use_graph=False, reps=5, rounds=3)
        print(f"{name:24s} fwd {fwd/1e3:7.2f} ms  fwd+bwd {both/1e3:7.2f} ms", flush=True)
    except Exception as err:  # noqa: BLE001
        print(name, "failed:", repr(err)[:200])
