"""Every token count at which a layer changes path, in one table that model.py, kernels.py and
qlayers.py read (the layers' `*_path` methods say which path each threshold picks). One line of
why each; the measurements behind the numbers are in docs/design.md and docs/benchmarks.md."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    """Token counts: a product's tokens (the rows of x), or attention's queries per head."""
    # model.Transformer: a fresh prompt longer than this takes SDPA's causal mask, which skips whole key blocks
    causal_sdpa_min_tokens: int = 512
    # kernels.CpuLinear: from this many float32 tokens oneDNN's GEMM beats small_linear and BLAS
    onednn_min_tokens: int = 16
    # kernels.CpuLinear: the same in bfloat16, on a CPU with bf16 instructions
    onednn_min_tokens_bf16: int = 8
    # kernels.CpuLinear: compiled float32 with AVX-512, small_linear's 512-bit tiles beat oneDNN up to this
    tile_max_tokens: int = 64
    # kernels.CpuLinear: compiled, where oneDNN does not take a product, small_linear keeps pace with BLAS to here
    linear_max_tokens: int = 128
    # kernels.CpuAttention, engine's short chunks: up to this many queries, `attend` reads only the keys they see
    attend_max_queries: int = 16
    # kernels.CpuAttention: an eager prompt of twice this or more goes in chunks: CPU SDPA would read every key
    prompt_query_chunk: int = 128
    # qlayers.PackedLinear: up to this many tokens the integer loops beat dequantizing every weight
    loop_max_tokens: int = 64
    # qlayers.Int8Experts: up to this many slots of an expert, q8_linear reads its rows without dequantizing
    expert_loop_max_slots: int = 16


THRESHOLDS = Thresholds()
