// A whole decoder layer of the batch-invariant bf16 path as one call: the same kernels, in the
// same order, as FastForward._layers calls them from Python (so the same bits), without the
// ~20 Python-level calls a layer costs there (cpu_kernels.py says why that matters).
// Needs the compiled linear layers (AVX512-BF16); RMSNorm, RoPE, attention and SwiGLU are the
// other sources' functions, built into the same extension (`::` keeps ATen's namesakes out).

// x [n, hidden] bf16 after the layers before; each weight laid out by `pack_linear` (q/k/v and
// gate/up joined); q_norm/k_norm: Qwen3's per-head norms, if any. The pass's keys and values are
// written into the layer's buffers (keys [kv_heads, S, head_dim], values [kv_heads, S, >= head_dim])
// at rows [at, at + n), and its rows attend as `attention` reads before/after/after_count.
// Returns the layer's output, [n, hidden] bf16.
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor attn_norm, torch::Tensor qkv,
                            c10::optional<torch::Tensor> qkv_bias, c10::optional<torch::Tensor> q_norm,
                            c10::optional<torch::Tensor> k_norm, torch::Tensor o, c10::optional<torch::Tensor> o_bias,
                            torch::Tensor mlp_norm, torch::Tensor gate_up, c10::optional<torch::Tensor> gate_up_bias,
                            torch::Tensor down, c10::optional<torch::Tensor> down_bias, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor keys, torch::Tensor values, int64_t at,
                            torch::Tensor before, torch::Tensor after, torch::Tensor after_count, int64_t heads,
                            double eps, double scale) {
  const int64_t n = x.size(0), kv_heads = keys.size(0), hd = keys.size(2);
  TORCH_CHECK(at >= 0 && at + n <= keys.size(1) && at + n <= values.size(1), "the pass overflows the cache");
  auto both = ::linear(::rms_norm(x, attn_norm, eps), qkv, qkv_bias);
  auto q = both.narrow(1, 0, heads * hd).view({n, heads, hd});
  auto k = both.narrow(1, heads * hd, kv_heads * hd).view({n, kv_heads, hd});
  auto v = both.narrow(1, (heads + kv_heads) * hd, kv_heads * hd).view({n, kv_heads, hd});
  if (q_norm && k_norm) {
    q = ::rms_norm(q, *q_norm, eps);
    k = ::rms_norm(k, *k_norm, eps);
  }
  q = ::rope(q.transpose(0, 1), cos, sin);
  keys.narrow(1, at, n).copy_(::rope(k.transpose(0, 1), cos, sin));
  values.narrow(1, at, n).narrow(2, 0, hd).copy_(v.transpose(0, 1));
  auto out = ::attention(q, keys, values, before, after, after_count, scale);
  x = x + ::linear(out.transpose(0, 1).reshape({n, heads * hd}), o, o_bias);
  return x + ::linear(::swiglu(::linear(::rms_norm(x, mlp_norm, eps), gate_up, gate_up_bias)), down, down_bias);
}
