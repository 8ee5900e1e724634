#!/usr/bin/env python3
"""torch_peer.py: the PyTorch peer of pd-cuda-bench.

The same shapes and figures as bench/cuda_bench.cc, measured with Hugging
Face transformers on the same GPU, so that pdserve's cuda backend can be
read as a ratio to what PyTorch does with the same model:

  - a LlamaForCausalLM built from a LlamaConfig of the Llama-3-8B shape
    (vocab 128256, hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336,
    llama3 RoPE scaling as in pd-cuda-bench), random bf16 weights created
    directly on the device (no download), attn_implementation="sdpa";
  - mode "eager": the model as it comes, KV in a DynamicCache;
  - mode "compiled": KV in a StaticCache and model.forward wrapped in
    torch.compile(mode="reduce-overhead", fullgraph=True), which is what
    transformers documents for static-cache generation (the "Static
    kv-cache and torch.compile" section of its inference-optimization
    guide, and the default mode of its CompileConfig; reduce-overhead
    replays CUDA graphs, as pd-cuda-bench's decode does);
  - decode: one forward of one new token per sequence at batch 1/8/64 with
    the cache holding context-1 positions (the new token is at position
    context-1, as pd-cuda-bench's start_pos = context - 1); prefill: one
    prompt of 512/2048/8192 tokens into an empty cache.

Times are wall-clock around one forward (torch.cuda.synchronize before and
after), the copy of the logits rows to host memory as fp32 included, as in
pd-cuda-bench (its Generator samples on the host); --no-logits-to-host
leaves the logits on the device. Only the last position's logits are
computed (logits_to_keep=1), matching the cost model's single LM-head row.
Medians of --reps runs after --warmup runs (the first compiled calls
compile and record graphs; the first-call time is kept in the JSON).

The limits are measured the way pd-cuda-bench measures them: a 2 GiB
device-to-device copy timed with CUDA events (bytes read + written), and an
8192^3 bf16 matrix product on constant operands (pd-cuda-bench memsets
0x3c bytes: 0x3c3c = 0.01147 in bf16; here through torch.matmul, bf16
output where pd-cuda-bench's cuBLAS call writes fp32); plus the same
datasheet table.

Cache contents are random (they do not change the timing). transformers'
DynamicCache appends with torch.cat, so an eager decode step copies the
whole cache; the GB/s column still counts only the bytes the step must read
(the cost model), so its share says how far PyTorch is from the limit.

  python3 bench/torch_peer.py --json out.json                # GPU, both modes
  python3 bench/torch_peer.py --tiny --device cpu            # smoke run
  python3 bench/torch_peer.py --load-json a.json b.json --compare cuda_bench.log
"""
import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback


# --- Cost model: a line-by-line port of bench/model_cost.h -----------------
# Keep these formulas identical to the header's (same names, same terms) so
# that this script's GB/s and TFLOP/s columns mean what pd-cuda-bench's do.

@dataclasses.dataclass(frozen=True)
class Shape:
    """The ModelConfig fields the cost model and the model build read."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None


def median(v):
    """bench::Median: the element at size/2 of the sorted values."""
    s = sorted(v)
    return s[len(s) // 2]


def layer_matrix_params(c):
    """bench::LayerMatrixParams: parameters of one layer's matrices."""
    q = float(c.num_heads) * c.head_dim
    kv = float(c.num_kv_heads) * c.head_dim
    return (c.hidden_size * (q + 2 * kv) + q * c.hidden_size +
            3.0 * c.hidden_size * c.intermediate_size)


def forward_flops(c, start, n):
    """bench::ForwardFlops: n new tokens at [start, start + n), logits for
    the last one; matrix products plus QK^T and PV over the causal
    triangle."""
    q = float(c.num_heads) * c.head_dim
    keys = float(n) * start + float(n) * (n + 1) / 2
    return (c.num_layers * (2.0 * layer_matrix_params(c) * n +
                            2.0 * 2.0 * q * keys) +
            2.0 * c.hidden_size * c.vocab_size)


