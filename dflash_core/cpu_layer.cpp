// A whole decoder layer of the batch-invariant bf16 path as one call, and a drafter's layer: the
// same kernels, in the same order, as FastForward._layers and DFlashDrafter.step call them from
// Python (so the same bits), without the ~20 Python-level calls a layer costs there.
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

// A DFlash drafter's full-attention layer (DFlashDrafter.step), in the order its Python calls
// run: h [bsz, hidden] the block's rows; ctx [m, hidden] the new target-context rows (already
// through fc and hidden_norm), if any. The keys and values of [ctx; norm(h)] go to the draft
// cache's layer buffers (keys/values [kv_heads, S, head_dim]) at rows [at, at + m + bsz); every
// block row attends to rows [lo, at + m + bsz). Returns the block's rows after the layer.
torch::Tensor draft_layer(torch::Tensor h, c10::optional<torch::Tensor> ctx, torch::Tensor in_norm,
                          torch::Tensor qkv, torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor o,
                          torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor down, torch::Tensor cos,
                          torch::Tensor sin, torch::Tensor keys, torch::Tensor values, int64_t at, int64_t lo,
                          int64_t heads, double eps, double scale) {
  const int64_t bsz = h.size(0), m = ctx ? ctx->size(0) : 0, rows = m + bsz;
  const int64_t kv_heads = keys.size(0), hd = keys.size(2), end = at + rows;
  TORCH_CHECK(0 <= lo && lo <= at && end <= keys.size(1) && end <= values.size(1), "the block overflows the draft cache");
  auto x = ::rms_norm(h, in_norm, eps);
  if (ctx) x = torch::cat({*ctx, x});
  const c10::optional<torch::Tensor> none;
  auto both = ::linear(x, qkv, none);
  auto q = both.narrow(0, m, bsz).narrow(1, 0, heads * hd).view({bsz, heads, hd});
  auto k = both.narrow(1, heads * hd, kv_heads * hd).view({rows, kv_heads, hd});
  auto v = both.narrow(1, (heads + kv_heads) * hd, kv_heads * hd).view({rows, kv_heads, hd});
  q = ::rope(::rms_norm(q, q_norm, eps).transpose(0, 1), cos.narrow(0, m, bsz), sin.narrow(0, m, bsz));
  keys.narrow(1, at, rows).copy_(::rope(::rms_norm(k, k_norm, eps).transpose(0, 1), cos, sin));
  values.narrow(1, at, rows).copy_(v.transpose(0, 1));
  const auto longs = torch::TensorOptions().dtype(torch::kLong);
  auto out = ::attention(q, keys.narrow(1, lo, end - lo), values.narrow(1, lo, end - lo),
                         torch::full({bsz}, end - lo, longs), torch::empty({bsz, 0}, longs), torch::zeros({bsz}, longs),
                         scale);
  h = h + ::linear(out.transpose(0, 1).reshape({bsz, heads * hd}), o, none);
  return h + ::linear(::swiglu(::linear(::rms_norm(h, post_norm, eps), gate_up, none)), down, none);
}
