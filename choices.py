"""The values that flags and requests choose among, in a module without torch: the command lines
check their flags against them before they import torch (seconds), and the modules that act on
them take them from here."""

COMPILE_MODES = ("default", "regional", "max")  # compile.py
TP_MODES = ("auto", "exact", "allreduce")  # tensor-parallel modes, tp.py
MAX_LOGPROBS = 20  # top_logprobs per token, at most (as OpenAI)
BLOCK_SIZE = 16  # tokens a block: the unit of prefix sharing and of allocation (engine.py, docs/design.md)

# quantize.py --mode; qlayers.SCHEMES holds each mode's formats (test_quantize checks that they agree)
QUANTIZE_MODES = ("int8", "int4", "int4-gptq")
GROUPED_MODES = ("int4", "int4-gptq")  # int4 weights: these take --groupsize
GPTQ_MODES = ("int4-gptq",)  # calibrated on --calibration text
GROUPSIZES = (32, 64, 128, 256)  # the int4 kernel handles 32 and multiples of 64

# the published shapes that shapes.py makes with random weights (generate.py --shape)
SHAPES = {
    # Llama 2 7B (Touvron et al. 2023): multi-head attention, a 32000-token vocabulary
    "llama-2-7b": dict(dim=4096, n_layers=32, n_heads=32, intermediate_size=11008, vocab_size=32000,
                       max_position_embeddings=4096, bos_token_id=1, eos_token_ids=[2]),
    # Llama 3.1 8B: 8 KV heads (grouped-query attention), a 14336-wide feed-forward, 128256 tokens
    "llama-3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                         vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         bos_token_id=128000, eos_token_ids=[128001, 128008, 128009]),
    # a few MB of the same kind: rehearses on a CPU what the GPU runs (scripts/gpu_session.sh)
    "tiny": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=512, vocab_size=1024,
                 max_position_embeddings=2048, bos_token_id=1, eos_token_ids=[2]),
}