def decode_bytes(c, batch, context, weight_bytes, kv_bytes_per_token):
    """bench::DecodeBytes: every weight once plus each sequence's K and V."""
    params = (c.num_layers * layer_matrix_params(c) +
              float(c.vocab_size) * c.hidden_size)
    return (params * weight_bytes +
            float(batch) * context * kv_bytes_per_token)


def kv_bytes_per_token(c):
    """pd-cuda-bench's 2 * KvBlockLayout::slot_bytes() * num_layers, with
    bf16 K/V (num_kv_heads * head_dim * 2 bytes per slot)."""
    return 2.0 * c.num_kv_heads * c.head_dim * 2 * c.num_layers


# --- Shapes ----------------------------------------------------------------

def llama3_8b_shape(num_layers):
    """pd-cuda-bench's Llama3_8BConfig."""
    return Shape(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_layers=num_layers, num_heads=32, num_kv_heads=8,
                 head_dim=128, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0,
                               "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})


def tiny_shape(num_layers):
    """A test-sized Llama (GQA, llama3 RoPE) for smoke runs on a CPU."""
    return Shape(vocab_size=1024, hidden_size=128, intermediate_size=256,
                 num_layers=num_layers, num_heads=4, num_kv_heads=2,
                 head_dim=32, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0,
                               "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})


def parse_list(s):
    return [int(x) for x in s.split(",") if x.strip() and int(x) > 0]


def datasheet_bf16_tflops(name):
    """pd-cuda-bench's DatasheetBf16Tflops: dense bf16, 0 when unknown."""
    pcie = "PCIe" in name
    if "H100" in name:
        return 756.0 if pcie else 989.4
    if "H200" in name:
        return 989.4
    if "A100" in name:
        return 312.0
    return 0.0


def share(v, of):
    return f"{100.0 * v / of:.0f}%" if of > 0 else "-"


# --- The measurement -------------------------------------------------------

class Bench:
    def __init__(self, args, torch, transformers):
        self.args = args
        self.torch = torch
        self.transformers = transformers
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.shape = (tiny_shape(args.layers or 2) if args.tiny
                      else llama3_8b_shape(args.layers or 32))

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    # Limits, measured as pd-cuda-bench does.
    def event_times(self, fn, reps):
        """reps + 1 runs, the first dropped; seconds per run."""
        torch = self.torch
        out = []
        for r in range(reps + 1):
            if self.cuda:
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                secs = a.elapsed_time(b) * 1e-3
            else:
                t0 = time.perf_counter()
                fn()
                secs = time.perf_counter() - t0
            if r > 0:
                out.append(secs)
        return out

    def copy_bandwidth(self):
        """Device-to-device copy of --copy-mib MiB (2 GiB on a GPU, like
        pd-cuda-bench's cudaMemcpy), bytes read + written per second."""
        torch = self.torch
        nbytes = self.args.copy_mib << 20
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        dst = torch.empty_like(src)
        src.fill_(1)
        t = self.event_times(lambda: dst.copy_(src), self.args.reps)
        del src, dst
        return median([2.0 * nbytes / s / 1e9 for s in t])

    def gemm_tflops(self):
        torch = self.torch
        n = self.args.gemm_n
        # 0x3c3c, the bf16 value of pd-cuda-bench's memset(0x3c).
        x = torch.full((n, n), 0.011474609375, dtype=torch.bfloat16,
                       device=self.dev)
        w = torch.full((n, n), 0.011474609375, dtype=torch.bfloat16,
                       device=self.dev)
        t = self.event_times(lambda: torch.matmul(x, w.t()), self.args.reps)
        del x, w
        return median([2.0 * n * n * n / s / 1e12 for s in t])

    # The model.
    def build_model(self):
        torch, tf = self.torch, self.transformers
        c = self.shape
        cfg = tf.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
            max_position_embeddings=c.max_position_embeddings,
            rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None,
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
            bos_token_id=0, eos_token_id=1)
        t0 = time.perf_counter()
        with torch.device(self.dev):
            try:  # transformers >= 4.56 names it dtype; older, torch_dtype.
                model = tf.LlamaForCausalLM._from_config(
                    cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
            except TypeError:
                model = tf.LlamaForCausalLM._from_config(
                    cfg, torch_dtype=torch.bfloat16,
                    attn_implementation="sdpa")
        model.eval()
        self.sync()
        self.model = model
        self.cfg = model.config
        self.build_s = time.perf_counter() - t0
        p = next(model.parameters())
        assert p.dtype == torch.bfloat16 and p.device.type == self.dev.type
        assert model.config._attn_implementation == "sdpa"
        # transformers < 5 places new KV at cache_position; 5 dropped it.
        import inspect
        self.takes_cache_position = "cache_position" in inspect.signature(
            type(model.model).forward).parameters

    def dynamic_cache(self, batch, length):
        """A DynamicCache holding `length` random positions per sequence."""
        torch, tf = self.torch, self.transformers
        c = self.shape
        try:
            cache = tf.DynamicCache(config=self.cfg)
        except TypeError:
            cache = tf.DynamicCache()
        if length > 0:
            for layer in range(c.num_layers):
                k = torch.randn(batch, c.num_kv_heads, length, c.head_dim,
                                dtype=torch.bfloat16, device=self.dev)
                cache.update(k, torch.randn_like(k), layer)
        return cache

    def static_cache(self, batch, max_len):
        torch, tf = self.torch, self.transformers
        try:  # transformers 5: batch size, dtype, device from the first update.
            return tf.StaticCache(config=self.cfg, max_cache_len=max_len)
        except TypeError:
            return tf.StaticCache(config=self.cfg, max_batch_size=batch,
                                  max_cache_len=max_len, device=self.dev,
                                  dtype=torch.bfloat16)

    def cache_tensors(self, cache):
        if hasattr(cache, "layers"):
            for layer in cache.layers:
                yield layer.keys
                yield layer.values
        else:
            yield from cache.key_cache
            yield from cache.value_cache

    def set_cache_length(self, cache, n):
        """Where the next token lands: transformers 5 keeps it in each
        StaticLayer's cumulative_length (a device tensor the compiled graph
        reads); a DynamicCache is cropped instead. Older versions take
        cache_position in forward()."""
        if isinstance(cache, self.transformers.DynamicCache):
            if cache.get_seq_length() > n:
                cache.crop(n - cache.get_seq_length())  # Negative: remove.
            return
        for layer in getattr(cache, "layers", []):
            if isinstance(getattr(layer, "cumulative_length", None),
                          self.torch.Tensor):
                layer.cumulative_length.fill_(n)

    def forward(self, fn, ids, cache, positions):
        """One forward of ids at positions, the logits rows copied to the
        host as fp32."""
        kw = {"cache_position": positions} if self.takes_cache_position else {}
        out = fn(input_ids=ids, past_key_values=cache,
                 position_ids=positions.unsqueeze(0).expand(ids.shape[0], -1),
                 use_cache=True, logits_to_keep=1, **kw)
        logits = out.logits[:, -1, :]
        if self.args.logits_to_host:
            logits.float().cpu()

    def timed(self, step, after=None):
        """--warmup calls, then --reps timed ones; seconds, first call."""
        first = None
        for _ in range(self.args.warmup):
            t0 = time.perf_counter()
            step()
            self.sync()
            if first is None:
                first = time.perf_counter() - t0
            if after:
                after()
        secs = []
        for _ in range(self.args.reps):
            self.sync()
            t0 = time.perf_counter()
            step()
            self.sync()
            secs.append(time.perf_counter() - t0)
            if after:
                after()
        return secs, first

    def compiled_forward(self):
        torch = self.torch
        if not hasattr(self, "_compiled"):
            # One graph per shape (batch, cache length, prompt length):
            # 6 decode + 3 prefill shapes exceed dynamo's default limit of 8.
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 64)
            self._compiled = torch.compile(
                self.model.forward, mode=self.args.compile_mode,
                fullgraph=True, dynamic=False)
        compiled = self._compiled

        def call(**kw):
            if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(**kw)
        return call

    def run_one(self, mode, phase, n, batch, context):
        """One row: prefill of n tokens, or decode at (batch, context)."""
        torch = self.torch
        c = self.shape
        gen = torch.Generator(device=self.dev).manual_seed(1234)
        if phase == "prefill":
            ids = torch.randint(c.vocab_size, (1, n), device=self.dev,
                                generator=gen)
            pos = torch.arange(n, device=self.dev)
            if mode == "eager":
                def step():
                    self.forward(self.model, ids, self.dynamic_cache(1, 0),
                                 pos)
                secs, first = self.timed(step)
            else:
                cache = self.static_cache(1, n)
                fn = self.compiled_forward()
                # An eager call allocates the cache's tensors (lazily made
                # in transformers 5) before the compiler sees it.
                self.forward(self.model, ids, cache, pos)
                self.set_cache_length(cache, 0)
                secs, first = self.timed(
                    lambda: self.forward(fn, ids, cache, pos),
                    after=lambda: self.set_cache_length(cache, 0))
                del cache
            flops = forward_flops(c, 0, n)
            nbytes = None
            tokens = n
        else:
            ids = torch.randint(c.vocab_size, (batch, 1), device=self.dev,
                                generator=gen)
            pos = torch.tensor([context - 1], device=self.dev)
            if mode == "eager":
                cache = self.dynamic_cache(batch, context - 1)
                secs, first = self.timed(
                    lambda: self.forward(self.model, ids, cache, pos),
                    after=lambda: self.set_cache_length(cache, context - 1))
            else:
                cache = self.static_cache(batch, context)
                self.forward(self.model, ids, cache, pos)
                for t in self.cache_tensors(cache):
                    t.normal_()
                self.set_cache_length(cache, context - 1)
                fn = self.compiled_forward()
                secs, first = self.timed(
                    lambda: self.forward(fn, ids, cache, pos),
                    after=lambda: self.set_cache_length(cache, context - 1))
            del cache
            flops = batch * forward_flops(c, context - 1, 1)
            nbytes = decode_bytes(c, batch, context, 2.0,
                                  kv_bytes_per_token(c))
            tokens = batch
        t = median(secs)
        row = {"mode": mode, "phase": phase, "tokens_per_forward": tokens,
               "batch": batch, "context": context,
               "prompt": n if phase == "prefill" else None,
               "median_ms": t * 1e3, "tokens_per_s": tokens / t,
               "tflops": flops / t / 1e12, "flops": flops,
               "gbps": nbytes / t / 1e9 if nbytes else None,
               "bytes": nbytes, "times_ms": [s * 1e3 for s in secs],
               "first_call_s": first}
        return row

    def run(self):
        torch = self.torch
        a = self.args
        if self.cuda:
            props = torch.cuda.get_device_properties(self.dev)
            self.device_name = props.name
            device_line = (f"{props.name} ({props.multi_processor_count} "
                           f"SMs, {props.total_memory / 2**30:.1f} GiB)")
        else:
            self.device_name = platform.processor() or platform.machine()
            device_line = (f"cpu: {self.device_name}, "
                           f"{torch.get_num_threads()} threads")
        self.copy_gbps = self.copy_bandwidth()
        self.gemm = self.gemm_tflops()
        self.sheet = datasheet_bf16_tflops(self.device_name)
        sheet = f"{self.sheet:.0f} TFLOP/s" if self.sheet > 0 else "unknown"
        print(f"device: {device_line}; copy bandwidth {self.copy_gbps:.0f} "
              f"GB/s; torch bf16 matmul {a.gemm_n}^3 {self.gemm:.0f} "
              f"TFLOP/s; datasheet dense bf16 {sheet}")
        print(f"torch {torch.__version__}, transformers "
              f"{self.transformers.__version__}, python "
              f"{platform.python_version()}; shape: "
              f"{'tiny' if a.tiny else 'Llama-3-8B'}, "
              f"{self.shape.num_layers} layers", flush=True)
        self.build_model()
        print(f"model built on the device in {self.build_s:.1f} s; "
              f"{sum(p.numel() for p in self.model.parameters()) / 1e9:.2f}"
              f"e9 parameters\n", flush=True)

        rows = []
        with torch.no_grad():
            for mode in a.modes:
                what = ("DynamicCache, eager" if mode == "eager" else
                        f"StaticCache, torch.compile(mode=\"{a.compile_mode}\","
                        " fullgraph=True)")
                print(f"mode {mode} ({what}, sdpa):\n")
                print("| phase | tokens per forward | median time | "
                      "tokens/s | GB/s read (share of copy BW) | TFLOP/s "
                      "(share of datasheet / of measured GEMM) |\n"
                      "|---|---|---|---|---|---|", flush=True)
                jobs = []
                if "prefill" in a.phases:
                    jobs += [("prefill", n, 1, n) for n in a.prefill]
                if "decode" in a.phases:
                    jobs += [("decode", 1, b, x) for x in a.contexts
                             for b in a.batches]
                for phase, n, b, x in jobs:
                    label = (f"prefill {n}" if phase == "prefill"
                             else f"decode b={b}, context {x}")
                    try:
                        row = self.run_one(mode, phase, n, b, x)
                    except Exception as e:  # One failed row, not the run.
                        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        if a.verbose:
                            traceback.print_exc()
                        print(f"| {label} | | | | | error: {msg[:200]} |",
                              flush=True)
                        rows.append({"mode": mode, "phase": phase,
                                     "label": label, "error": msg})
                        self.release()
                        if mode == "compiled" and not self.cuda:
                            print(f"(compiled mode on {a.device} skipped "
                                  "after the first failure)")
                            break
                        continue
                    row["label"] = label
                    rows.append(row)
                    t = row["median_ms"]
                    if phase == "prefill":
                        print(f"| {label} | {n} | {t:.1f} ms | "
                              f"{row['tokens_per_s']:.0f} | | "
                              f"{row['tflops']:.0f} "
                              f"({share(row['tflops'], self.sheet)} / "
                              f"{share(row['tflops'], self.gemm)}) |",
                              flush=True)
                    else:
                        print(f"| {label} | {b} | {t:.2f} ms | "
                              f"{row['tokens_per_s']:.0f} | "
                              f"{row['gbps']:.0f} "
                              f"({share(row['gbps'], self.copy_gbps)}) | "
                              f"{row['tflops']:.1f} "
                              f"({share(row['tflops'], self.sheet)} / "
                              f"{share(row['tflops'], self.gemm)}) |",
                              flush=True)
                    self.release()
                print()
        return {
            "tool": "bench/torch_peer.py",
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": self.device_name, "device_line": device_line,
            "torch": torch.__version__,
            "transformers": self.transformers.__version__,
            "python": platform.python_version(),
            "copy_gbps": self.copy_gbps, "gemm_tflops": self.gemm,
            "gemm_n": a.gemm_n, "copy_mib": a.copy_mib,
            "datasheet_tflops": self.sheet,
            "shape": dataclasses.asdict(self.shape),
            "kv_bytes_per_token": kv_bytes_per_token(self.shape),
            "compile_mode": a.compile_mode,
            "logits_to_host": a.logits_to_host,
            "reps": a.reps, "warmup": a.warmup, "rows": rows}

    def release(self):
        import gc
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


# --- Ratios against pd-cuda-bench ------------------------------------------

def read_cuda_bench_log(path):
    """{phase label: median ms} from pd-cuda-bench's Markdown table."""
    out = {}
    with open(path) as f:
        for line in f:
            cells = [x.strip() for x in line.strip().strip("|").split("|")]
            if (len(cells) >= 3 and cells[0].startswith(("prefill", "decode"))
                    and cells[2].endswith(" ms")):
                out[cells[0]] = float(cells[2][:-3])
    return out


def print_comparison(pd_log, results):
    pd = read_cuda_bench_log(pd_log)
    torch_ms = {}  # (mode, label) -> ms
    modes = []
    for r in results:
        for row in r["rows"]:
            if "median_ms" in row:
                torch_ms[(row["mode"], row["label"])] = row["median_ms"]
                if row["mode"] not in modes:
                    modes.append(row["mode"])
    print(f"pd-cuda-bench ({pd_log}) against the PyTorch peer: median step "
          "time; ratio = torch time / pdserve time (above 1: pdserve is "
          "faster)\n")
    head = "| phase | pdserve |" + "".join(
        f" torch {m} | {m} / pdserve |" for m in modes)
    print(head + "\n|---|---|" + "---|---|" * len(modes))
    labels = list(pd) + [lab for (_, lab) in torch_ms if lab not in pd]
    seen = set()
    for lab in labels:
        if lab in seen:
            continue
        seen.add(lab)
        p = pd.get(lab)
        line = f"| {lab} | {f'{p:.2f} ms' if p else ''} |"
        for m in modes:
            t = torch_ms.get((m, lab))
            line += (f" {t:.2f} ms |" if t else " |")
            line += (f" {t / p:.2f} |" if t and p else " |")
        print(line)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--modes", default="eager,compiled",
                    help="eager and/or compiled (default both)")
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--batches", default=None, help="default 1,8,64")
    ap.add_argument("--contexts", default=None, help="default 512,4096")
    ap.add_argument("--prefill", default=None, help="default 512,2048,8192")
    ap.add_argument("--layers", "--num-layers", type=int, default=None,
                    help="layers of the shape (default 32; 2 with --tiny)")
    ap.add_argument("--tiny", action="store_true",
                    help="a test-sized Llama (hidden 128, vocab 1024) with "
                    "small batches, contexts and prompts")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed runs per row, median reported (default 5, "
                    "as pd-cuda-bench)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed runs first (compiled mode needs 3: "
                    "compile, record, replay)")
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--logits-to-host", action=argparse.BooleanOptionalAction,
                    default=True, help="copy the logits rows to host as fp32 "
                    "inside the timed step, as pd-cuda-bench does")
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="copy-bandwidth buffer (default 2048 on cuda, 256 "
                    "on cpu)")
    ap.add_argument("--gemm-n", type=int, default=None,
                    help="GEMM size (default 8192 on cuda, 1024 on cpu)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--load-json", nargs="+", default=None,
                    help="measure nothing; read these results instead")
    ap.add_argument("--compare", default=None, metavar="CUDA_BENCH_LOG",
                    help="print time ratios against pd-cuda-bench's output")
    ap.add_argument("--verbose", action="store_true",
                    help="print the traceback of a failed row")
    a = ap.parse_args()

    if a.load_json:
        results = []
        for p in a.load_json:
            with open(p) as f:
                results.append(json.load(f))
        if a.compare:
            print_comparison(a.compare, results)
        return 0

    a.modes = [m for m in a.modes.split(",") if m]
    a.phases = [p for p in a.phases.split(",") if p]
    for m in a.modes:
        if m not in ("eager", "compiled"):
            ap.error(f"unknown mode {m}")
    on_cpu = a.device == "cpu"
    a.batches = parse_list(a.batches or ("1,2" if a.tiny else "1,8,64"))
    a.contexts = parse_list(a.contexts or ("32,64" if a.tiny else "512,4096"))
    a.prefill = parse_list(a.prefill or ("16,64" if a.tiny else
                                         "512,2048,8192"))
    a.copy_mib = a.copy_mib or (256 if on_cpu else 2048)
    a.gemm_n = a.gemm_n or (1024 if on_cpu else 8192)

    import torch
    import transformers
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("torch_peer: no CUDA device (use --device cpu for a smoke run)",
              file=sys.stderr)
        return 1
    result = Bench(a, torch, transformers).run()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.compare:
        print_comparison(a.compare, [result])
    failed = [r for r in result["rows"] if "error" in r]
    return 1 if failed and not (on_cpu and all(
        r["mode"] == "compiled" for r in failed)) else 0


if __name__ == "__main__":
    sys.exit(main())
