#!/usr/bin/env python3
"""PyTorch's causal attention (SDPA) timed at the shapes `spillway bench ops` uses.

The peer for the attention rows of `spillway bench ops` (issue 14): the same
B, T, heads and head size, bf16, causal, input laid out as Spillway's fused qkv
[B, T, 3, NH, HD] and viewed as [B, NH, T, HD] (what a GPT block hands SDPA).

    python3 bench/peers/torch_attention.py 16:1024:12:64 8:1024:25:64 8:1024:32:80

Each shape is B:T:NH:HD. Forward and backward are timed with CUDA events,
median of ROUNDS rounds of REPS calls (env, default 7 and 10), after a warm-up;
the backward is timed alone (torch.autograd.grad on a retained graph). Prints
one line per shape and backend (SDPA's own choice, then cuDNN, flash and
memory-efficient forced) and the TFLOP/s the causal
FLOP count gives (forward 2·2·B·NH·T²·HD/2, backward 2.5× the forward).
"""
import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, rounds, reps):
    times = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    times.sort()
    return times[len(times) // 2]


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: torch_attention.py B:T:NH:HD [B:T:NH:HD ...]")
    rounds = int(os.environ.get("ROUNDS", "7"))
    reps = int(os.environ.get("REPS", "10"))
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, rounds {rounds} x reps {reps}")
    for spec in sys.argv[1:]:
        try:
            B, T, NH, HD = (int(x) for x in spec.split(":"))
        except ValueError:
            sys.exit(f"shape '{spec}': expected B:T:NH:HD, four integers")
        qkv = torch.randn(B, T, 3, NH, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        flops = 2.0 * 2.0 * B * NH * T * T * HD / 2.0
        # SDPA's own choice first, then each backend forced (those that refuse the shape are skipped).
        for name, forced in (("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                             ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with (sdpa_kernel([forced]) if forced is not None else contextlib.nullcontext()):
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    dy = torch.randn_like(y)
                    fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), rounds, reps)
                    bwd = median_ms(lambda: torch.autograd.grad(y, qkv, dy, retain_graph=True), rounds, reps)
            except RuntimeError as e:
                print(f"sdpa {spec} {name}: not available ({str(e).splitlines()[0][:80]})")
                continue
            print(f"sdpa {spec} {name}: fwd {fwd:.4f} ms ({flops / fwd / 1e9:.1f} TFLOP/s), "
                  f"bwd {bwd:.4f} ms ({2.5 * flops / bwd / 1e9:.1f} TFLOP/s)")

if __name__ == "__main__":
    main()
