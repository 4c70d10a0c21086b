"""A serving step's attention in each checkout named, one process each, through that checkout's
`kernels.attend`: SmolLM2-135M's shapes (3 KV heads of 64, groups of 3, 30 layers), 16 sequences
at positions 256-383 in a cache of 16 x 392 tokens, either 16 decode rows or 15 decode rows and
49 prompt rows of one sequence (how the server's mixed step carries a prompt). A checkout with
the paged cache reads a pool of 16-token blocks scattered at random (on 2 MB pages where the
checkout puts them there); one before it, contiguous rows. Microseconds a layer, the median of 9 rounds.

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
    pools = [tuple(zeros((blocks, H, 16, D), dtype=torch.float32, device="cpu").normal_() for _ in "kv") for _ in range(L)]
    try:  # pools of blocks (N, H, 16, D); a checkout before them keeps (slots, H, D)
        kernels.attend(torch.zeros(1, H, G, D), *pools[0], torch.zeros(1, 1, 1, 16), 0.125, 0.0, torch.zeros(1, 16, dtype=torch.long))
    except RuntimeError:
        pools = [(k.view(-1, H, D), v.view(-1, H, D)) for k, v in pools]
    tables = torch.randperm(blocks)[:16 * 25].view(16, 25)
    row_slots = (tables.unsqueeze(-1) * 16 + torch.arange(16)).flatten(1)[:, :S]
else:
    caches = [tuple(torch.randn(17, H, ROW, D) for _ in "kv") for _ in range(L)]
times = {}
for _ in range(9):
    for B in (16, 64):
        seqs, mask, q = case(B)
        if paged:
            slots = row_slots[seqs].contiguous()
            step = lambda: [kernels.attend(q, k, v, mask, 0.125, 0.0, slots) for k, v in pools]
        else:
            step = lambda: [kernels.attend(q, k, v, mask, 0.125, 0.0, seqs) for k, v in caches]
        step()
        t = time.perf_counter()
        step(); step()
        times.setdefault(f"{B} rows", []).append((time.perf_counter() - t) / 2 / L * 1e6)
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
'''


def main(argv=None):
    args = tree_arguments("python -m scripts.ab_attend", __doc__, argv)
    runs = run_in_trees(WORKER, args.trees, args.json)
    for tree in dict.fromkeys(run["tree"] for run in runs):
        mine = [run for run in runs if run["tree"] == tree]
        print(f"{tree}: " + ", ".join(f"{k} {statistics.median(r[k] for r in mine):.0f} us a layer"
                                      for k in ("16 rows", "64 rows")))


if __name__ == "__main__":
    main()
