# Peer baseline: Llama training in PyTorch (transformers' LlamaForCausalLM) on the
# device GPU: fp32 weights, bf16 autocast, SDPA attention, fused AdamW. The shapes are
# Spillway's presets (src/model/model.cpp), from the published config.json files.
# Prints one JSON line per config.
# usage: python3 torch_llama.py CONFIG...   where CONFIG = size:strategy:microbatch[:capGiB]
#   size: llama-3.2-1b | llama-3.2-3b | llama-3.1-8b;  strategy: full | fsdp2_offload
import json, os, sys, time, traceback
import torch

T = int(os.environ.get("SEQ", "1024"))
LLAMA3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
SIZES = {  # layers, hidden, heads, kv heads, intermediate, tied, rope factor
    "llama-3.2-1b": (16, 2048, 32, 8, 8192, True, 32.0),
    "llama-3.2-3b": (28, 3072, 24, 8, 8192, True, 32.0),
    "llama-3.1-8b": (32, 4096, 32, 8, 14336, False, 8.0),
}
V = 128256


def make_config(size):
    from transformers import LlamaConfig
    L, d, h, kv, inter, tied, factor = SIZES[size]
    rope = dict(LLAMA3, factor=factor, rope_theta=500000.0)
    return LlamaConfig(vocab_size=V, hidden_size=d, intermediate_size=inter, num_hidden_layers=L,
                       num_attention_heads=h, num_key_value_heads=kv, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, tie_word_embeddings=tied, rope_parameters=rope,
                       attn_implementation="sdpa", use_cache=False)


def run(cfg):
    from transformers import LlamaForCausalLM
    parts = cfg.split(":")
    size, strat, mb = parts[0], parts[1], int(parts[2])
    cap = float(parts[3]) if len(parts) > 3 else None
    L, d = SIZES[size][0], SIZES[size][1]
    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    if cap:
        torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
    torch.cuda.reset_peak_memory_stats()
    res = dict(cfg=cfg, size=size, strategy=strat, microbatch=mb, cap_gib=cap, seq=T)
    t0 = time.time()
    conf = make_config(size)
    if strat == "full":
        with torch.device(dev):
            model = LlamaForCausalLM(conf)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif strat == "fsdp2_offload":
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        if not dist.is_initialized():
            dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        conf.gradient_checkpointing = True
        model = LlamaForCausalLM(conf)
        model.gradient_checkpointing_enable()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy(pin_memory=True)
        for b in model.model.layers:
            fully_shard(b, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    else:
        raise ValueError(strat)
    res["params"] = sum(p.numel() for p in model.parameters())
    res["init_s"] = round(time.time() - t0, 1)
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(0, V, (mb, T), generator=g).to(dev)

    def step():
        if strat == "fsdp2_offload":
            loss = model(input_ids=idx, labels=idx).loss
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    nwarm, nmeas = 2, int(os.environ.get("NMEAS", "5"))
    for _ in range(nwarm):
        step()
    torch.cuda.synchronize()
    t1 = time.time()
    for _ in range(nmeas):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.time() - t1) / nmeas
    tok = mb * T
    res.update(step_s=round(dt, 4), tok_s=round(tok / dt),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), loss=round(loss.item(), 4))
    return res


if __name__ == "__main__":
    for cfg in sys.argv[1:]:
        try:
            r = run(cfg)
        except Exception as e:
            r = dict(cfg=cfg, error=type(e).__name__ + ": " + str(e)[:300])
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
