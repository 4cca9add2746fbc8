# One GPT-2 training step in Spillway against the same step in PyTorch, from the
# same weights and tokens: the forward loss and every gradient (issue 5).
#
#   python3 torch_gradient_check.py prepare DIR [--T 1024]       # DIR/init.safetensors, DIR/gc_{train,val}.bin
#   spillway train --backend cuda --data DIR/gc_train.bin --load DIR/init.safetensors --steps 1 \
#       --batch 4 --context 1024 --eval-every 0 --metrics DIR/m.jsonl --save-grads DIR/grads.safetensors
#   python3 torch_gradient_check.py compare DIR --B 4 [--T 1024]
#
# And 20 steps of training from there (the loss curve):
#   spillway train ... --steps 20 --metrics DIR/curve.jsonl   (same data, weights, batch)
#   python3 torch_gradient_check.py curve DIR --B 4 [--T 1024]
# PyTorch trains with the same AdamW (β 0.9/0.95, ε 1e-8, weight decay 0.1 on
# matrices and embeddings), clipping at norm 1 and Spillway's own per-step learning
# rates (read from curve.jsonl), fp32 master weights under bf16 autocast.
#
# The token files hold exactly T+1 tokens, so every row of every batch is tokens
# [0, T) with targets [1, T+1) whatever the loader's seed. The PyTorch model is
# written out functionally from the safetensors tensors (Hugging Face GPT-2 names,
# Conv1D weights [in, out]), with bf16 autocast like the peer in torch_gpt.py.
import argparse, json, math, os, struct, sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

V, C, L, NH, CTX = 50257, 768, 12, 12, 1024


def prepare(d, T):
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(1234)
    w = {"transformer.wte.weight": torch.randn(V, C, generator=g) * 0.02,
         "transformer.wpe.weight": torch.randn(CTX, C, generator=g) * 0.02,
         "transformer.ln_f.weight": torch.ones(C), "transformer.ln_f.bias": torch.zeros(C)}
    for i in range(L):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            w[p + ln + ".weight"], w[p + ln + ".bias"] = torch.ones(C), torch.zeros(C)
        for name, (a, b) in {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C),
                             "mlp.c_fc": (C, 4 * C), "mlp.c_proj": (4 * C, C)}.items():
            std = 0.02 / math.sqrt(2 * L) if name.endswith("c_proj") else 0.02
            w[p + name + ".weight"] = torch.randn(a, b, generator=g) * std  # Conv1D [in, out]
            w[p + name + ".bias"] = torch.zeros(b)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(d, "init.safetensors"),
              metadata={"n_head": str(NH)})
    tokens = torch.randint(0, V, (T + 1,), generator=g).tolist()
    for split in ("train", "val"):
        with open(os.path.join(d, f"gc_{split}.bin"), "wb") as f:
            header = [0] * 256
            header[0], header[1], header[2] = 20240520, 1, len(tokens)
            f.write(struct.pack("<256i", *header))
            f.write(struct.pack(f"<{len(tokens)}H", *tokens))
    print(f"wrote {d}/init.safetensors and {d}/gc_train.bin ({len(tokens)} tokens)")


def read_tokens(path):
    with open(path, "rb") as f:
        header = struct.unpack("<256i", f.read(1024))
        return list(struct.unpack(f"<{header[2]}H", f.read(2 * header[2])))


def forward(w, idx, tgt):
    B, T = idx.shape
    x = w["transformer.wte.weight"][idx] + w["transformer.wpe.weight"][:T]
    for i in range(L):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, (C,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], 1e-5)
        q, k, v = (h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]).split(C, dim=2)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = F.layer_norm(x, (C,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], 1e-5)
        h = F.gelu(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"], approximate="tanh")
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (C,), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], 1e-5)
    logits = x @ w["transformer.wte.weight"].t()
    return F.cross_entropy(logits.float().view(-1, V), tgt.view(-1))


def compare(d, B, T):
    w = {k: v.cuda().float().requires_grad_(True) for k, v in load_file(os.path.join(d, "init.safetensors")).items()}
    tokens = torch.tensor(read_tokens(os.path.join(d, "gc_train.bin")), device="cuda")
    idx = tokens[:T].unsqueeze(0).repeat(B, 1)
    tgt = tokens[1:T + 1].unsqueeze(0).repeat(B, 1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = forward(w, idx, tgt)
    loss.backward()
    ours_loss = json.loads(open(os.path.join(d, "m.jsonl")).readline())["loss"]
    ours = load_file(os.path.join(d, "grads.safetensors"))
    loss_rel = abs(ours_loss - loss.item()) / abs(loss.item())
    worst, worst_name = 0.0, ""
    for name, t in w.items():
        a, b = ours[name].cuda().float(), t.grad.float()
        rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        print(f"{name:45s} rel err {rel:.3e}")
        if rel > worst:
            worst, worst_name = rel, name
    ok = loss_rel < 1e-2 and worst < 5e-2
    print(json.dumps({"loss_spillway": ours_loss, "loss_pytorch": loss.item(), "loss_rel_err": loss_rel,
                      "worst_grad_rel_err": worst, "worst_grad": worst_name, "pass": ok}))
    return 0 if ok else 1


def curve(d, B, T):
    w = {k: v.cuda().float().requires_grad_(True) for k, v in load_file(os.path.join(d, "init.safetensors")).items()}
    tokens = torch.tensor(read_tokens(os.path.join(d, "gc_train.bin")), device="cuda")
    idx = tokens[:T].unsqueeze(0).repeat(B, 1)
    tgt = tokens[1:T + 1].unsqueeze(0).repeat(B, 1)
    ours = [json.loads(line) for line in open(os.path.join(d, "curve.jsonl"))]
    decay = [t for k, t in w.items() if t.dim() >= 2]
    plain = [t for k, t in w.items() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    worst = 0.0
    for m in ours:
        for g in opt.param_groups:
            g["lr"] = m["lr"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(w, idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rel = abs(m["loss"] - loss.item()) / abs(loss.item())
        worst = max(worst, rel)
        print(f"step {m['step']:3d}  lr {m['lr']:.3e}  spillway {m['loss']:.5f}  pytorch {loss.item():.5f}  rel {rel:.2e}")
    ok = worst < 2e-2
    print(json.dumps({"steps": len(ours), "first_loss": ours[0]["loss"], "last_loss_spillway": ours[-1]["loss"],
                      "last_loss_pytorch": loss.item(), "worst_rel_diff": worst, "pass": ok}))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["prepare", "compare", "curve"])
    ap.add_argument("dir")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=1024)
    a = ap.parse_args()
    if a.mode == "prepare":
        prepare(a.dir, a.T)
        return 0
    return compare(a.dir, a.B, a.T) if a.mode == "compare" else curve(a.dir, a.B, a.T)


if __name__ == "__main__":
    sys.exit(main())
