"""A serving step's attention in each checkout named, one process each, through that checkout's
`kernels.attend`: SmolLM2-135M's shapes (3 KV heads of 64, groups of 3, 30 layers), 16 sequences
at positions 256-383 in a cache of 16 x 392 tokens, either 16 decode rows or 15 decode rows and
49 prompt rows of one sequence (how the server's mixed step carries a prompt). A checkout with
the paged cache reads its own pools (kvcache.KVCache where it has one, on 2 MB pages where the
checkout puts them there) through 16-token blocks scattered at random, and, 16 decode rows, through
blocks placed as a server hands them out (a prompt's 16 at once, then one a sequence in turn); one
before it, contiguous rows. Microseconds a layer, the median of 9 rounds.

    git worktree add /tmp/before 7cefa95
    python -m scripts.ab_attend . /tmp/before . /tmp/before --json benchmarks/step-attend.json"""
import statistics

from scripts.serve_steps import run_in_trees, tree_arguments

WORKER = r'''
import inspect, json, statistics, sys, time, torch
import kernels
assert kernels.available(), "the kernels could not be built"
paged = "slots" in inspect.signature(kernels.attend).parameters
torch.manual_seed(0)
H, G, D, L, ROW = 3, 3, 64, 30, 392
S = 400 if paged else ROW  # the paged engine attends over whole blocks
def case(B):
    seqs = torch.arange(B).clamp(max=15)
    positions = torch.randint(256, 384, (16,))[seqs]
    positions[15:] = 200 + torch.arange(B - 15)  # a prompt's tokens, one row each
    mask = torch.zeros(B, 1, 1, S)
    for b in range(B):
        mask[b, ..., int(positions[b]) + 1:] = float("-inf")
    return seqs, mask, torch.randn(B, H, G, D)
if paged:
    try:
        from checkpoint import huge_page_zeros as zeros
    except ImportError:  # a checkout whose pools are on 4 kB pages
        zeros = torch.zeros
    blocks = 16 * 25 + 1
    try:  # the checkout's own pools (its layout in memory)
        from kvcache import KVCache
        pools = [(c.k_cache.normal_(), c.v_cache.normal_()) for c in
                 (KVCache(blocks * 16, H, D, torch.float32, "cpu", zeros, block_size=16) for _ in range(L))]
    except ImportError:
        pools = [tuple(zeros((blocks, H, 16, D), dtype=torch.float32, device="cpu").normal_() for _ in "kv") for _ in range(L)]
    try:  # pools of blocks (N, H, 16, D); a checkout before them keeps (slots, H, D)
        kernels.attend(torch.zeros(1, H, G, D), *pools[0], torch.zeros(1, 1, 1, 16), 0.125, 0.0, torch.zeros(1, 16, dtype=torch.long))
    except RuntimeError:
        pools = [(k.view(-1, H, D), v.view(-1, H, D)) for k, v in pools]
    scattered = torch.randperm(blocks)[:16 * 25].view(16, 25)
    # as a server hands them out: each 256-token prompt's 16 blocks at once, then a block a sequence in turn
    allocated = torch.cat([torch.arange(256).view(16, 16), 256 + torch.arange(16 * 9).view(9, 16).T], 1)
    slots_of = lambda tables: (tables.unsqueeze(-1) * 16 + torch.arange(16)).flatten(1)[:, :S]  # noqa: E731
    row_slots = {"scattered": slots_of(scattered), "as allocated": slots_of(allocated)}
else:
    caches = [tuple(torch.randn(17, H, ROW, D) for _ in "kv") for _ in range(L)]
times = {}
for _ in range(9):
    for B, placed in ((16, "scattered"), (64, "scattered"), (16, "as allocated")):
        seqs, mask, q = case(B)
        if paged:
            slots = row_slots[placed][seqs].contiguous()
            step = lambda: [kernels.attend(q, k, v, mask, 0.125, 0.0, slots) for k, v in pools]
        else:
            step = lambda: [kernels.attend(q, k, v, mask, 0.125, 0.0, seqs) for k, v in caches]
        step()
        t = time.perf_counter()
        step(); step()
        name = f"{B} rows" + (", blocks as allocated" if placed != "scattered" else "")
        times.setdefault(name, []).append((time.perf_counter() - t) / 2 / L * 1e6)
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
'''


def main(argv=None):
    args = tree_arguments("python -m scripts.ab_attend", __doc__, argv)
    runs = run_in_trees(WORKER, args.trees, args.json)
    for tree in dict.fromkeys(run["tree"] for run in runs):
        mine = [run for run in runs if run["tree"] == tree]
        print(f"{tree}: " + ", ".join(f"{k} {statistics.median(r[k] for r in mine):.0f} us a layer"
                                      for k in mine[0] if k != "tree"))


if __name__ == "__main__":
    main()
