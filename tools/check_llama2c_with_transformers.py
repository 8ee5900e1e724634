#!/usr/bin/env python3
"""Checks the llama2.c converter against Hugging Face transformers, which we
did not write: loads the converted stories260K directory with
LlamaForCausalLM and the converted tokenizer with AutoTokenizer (which reads
tokenizer_config.json too) and with PreTrainedTokenizerFast (tokenizer.json
alone), greedy-decodes from BOS and prints the text (it must begin with the
published "Once upon a time, there was a little girl named Lily. ..."), and
checks that both tokenizers encode the published text to BOS followed by the
very ids the model generated for it (a wrong merge order would split some
word differently).

  build/client/pdctl convert-llama2c ../shared/models/stories260K/stories260K.bin \
      ../shared/models/stories260K/tok512.bin /tmp/stories260K
  python3 tools/check_llama2c_with_transformers.py /tmp/stories260K \
      [--write tests/fixtures/stories260k_greedy.json]
"""
import argparse
import json

import torch
import transformers

PUBLISHED = ("Once upon a time, there was a little girl named Lily. "
             "She loved to play outside in the park.")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--write", help="save the greedy ids as a test fixture")
    args = ap.parse_args()

    model = transformers.LlamaForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32)
    model.eval()
    auto_tok = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{args.model_dir}/tokenizer.json")
    prompt = [1]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    print(text)
    assert text.startswith(PUBLISHED), "converter output differs from the published text"
    assert auto_tok.decode(new, skip_special_tokens=True) == text
    for t in (auto_tok, tok):
        enc = t(PUBLISHED)["input_ids"]
        assert enc == prompt + new[:len(enc) - 1], (type(t).__name__, enc, new[:len(enc)])
        assert t.decode(enc, skip_special_tokens=True) == PUBLISHED
    print(f"encode(published) = {enc[:12]} ... ({len(enc)} ids, BOS + the generated ids)")
    if args.write:
        with open(args.write, "w") as f:
            json.dump({"transformers_version": transformers.__version__,
                       "torch_version": torch.__version__,
                       "prompt_ids": prompt, "tokens": new, "text": text}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
