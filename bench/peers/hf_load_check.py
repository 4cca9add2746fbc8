# Checks that transformers loads a model directory written by `spillway train --save DIR`
# (issue 12: "--save DIR writes the same layout, so from_pretrained loads the result"):
# no missing, unexpected or mismatched tensors, the config's sizes, rope and tying as
# spillway wrote them, and every loaded weight equal to the files' values.
#
#   spillway train --model llama-tiny --steps 2 --save /tmp/llama --backend cpu
#   python3 bench/peers/hf_load_check.py /tmp/llama          # prints "ok: ..." or fails
#
# Needs torch, transformers and safetensors (the device machine has them).
import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM


def main(d):
    raw = json.load(open(os.path.join(d, "config.json")))
    cfg = AutoConfig.from_pretrained(d)
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True, dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), f"{key}: {info[key]}"

    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(d, f)))
    state = model.state_dict()
    for name, t in tensors.items():
        assert name in state, f"{name} is not a parameter of {type(model).__name__}"
        assert torch.equal(state[name].float(), t.float()), f"{name}: the loaded values differ from the file's"

    if raw["model_type"] == "llama":
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "max_position_embeddings", "vocab_size", "rms_norm_eps",
                    "tie_word_embeddings"):
            assert getattr(cfg, key) == raw[key], f"{key}: transformers read {getattr(cfg, key)}, the file says {raw[key]}"
        rp = cfg.rope_parameters
        want = raw["rope_parameters"]
        for key, value in want.items():
            assert rp.get(key) == value, f"rope_parameters.{key}: transformers read {rp.get(key)}, the file says {value}"
        tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert tied == raw["tie_word_embeddings"], f"lm_head tied {tied}, config says {raw['tie_word_embeddings']}"
    else:
        for key in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
            assert getattr(cfg, key) == raw[key], f"{key}: transformers read {getattr(cfg, key)}, the file says {raw[key]}"
    print(f"ok: {d}: {type(model).__name__}, {len(tensors)} tensors in {len(files)} file(s) equal to the loaded "
          f"weights, config as written")


if __name__ == "__main__":
    main(sys.argv[1])
