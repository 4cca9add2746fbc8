# Reference outputs from the libraries users compare with, for the tests of
# issue 12 (Llama models, Hugging Face directories, tokenizers). Run on the device
# machine (it has torch, transformers and tokenizers); the small files it writes
# are kept in tests/data/reference/ and read by the C++ tests.
#
# usage: python3 bench/peers/make_reference_data.py OUT_DIR [--corpus ../shared/data/tinyshakespeare.txt]
#
# Writes:
#   tok-gpt2/tokenizer.json      byte-level BPE (GPT-2 pre-tokenizer), vocab 600
#   tok-llama3/tokenizer.json    byte-level BPE with Llama 3's split regex, vocab 600
#   tokenizer-cases.json         {"texts": [...], "gpt2": [[ids]...], "llama3": [[ids]...]}
#   llama-<name>/                save_pretrained of a small random LlamaForCausalLM
#                                (fp32 safetensors, config.json) plus reference.safetensors:
#                                "tokens" [B,T+1] int32, "loss" [] fp32, "grad.<param name>"
#   gpt2-4x32/                   a transformers GPT-2 with 4 heads of 32, same files
import argparse, json, os, sys

import torch


def tokenizer_data(out, corpus_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, Regex
    text = open(corpus_path, encoding="utf-8").read()
    extra = ["naïve café — “quoted” 日本語のテキスト 😀👍🏽 1234567 3.14159 x²", "  leading spaces\n\n\ttabs\r\n"]
    texts = [
        "Hello world",
        "First Citizen:\nBefore we proceed any further, hear me speak.",
        "I'm you're we'll they'd it's DON'T",
        "numbers 1 12 123 1234 12345 2026-12-04",
        "naïve café — “quoted” façade",
        "日本語のテキスト and 中文",
        "emoji 😀👍🏽🇩🇪 end",
        "   three spaces, then\ttab\nnewline\n\n\nthree newlines ",
        "mixed123abc ABC_def __init__ a.b.c",
        "",
        " ",
        "ÿþ\u0100\u07ff\uffff",
    ]
    result = {"texts": texts}
    llama3_regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    for name in ["gpt2", "llama3"]:
        tok = Tokenizer(models.BPE())
        if name == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(llama3_regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|endoftext|>"], show_progress=False)
        tok.train_from_iterator([text] + extra * 20, trainer=trainer)
        d = os.path.join(out, "tok-" + name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        ids = [tok.encode(t).ids for t in texts]
        for t, i in zip(texts, ids):
            assert tok.decode(i) == t, (name, t)
        result[name] = ids
        result[name + "_vocab"] = tok.get_vocab_size()
    json.dump(result, open(os.path.join(out, "tokenizer-cases.json"), "w", encoding="utf-8"), ensure_ascii=False, indent=1)


def model_reference(model, d, vocab, B=2, T=16, seed=1234):
    from safetensors.torch import save_file
    model = model.float()
    model.save_pretrained(d, safe_serialization=True)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, T + 1), generator=g)
    model.train()
    out = model(input_ids=tokens[:, :-1], labels=None)
    logits = out.logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    tensors = {"tokens": tokens.to(torch.int32).contiguous(), "loss": loss.detach().reshape([]).contiguous()}
    for n, p in model.named_parameters():
        tensors["grad." + n] = p.grad.detach().contiguous()
    save_file(tensors, os.path.join(d, "reference.safetensors"))
    return float(loss)


def models_data(out):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, GPT2Config, GPT2LMHeadModel
    summary = {"transformers": transformers.__version__, "torch": torch.__version__}
    torch.manual_seed(0)
    # A plain multi-head Llama: rope theta 10000, untied head.
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    summary["llama-mha"] = model_reference(LlamaForCausalLM(cfg), os.path.join(out, "llama-mha"), 300)
    # GQA with llama3 rope scaling, tied embeddings, odd vocabulary.
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    m = LlamaForCausalLM(cfg)
    summary["llama-gqa"] = model_reference(m, os.path.join(out, "llama-gqa"), 259)
    # The same GQA model again, sharded (several model-0000k-of-0000n files and the index).
    m.save_pretrained(os.path.join(out, "llama-gqa-sharded"), safe_serialization=True, max_shard_size="60KB")
    # GPT-2 with 4 heads of 32 (the head count cannot be guessed from the width).
    torch.manual_seed(2)
    cfg = GPT2Config(vocab_size=257, n_positions=32, n_embd=128, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    summary["gpt2-4x32"] = model_reference(GPT2LMHeadModel(cfg), os.path.join(out, "gpt2-4x32"), 257)
    json.dump(summary, open(os.path.join(out, "models.json"), "w"), indent=1)
    print(json.dumps(summary))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--corpus", default="../shared/data/tinyshakespeare.txt")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tokenizer_data(a.out, a.corpus)
    models_data(a.out)
    for root, _, files in os.walk(a.out):
        for f in files:
            p = os.path.join(root, f)
            print(f"{os.path.getsize(p):>9} {p}")


if __name__ == "__main__":
    sys.exit(main())
