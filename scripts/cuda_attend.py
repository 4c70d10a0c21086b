"""A serving step's decode attention on CUDA, each way it could be read from the paged pool:
SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, 30 layers), 16-token blocks scattered at
random, B decode rows at positions of the default serving workload (256-384) and of long ones.

- gather_sdpa: what model.py does (the cache read through the slots, SDPA with an additive mask),
  eager and compiled by inductor (what the engine's compiled step runs);
- flex: the gathered keys through flex_attention, the mask from each row's length;
- varlen_paged: flash attention reading the pool through the block tables (torch.nn.attention.varlen),
  where this torch has it.

Each way runs 30 layers in one CUDA graph (as the compiled step replays them); microseconds a
layer, the median of the rounds, and each way's largest difference from the float32 reference.

    python -m scripts.cuda_attend --json benchmarks/cuda-attend.json"""
import argparse
import inspect
import json
import statistics

import torch
import torch.nn.functional as F

NH, NKV, D, LAYERS, BLOCK = 9, 3, 64, 30, 16


def make_case(batch: int, low: int, high: int, device, dtype, seed: int = 0) -> dict:
    """Pools of scattered blocks, each row's block table, slots and additive mask at bucket width S."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high, (batch,), generator=g)
    S = 1 << (int(lens.max()) - 1).bit_length()  # the engine's power-of-two cache bucket
    per_row = S // BLOCK
    blocks = batch * per_row + 1  # block 0: scratch
    tables = (torch.randperm(blocks - 1, generator=g)[:batch * per_row] + 1).view(batch, per_row)
    slots = (tables.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).flatten(1)  # (B, S)
    mask = torch.zeros(batch, 1, 1, S)
    for b in range(batch):
        mask[b, ..., int(lens[b]):] = float("-inf")
    pools = [tuple(torch.randn(blocks * BLOCK, NKV, D, generator=g).to(device, dtype) for _ in "kv")
             for _ in range(LAYERS)]
    q = torch.randn(batch, NH, 1, D, generator=g).to(device, dtype)
    return dict(q=q, pools=pools, slots=slots.to(device), mask=mask.to(device, dtype), lens=lens.to(device),
                tables=tables.to(device, torch.int32), S=S)


def gather_sdpa(q, k_pool, v_pool, c):
    """model.py's Attention.attend_cache: the keys gathered, each KV head's query group as its rows."""
    B = q.shape[0]
    k, v = k_pool[c["slots"]].transpose(1, 2), v_pool[c["slots"]].transpose(1, 2)  # (B, NKV, S, D)
    group = NH // NKV
    mask = c["mask"].unsqueeze(2).expand(B, 1, group, 1, c["S"]).reshape(B, 1, group, c["S"]).contiguous()
    y = F.scaled_dot_product_attention(q.reshape(B, NKV, group, D), k, v, attn_mask=mask)
    return y.reshape(B, NH, 1, D)


def make_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)

    def run(q, k_pool, v_pool, c):
        B, S = q.shape[0], c["S"]
        if "block_mask" not in c:  # once a case, as the engine would once a step
            lens = c["lens"]
            c["block_mask"] = create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, None, 1, S, device=q.device)
        k, v = k_pool[c["slots"]].transpose(1, 2), v_pool[c["slots"]].transpose(1, 2)
        return flex(q, k, v, block_mask=c["block_mask"], enable_gqa=True)
    return run


def make_varlen():
    from torch.nn.attention.varlen import varlen_attn
    if "block_table" not in inspect.signature(varlen_attn).parameters:
        raise RuntimeError("this torch's varlen_attn reads no block table")

    def run(q, k_pool, v_pool, c):
        B = q.shape[0]
        cu = torch.arange(B + 1, device=q.device, dtype=torch.int32)
        pages = (k_pool.view(-1, BLOCK, NKV, D), v_pool.view(-1, BLOCK, NKV, D))
        y = varlen_attn(q.view(B, NH, D), *pages, cu, None, 1, c["S"], enable_gqa=True,
                        seqused_k=c["lens"].to(torch.int32), block_table=c["tables"])
        return y.view(B, NH, 1, D)
    return run


def time_layers(fn, c, rounds: int) -> float:
    """Microseconds a layer: 30 layers' calls captured in one CUDA graph (or run, on CPU), replayed."""
    def layers():
        return [fn(c["q"], k, v, c) for k, v in c["pools"]]
    for _ in range(3):
        layers()
    if c["q"].device.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers()
        step = graph.replay
    else:
        step = layers
    times = []
    for _ in range(rounds):
        if c["q"].device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1000 / 10 / LAYERS)
        else:
            import time
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e6 / LAYERS)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m scripts.cuda_attend")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ways = {"gather_sdpa eager": lambda: gather_sdpa, "gather_sdpa compiled": lambda: torch.compile(gather_sdpa),
            "flex": make_flex, "varlen_paged": make_varlen}
    rows = []
    for batch, low, high in [(16, 256, 384), (64, 256, 384), (16, 1500, 2000), (1, 1500, 2000)]:
        c = make_case(batch, low, high, device, dtype)
        k, v = c["pools"][0]
        reference = gather_sdpa(c["q"].float(), k.float(), v.float(), dict(c, mask=c["mask"].float()))
        for name, make in ways.items():
            row = dict(way=name, batch=batch, positions=f"{low}-{high}", bucket=c["S"])
            try:
                fn = make()
                row["max_diff"] = float((fn(c["q"], k, v, c).float() - reference).abs().max())
                row["us_per_layer"] = round(time_layers(fn, c, args.rounds), 2)
            except Exception as e:  # a way this torch or device lacks: say why, go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", dtype=args.dtype,
                    torch=torch.__version__, rounds=args.rounds)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
