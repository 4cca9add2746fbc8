# Peer figures for `spillway bench ops`: the same ops at the same shape in PyTorch
# (bf16, cuBLAS, SDPA flash attention, fused AdamW), timed with CUDA events, plus
# one whole gpt2-124m training step of torch_gpt.py's model (autocast bf16).
# usage: python3 torch_reference_step.py [--B 16] [--T 1024] [--C 768] [--NH 12] [--V 50304] [--L 12] [--no-step]
# Prints one row per op (the names `spillway bench ops` prints) and a JSON line last.
import argparse, json, os, statistics, sys, time

import torch
import torch.nn.functional as F


def timer(fn, reps=10, rounds=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(B=16, T=1024, C=768, NH=12, V=50304, L=12).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--no-step", action="store_true")
    o = ap.parse_args()
    B, T, C, NH, V, L = o.B, o.T, o.C, o.NH, o.V, o.L
    N, HD = B * T, C // NH
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows, res = [], {}

    def row(name, ms, flops=0.0, nbytes=0.0):
        res[name] = round(ms, 4)
        line = f"{name:<34} {ms:10.3f} ms"
        if flops:
            line += f"  {flops / ms / 1e9:8.1f} TFLOP/s"
        if nbytes:
            line += f"  {nbytes / ms / 1e6:8.1f} GB/s"
        print(line, flush=True)

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; B={B} T={T} C={C} NH={NH} V={V}")
    x = torch.randn(N, C, device=dev, dtype=bf)
    for name, cin, cout, bias in [("qkv", C, 3 * C, True), ("attn proj", C, C, True), ("fc", C, 4 * C, True),
                                  ("fc proj", 4 * C, C, True), ("lm head", C, V, False)]:
        inp = torch.randn(N, cin, device=dev, dtype=bf)
        w = torch.randn(cout, cin, device=dev, dtype=bf) * 0.02
        b = torch.randn(cout, device=dev, dtype=bf) if bias else None
        dy = torch.randn(N, cout, device=dev, dtype=bf)
        dw = torch.zeros_like(w)
        flops = 2.0 * N * cin * cout
        row(f"matmul fwd {name}", timer(lambda: F.linear(inp, w, b)), flops)

        def bwd():
            torch.matmul(dy, w)
            dw.add_(dy.t() @ inp)
            if b is not None:
                dy.sum(0)
        row(f"matmul bwd {name}", timer(bwd), 2 * flops)
        del inp, w, b, dy, dw

    q, k, v = (torch.randn(B, NH, T, HD, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
    attn_flops = 4.0 * B * NH * HD * T * (T + 1) / 2
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    do = torch.randn_like(out)
    row("attention fwd", timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), attn_flops)
    row("attention bwd (2.5x fwd flops)",
        timer(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), 2.5 * attn_flops)
    del q, k, v, out, do

    xr = torch.randn(N, C, device=dev, dtype=bf, requires_grad=True)
    lw = torch.randn(C, device=dev, dtype=bf, requires_grad=True)
    lb = torch.randn(C, device=dev, dtype=bf, requires_grad=True)
    y = F.layer_norm(xr, (C,), lw, lb)
    dy = torch.randn_like(y)
    row("layernorm fwd", timer(lambda: F.layer_norm(xr, (C,), lw, lb)), 0, N * C * 4)
    row("layernorm bwd", timer(lambda: torch.autograd.grad(y, (xr, lw, lb), dy, retain_graph=True)), 0, N * C * 8)
    h = torch.randn(N, 4 * C, device=dev, dtype=bf, requires_grad=True)
    g = F.gelu(h, approximate="tanh")
    dg = torch.randn_like(g)
    row("gelu fwd", timer(lambda: F.gelu(h, approximate="tanh")), 0, N * 4 * C * 4)
    row("gelu bwd", timer(lambda: torch.autograd.grad(g, h, dg, retain_graph=True)), 0, N * 4 * C * 6)
    row("residual", timer(lambda: x + x), 0, N * C * 6)
    del xr, y, dy, h, g, dg

    logits = (torch.randn(N, V, device=dev, dtype=bf) * 4).requires_grad_(True)
    tgt = torch.randint(0, V, (N,), device=dev)
    row("crossentropy fwd", timer(lambda: F.cross_entropy(logits.float(), tgt)), 0, N * V * 2)

    def ce_fb():
        loss = F.cross_entropy(logits.float(), tgt)
        torch.autograd.grad(loss, logits)
    row("crossentropy fwd+bwd (fused)", timer(ce_fb), 0, N * V * 6)
    del logits

    P = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    p = torch.nn.Parameter(torch.randn(P, device=dev) * 0.02)
    p.grad = torch.randn(P, device=dev) * 1e-3
    opt = torch.optim.AdamW([p], lr=6e-4, weight_decay=0.1, fused=True)
    row("squared_norm (all params)", timer(lambda: torch.linalg.vector_norm(p.grad)), 0, P * 4)
    row("adamw (all params, fp32 params)", timer(opt.step), 0, P * 28)
    del p, opt

    if not o.no_step:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from torch_gpt import GPT
        model = GPT(L, C, NH).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        idx = torch.randint(0, V, (B, T), device=dev)
        tg = torch.randint(0, V, (B, T), device=dev)

        def step():
            with torch.autocast("cuda", dtype=bf):
                loss = model(idx, tg)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        ms = timer(step, reps=3, rounds=3)
        row("training step (torch, eager)", ms)
        res["step_tok_s"] = round(N / (ms * 1e-3))
    print(json.dumps(dict(peer="torch", torch=torch.__version__, B=B, T=T, C=C, NH=NH, V=V, ms=res)))


if __name__ == "__main__":
    main()
