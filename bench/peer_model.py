#!/usr/bin/env python3
"""One random Llama of the ~110M shape (dim 768, 12 layers, 12 heads, 4 KV
heads, FFN 2048, vocab 32000), written from the same arrays in the formats
the CPU peer comparison reads (bench/llama_cpp_peer.sh):

  OUT/f32, OUT/bf16, OUT/f16   Hugging Face directories (config.json,
                               model.safetensors) for pdserve;
  OUT/model-f32.gguf           the same weights for llama.cpp, written with
                               the gguf-py package of the llama.cpp source
                               tree given by --gguf_py (llama-quantize makes
                               the F16 and BF16 files from it).

The GGUF's Q and K rows are reordered for GGML's adjacent-pair RoPE (HF's
rotates element i with element i + head_dim / 2), so that both engines
compute the same function. Its vocabulary is synthetic (SentencePiece
shaped: <unk>, <s>, </s>, 256 byte tokens, then plain pieces): the
benchmarks feed token ids, never text.

  bench/peer_model.py OUT --gguf_py LLAMA_CPP_SRC/gguf-py [--seed 1]
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

SHAPE = dict(hidden=768, ffn=2048, layers=12, heads=12, kv_heads=4, vocab=32000,
             max_positions=2048, rope_theta=10000.0, rms_eps=1e-5)


def random_weights(seed):
    """HF tensor name -> fp32 array, normal(0, 0.02); norms are ones."""
    s = SHAPE
    rng = np.random.default_rng(seed)
    head_dim = s["hidden"] // s["heads"]

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(s["vocab"], s["hidden"])}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(s["hidden"], np.float32)
        w[p + "self_attn.q_proj.weight"] = normal(s["heads"] * head_dim, s["hidden"])
        w[p + "self_attn.k_proj.weight"] = normal(s["kv_heads"] * head_dim, s["hidden"])
        w[p + "self_attn.v_proj.weight"] = normal(s["kv_heads"] * head_dim, s["hidden"])
        w[p + "self_attn.o_proj.weight"] = normal(s["hidden"], s["heads"] * head_dim)
        w[p + "post_attention_layernorm.weight"] = np.ones(s["hidden"], np.float32)
        w[p + "mlp.gate_proj.weight"] = normal(s["ffn"], s["hidden"])
        w[p + "mlp.up_proj.weight"] = normal(s["ffn"], s["hidden"])
        w[p + "mlp.down_proj.weight"] = normal(s["hidden"], s["ffn"])
    w["model.norm.weight"] = np.ones(s["hidden"], np.float32)
    w["lm_head.weight"] = normal(s["vocab"], s["hidden"])
    return w


def to_bf16_bits(a):
    """fp32 -> bf16 bit patterns (uint16), rounding to nearest even."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def write_safetensors(path, weights, dtype):
    """The safetensors format: 8-byte little-endian header size, a JSON
    header of name -> {dtype, shape, data_offsets}, then the data."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in weights.items():
        if dtype == "F32":
            data = a.astype("<f4").tobytes()
        elif dtype == "F16":
            data = a.astype("<f2").tobytes()
        else:
            data = to_bf16_bits(a).astype("<u2").tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def hf_config(torch_dtype):
    s = SHAPE
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": s["hidden"], "intermediate_size": s["ffn"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab"],
        "max_position_embeddings": s["max_positions"], "rope_theta": s["rope_theta"],
        "rms_norm_eps": s["rms_eps"], "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": torch_dtype,
    }


def adjacent_pair_rows(w, heads):
    """Rows of a Q or K projection reordered from HF's half rotation to
    GGML's adjacent pairs: within each head, row 2i is HF row i and row
    2i + 1 is HF row i + head_dim / 2."""
    rows, cols = w.shape
    head_dim = rows // heads
    return w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(path, weights, gguf):
    s = SHAPE
    head_dim = s["hidden"] // s["heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("pdserve peer 110M (random weights)")
    writer.add_context_length(s["max_positions"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(s["rms_eps"])
    writer.add_file_type(0)  # All F32.
    # A SentencePiece-shaped vocabulary.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, BYTE.
    while len(tokens) < s["vocab"]:
        tokens.append(f"\u2581t{len(tokens)}")
        types.append(1)  # NORMAL.
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(s["vocab"] - 259)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(s["layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", weights[p + "input_layernorm.weight"])
        writer.add_tensor(b + "attn_q.weight",
                          adjacent_pair_rows(weights[p + "self_attn.q_proj.weight"], s["heads"]))
        writer.add_tensor(b + "attn_k.weight",
                          adjacent_pair_rows(weights[p + "self_attn.k_proj.weight"], s["kv_heads"]))
        writer.add_tensor(b + "attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        writer.add_tensor(b + "attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        writer.add_tensor(b + "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        writer.add_tensor(b + "ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        writer.add_tensor(b + "ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        writer.add_tensor(b + "ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gguf_py", type=Path, required=True,
                    help="the gguf-py directory of a llama.cpp source tree")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if not (args.gguf_py / "gguf" / "__init__.py").exists():
        sys.exit(f"peer_model.py: {args.gguf_py} has no gguf package; give LLAMA_CPP_SRC/gguf-py")
    sys.path.insert(0, str(args.gguf_py))
    import gguf  # noqa: E402  (from the llama.cpp tree, at run time)

    weights = random_weights(args.seed)
    for name, dtype, torch_dtype in (("f32", "F32", "float32"), ("bf16", "BF16", "bfloat16"),
                                     ("f16", "F16", "float16")):
        d = args.out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(hf_config(torch_dtype), indent=2))
        write_safetensors(d / "model.safetensors", weights, dtype)
        print(f"peer_model.py: wrote {d}", file=sys.stderr)
    write_gguf(args.out / "model-f32.gguf", weights, gguf)
    print(f"peer_model.py: wrote {args.out / 'model-f32.gguf'}", file=sys.stderr)


if __name__ == "__main__":
    main()
