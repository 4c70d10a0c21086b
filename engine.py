"""The engine: one step, which generate.py, eval.py's decoding, serve.py and speculative decoding
all drive. A step is three moves (as nano-vllm's `step()`):

    plan = scheduler.schedule()        # what each request feeds, in which cache blocks (scheduler.py)
    out = engine.run(plan)             # one forward for the rides, one for each prompt chunk
    scheduler.postprocess(plan, ...)   # tokens sampled and handed out, full blocks sealed

The KV cache is paged (kvcache.KVCache, blocks.BlockManager): every request holds a block table,
a prefix that another request computed is used where it lies, and the cache's size is a budget of
tokens shared by the requests, not rows of a fixed length. The one-token rows of a step (every
decoding request, and prompt tokens riding along) go through one compiled forward; a prompt that
comes with no request decoding goes in chunks of its own.
"""
import collections
import threading
import time
from typing import Callable, Optional

import torch
from torch import Tensor

import kernels
import liveness
import warmup
from blocks import BlockManager
from checkpoint import huge_page_zeros
from choices import BLOCK_SIZE
from compile import compile_chunk, compile_step, guards_skipped
from errors import UserError, log
from forwards import Feeder, Rides, bucket, forward_chunk, forward_rides, landed, shared
from grammar import token_masks
from memory import Need, check_memory, kv_cache_bytes
from model import Transformer
from rope import recompute_position
from sampling import Sampling, pick_tokens, score_prompt, step_sampling
from scheduler import Request, Scheduler, StepPlan
from stats import Stats, decode_metrics
from thresholds import THRESHOLDS

ONE_SEQUENCE = "speculative decoding runs one sequence at a time: use a single prompt and --batch_size 1"


# ---------------------------------------------------------------- the engine

class Engine:
    """A model, its paged KV cache, a scheduler, and the step that runs them.

    max_batch_size requests run at once (the rows of a step: each decoding request one, prompt
    tokens beside them up to fused_rows); kv_tokens (default max_batch_size * max_seq_length) is
    the cache, in tokens, that they share; max_seq_length caps one request and the length a step
    attends over (rounded up to a power of two with kv_buckets, so that a few graphs serve every
    length; else always max_seq_length, one graph). On CPU a compiled step has at least two rows
    (a lone request beside a padding row) with same_bits, so that a request's output does not
    depend on what runs beside it; on CUDA (pad_rows) a step's rows are padded to a power of two,
    each shape one CUDA graph.

    submit() and cancel() may be called from any thread; step() from one thread only."""

    def __init__(self, model: Transformer, max_batch_size: int = 1, max_seq_length: int = 256,
                 kv_tokens: Optional[int] = None, block_size: int = BLOCK_SIZE, compile: bool = False,
                 compile_mode: str = "default", compile_prefill: bool = False, prefill_chunk: Optional[int] = None,
                 max_waiting: int = 64, prefix_caching: bool = True, fused_rows: Optional[int] = None,
                 pad_rows: Optional[bool] = None, same_bits: bool = False, kv_buckets: bool = False,
                 sample_in_step: bool = True, prepack: bool = False, speculation: Optional[object] = None):
        if prepack:  # steps of many rows: their products read oneDNN's layout of the weights
            kernels.prepack(model)
        self.model, self.device, self.kv_buckets = model, model.norm.weight.device, kv_buckets
        self.block_size, self.compiled = block_size, compile or compile_prefill
        self.sample_in_step = sample_in_step  # rows alike sample inside the compiled step
        self.pad_rows = compile and (self.device.type == "cuda" if pad_rows is None else pad_rows)
        self.min_rows = min(2, max_batch_size + 1) if compile and same_bits else 1
        self.rides = forward_rides
        if compile:  # rows and kv_len vary; on CUDA general in both from the first compile
            self.rides = compile_step(forward_rides, model, compile_mode,
                                      dynamic=True if self.pad_rows and compile_mode != "regional" else None)
        # a short chunk (the tokens a grammar forced, a verify) compiled for any length; prompts eager
        self.short_chunk = compile_chunk(forward_chunk, self.device) if compile else forward_chunk
        self.long_chunk = compile_chunk(forward_chunk, self.device) if compile_prefill else forward_chunk
        if fused_rows is None:  # prompt tokens ride in the step where one kernel serves every row count
            fused = compile and self.device.type == "cpu" and kernels.available() and not self.pad_rows
            fused_rows = 64 if fused else 0
        self.fused_rows, self.prefill_chunk, self.max_waiting = fused_rows, prefill_chunk, max_waiting
        self.forces_whole = True  # feed the tokens a grammar forces as one chunk (jump_forward)
        self.store = None  # the prefix cache on disk (prompt_store.PromptStore), when one is open
        self.speculation = speculation  # verify rows in the step (speculation.Speculation: serve.py --speculative)
        # pipeline parallelism: decoding groups whose steps are in the stages at once (pipeline.py)
        self.groups, self.flights = getattr(model, "groups", 1), collections.deque()  # flights: (plan, *run's out)
        self.setup(max_batch_size, max_seq_length, kv_tokens, prefix_caching)
        self.broadcast: Optional[Callable] = None  # tensor parallelism: rank 0 sends each plan to the others
        self.wakeup = threading.Event()  # set by submit and cancel
        self.steps, self.last_shape, self.compiled_ready = 0, None, None  # ready: graphs compiled aside
        self.on_device = {}  # each Sampling a step met, as the step takes it (sampling.StepSampling)
        # steps run eagerly while the graphs compile aside; under tensor parallelism, how the ranks agree they are ready
        self.eager_steps, self.compiling_aside, self.agree = 0, False, None
        # tensor-parallel ranks each build every step's inputs from the plan, never from their own tokens
        self.continues = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self.lookahead = self.device.type == "cuda" and self.continues  # launch the next step before reading this one's tokens

    @classmethod
    def for_serving(cls, model: Transformer, max_batch_size: int, max_seq_length: int, **options) -> "Engine":
        """The engine as a server runs it: a request's output the same beside any others, steps
        attending over power-of-two lengths, prompts in chunks of 256 tokens, tokens picked on the host."""
        settings = dict(same_bits=True, kv_buckets=True, prefill_chunk=256, sample_in_step=False)
        return cls(model, max_batch_size, max_seq_length, **{**settings, **options})

    def setup(self, max_batch_size: int, max_seq_length: int, kv_tokens: Optional[int] = None,
              prefix_caching: bool = True):
        """A cache of kv_tokens (default max_batch_size * max_seq_length) for up to max_batch_size
        requests of up to max_seq_length tokens; what the old one held is gone."""
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        # the longest cache a step attends over, whole blocks as every bucket is: one graph serves them all
        self.kv_limit = -(-max_seq_length // self.block_size) * self.block_size
        self.allocate(kv_tokens or max_batch_size * max_seq_length, prefix_caching)
        window = self.model.args.sliding_window if any(layer.attention.sliding for layer in self.model.layers) else None
        self.scheduler = Scheduler(self.blocks, max_batch_size, self.fused_rows, self.chunk_tokens(),
                                   self.max_waiting, recompute_position(self.model.args), window, self.window_blocks)
        self.scheduler.jump_forward, self.scheduler.speculation = self.forces_whole, self.speculation
        self.scheduler.group_rows = self.model.group_rows if self.groups > 1 else None
        if self.speculation is not None:  # a step wider than warm-up's would compile while serving
            self.speculation.attach(self.model, self.block_size, warmup.widest_rows(self))

    def chunk_tokens(self) -> int:
        return self.prefill_chunk or self.max_seq_length

    def allocate(self, kv_tokens: int, prefix_caching: bool):
        """The blocks and every layer's slot pool, one block more for padding rows (scratch). In a
        model that mixes sliding-window layers with full attention, the sliding layers have blocks of
        their own, as many as every running request's window and a chunk after it take."""
        bs, args, num_blocks = self.block_size, self.model.args, -(-kv_tokens // self.block_size)
        sliding = [layer.attention.sliding for layer in self.model.layers]
        # a prefix's keys are reused where they do not depend on what follows it, nor leave a window
        prefix_caching = prefix_caching and recompute_position(args) is None and not any(sliding)
        self.blocks = BlockManager(num_blocks, bs, prefix_caching)
        self.blocks.store = self.store
        self.window_blocks, window_slots = None, None
        if any(sliding) and not all(sliding):
            per_request = min(-(-(args.sliding_window + self.chunk_tokens()) // bs), -(-self.max_seq_length // bs)) + 1
            self.window_blocks = BlockManager(self.max_batch_size * per_request, bs, prefix_caching=False)
            window_slots = (self.window_blocks.num_blocks + 1) * bs
        old, dtype, slots = max(self.model.num_slots, 0), self.model.norm.weight.dtype, (num_blocks + 1) * bs
        need = kv_cache_bytes(self.model, 1, slots, dtype) - kv_cache_bytes(self.model, 1, old, dtype)
        if window_slots:  # the sliding layers' share of that is their own pools'
            need = need * sliding.count(False) // len(sliding) + \
                kv_cache_bytes(self.model, 1, window_slots, dtype) * sliding.count(True) // len(sliding)
        check_memory([Need("the KV cache", need, "lower the batch size or the sequence length",
                           f" for {num_blocks * bs} tokens")], self.device)
        self.model.setup_caches(1, self.max_seq_length, num_slots=slots, window_slots=window_slots,
                                zeros=huge_page_zeros, block_size=bs)  # read as weights are, a step at a time
        self.feeder = Feeder(bs, self.device, num_blocks, self.window_blocks.num_blocks if window_slots else None)
        self.last_rides = self.last_out = self.ahead = None

    # ---- from any thread

    @property
    def jump_forward(self) -> bool:
        return self.forces_whole

    @jump_forward.setter
    def jump_forward(self, on: bool):
        self.forces_whole = self.scheduler.jump_forward = on

    @property
    def counters(self):
        return self.scheduler.counters

    def submit(self, request: Request):
        """Queue a request; UserError if it can never fit, QueueFull if too many wait."""
        if not request.prompt:
            raise UserError("the prompt is empty")
        if len(request.prompt) + request.max_new_tokens > self.max_seq_length:
            raise UserError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                            f"exceeds the KV cache (max_seq_length {self.max_seq_length})")
        request.sampling = request.sampling or Sampling()
        if request.seed is not None and request.generator is None:
            request.generator = torch.Generator(self.device).manual_seed(request.seed)
        self.scheduler.add(request)
        self.wakeup.set()

    def cancel(self, request: Request):
        request.cancelled = True
        self.wakeup.set()

    def abort_all(self, reason: str, error: Optional[str] = None):
        """End every running and waiting request (a fault in scheduling, a shutdown)."""
        scheduler = self.scheduler
        with scheduler.lock:
            waiting = list(scheduler.waiting)
            scheduler.waiting.clear()
        for req in list(scheduler.running) + waiting:
            scheduler.finish(req, reason, error)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.flights)

    def forget_prefixes(self):
        """Drop every cached block that no request holds: the next prompt is computed cold."""
        self.blocks.forget_idle()

    def graphs_ready(self) -> bool:
        """Whether the graphs compiled aside are ready; under tensor parallelism, on every rank, so
        that the ranks take them up at the same step."""
        ready = self.compiled_ready is not None
        return ready if self.agree is None else self.agree(ready)

    @property
    def step_compiled(self) -> bool:
        """Whether steps run the compiled graphs (from the next step on, once compiled aside), not
        the eager forward while they compile."""
        return self.rides is not forward_rides or self.compiled_ready is not None

    # ---- the stepping thread

    @torch.inference_mode()
    def step(self) -> bool:
        """Schedule, run and post-process one step. False when there was nothing to do. With decoding
        groups, a step of one-token rows stays in flight: its tokens are collected (land) before its
        requests' next step, so that up to `groups` steps are in the pipeline's stages at once."""
        self.steps += 1
        if len(self.flights) >= self.groups:
            self.land()
        plan = self.scheduler.schedule()
        if plan.empty():
            return self.land()
        start = time.perf_counter()
        try:
            self.sampling_for(plan)
            if self.broadcast is not None:
                self.broadcast(plan.wire())
            flies = self.groups > 1 and not plan.chunks
            out = self.run(plan, fly=flies)
        except Exception as e:  # a fault in the forward pass ends the requests in it, not the engine
            liveness.confirm()  # unless a rank was lost: then this process ends, naming it
            log(f"engine: step failed ({type(e).__name__}: {e})")
            for req in set(plan.requests + plan.chunk_requests):
                self.scheduler.finish(req, "error", f"{type(e).__name__}: {e}")
            return True
        if flies:
            self.flights.append((plan, *out))
            return True
        self.run_ahead(plan)
        self.postprocess(plan, *out)
        if self.speculation is not None and not plan.chunks and len(plan.wants) == len(plan.rides):
            self.speculation.timed(len(plan.rides), time.perf_counter() - start)  # its cost model's step times
        return True

    def land(self) -> bool:
        """Post-process the oldest step in flight, whose tokens it waits for (False: none is)."""
        if not self.flights:
            return False
        self.postprocess(*self.flights.popleft())
        return True

    def run_ahead(self, plan: StepPlan):
        """With lookahead (CUDA), launch the next step before this one's tokens are read back, where
        it will be the same rows one position further: nothing waits, every row sampled in the step,
        none at its last token or needing a block it lacks. The GPU runs it while the host hands
        tokens out; a plan that turns out otherwise drops it (the keys it wrote are its rows' own)."""
        s, bs = self.scheduler, self.block_size
        if not self.lookahead or self.last_out is None or s.waiting or len(s.running) != len(plan.rides) \
                or self.window_blocks is not None or recompute_position(self.model.args) is not None:
            return
        for req, (_, pos, _) in zip(plan.requests, plan.rides):
            if len(req.out) + 2 > req.max_new_tokens or (pos + 1) // bs >= len(req.blocks):
                return
        last = self.last_rides
        if self.kv_buckets and bucket(max(last.positions) + 2, self.kv_limit) != last.kv_len:
            return
        batch = self.feeder.next_rides(last, self.last_out, last.tables)
        self.ahead = (batch, self.call_rides(batch, plan.sampling, None))

    def sampling_for(self, plan: StepPlan):
        """Where the rides' wanted rows all sample alike, with nothing that needs the host (penalties,
        logprobs, their own random stream), they sample inside the compiled step; a grammar's mask
        goes in with them."""
        wanted = [plan.requests[i] for i in plan.wants]
        s = wanted[0].sampling if wanted else None
        if not (self.sample_in_step and wanted and not plan.chunks and not plan.verifies and all(
                r.sampling == s and not s.adjusts and r.logprobs is None and r.generator is None for r in wanted)):
            return
        plan.sampling = s
        if any(r.constraint is not None for r in wanted):
            plan.mask = token_masks([r.constraint for r in wanted], self.model.args.vocab_size).to(self.device)

    def run(self, plan: StepPlan, fly: bool = False) -> tuple[Optional[Tensor], list]:
        """The model's part of a step (every tensor-parallel rank runs it): the rides' wanted rows'
        logits (L, V) or, when the plan samples in the step, their tokens (L, 1), which fly leaves in
        flight (under pipeline parallelism); and each chunk's last logits (V,) (every token's (T, V)
        for a chunk marked so)."""
        # (warmup.compile_aside) from here on, the graphs; the ranks agree at steps every rank runs
        if self.compiling_aside and not plan.empty() and self.graphs_ready():
            (self.rides, self.short_chunk, self.long_chunk), self.compiled_ready = self.compiled_ready, None
            self.last_rides = self.last_out = self.last_shape = None
            self.compiling_aside = False
        self.eager_steps += self.compiling_aside
        out = self.run_rides(plan) if plan.rides else None
        out = out if fly else landed(out)
        if not plan.rides:
            self.last_out = None
        every = [i for i, chunk in enumerate(plan.chunks) if len(chunk) > 3 and chunk[3]]
        prompts = [chunk for i, chunk in enumerate(plan.chunks) if i not in every]
        logits = iter(self.run_prompts(prompts) if prompts else [])
        chunks = [self.run_chunk(*chunk) if i in every else next(logits) for i, chunk in enumerate(plan.chunks)]
        return out, chunks

    def run_prompts(self, chunks: list) -> Tensor:
        """Prompt chunks (tokens, start, tables) in one forward, each padded at its end to the
        longest: each one's last logits (C, V). A few tokens after cached ones (a grammar's forced
        tokens) go alone through the graph compiled for any count."""
        if len(chunks) == 1:
            return self.run_chunk(*chunks[0][:3]).unsqueeze(0)
        T, device = max(len(tokens) for tokens, *_ in chunks), self.device
        rows = [(tokens + [0] * (T - len(tokens)), start, tables) for tokens, start, tables, *_ in chunks]
        kv_len = max(start for _, start, _ in rows) + T
        views = self.feeder.views(rows, self.blocks.blocks_for(kv_len))
        last = torch.tensor([[len(tokens) - 1] for tokens, *_ in chunks], device=device)
        positions = torch.tensor([[start + t for t in range(T)] for _, start, _ in rows], device=device)
        logits = self.long_chunk(self.model, torch.tensor([tokens for tokens, _, _ in rows], device=device), positions,
                                 self.block_size, kv_len, all(start == 0 for _, start, _ in rows), last, **views)
        return logits[:, -1]

    def run_rides(self, plan: StepPlan) -> Tensor:
        """The one-token rows, padded to the step's width; a step of the same requests as the last
        one, one position further, sampling in the step, continues from it on the device."""
        rides, width = plan.rides, self.step_width(len(plan.rides))
        longest = max(pos for _, pos, _ in rides) + 1
        kv_len = bucket(longest, self.kv_limit) if self.kv_buckets else self.kv_limit
        wants = plan.wants + [0] * ((width if self.pad_rows else self.min_rows) - len(plan.wants))
        sampling, mask = plan.sampling, plan.mask
        if mask is not None and len(wants) > mask.shape[0]:  # padding rows allow every token
            mask = torch.cat([mask, mask.new_full((len(wants) - mask.shape[0], mask.shape[1]), -1)])
        positions = [pos for _, pos, _ in rides]
        ahead, self.ahead = self.ahead, None
        if (ahead is not None and ahead[0].requests == plan.requests and sampling is not None and mask is None
                and ahead[0].positions[:len(rides)] == positions and ahead[0].kv_len == kv_len):
            self.last_rides, self.last_out = ahead
            return self.last_out
        if self.last_out is not None and self.feeder.continues(self.last_rides, plan.requests, positions, kv_len):
            batch = self.feeder.next_rides(self.last_rides, self.last_out, [t for _, _, t in rides])
        else:
            rows = rides + [(0, 0, ([], []))] * (width - len(rides))
            batch = self.feeder.rides(rows, plan.requests, wants, kv_len)
        out = self.call_rides(batch, sampling, mask)
        # what the next step may continue from: tokens sampled here, one for every row
        follows = sampling is not None and mask is None and len(plan.wants) == len(rides) and len(wants) == width
        self.last_rides, self.last_out = batch, (out if follows and self.continues else None)
        return out

    def call_rides(self, batch: Rides, sampling: Optional[Sampling], mask: Optional[Tensor]) -> Tensor:
        # a step of the same shapes as the last one runs the graph that one checked its guards for
        inputs = batch.inputs
        if sampling is not None and sampling not in self.on_device:  # its numbers a tensor: one graph for all
            self.on_device[sampling] = step_sampling(sampling, self.model.args.vocab_size, self.device)
        sampling = self.on_device.get(sampling)
        shape = (inputs["tokens"].shape[0], batch.kv_len, inputs["logit_rows"].shape[0],
                 sampling and sampling[:4], None if mask is None else mask.shape)
        same, self.last_shape = shape == self.last_shape, shape
        with guards_skipped(same and self.step_compiled):
            out, batch.following = self.rides(self.model, inputs["tokens"], inputs["positions"], self.block_size, batch.kv_len,
                             inputs["logit_rows"], sampling, mask,
                             **{k: v for k, v in inputs.items() if k not in ("tokens", "positions", "logit_rows")})
        out = shared(self.model, out, wait=False)  # waited for by run, or in flight by its first use
        if self.lookahead:  # a CUDA graph's next replay overwrites its outputs
            out, batch.following = out.clone(), batch.following.clone()
        return out

    def run_chunk(self, tokens: list, start: int, tables: tuple, every: bool = False, tree=None) -> Tensor:
        """tree: a tree.Tree over tokens (speculative.py), or lookahead.Branches, fed with every=True:
        token t at position start + tree.offsets[t], seeing the chunk tokens tree.visible()[t] names."""
        T, device = len(tokens), self.device
        # a few tokens after cached ones (a verify, what a grammar forced): one graph for any count,
        # every token's logits; a prompt: eager (or compiled with compile_prefill), the last one's
        short = T <= THRESHOLDS.attend_max_queries and start > 0
        # a dynamic graph specializes sizes of 1 (a graph more to compile): a lone token gets a padding
        # token beside it, and a table of one block a scratch block after it
        fed = tokens + [0] * (2 - T) if short else tokens
        blocks = self.blocks.blocks_for(start + len(fed))
        views = self.feeder.views([(fed, start, tables)], max(blocks, 2) if short else blocks, real=T)
        last = None if every or short else torch.tensor([[T - 1]], device=device)
        positions = torch.arange(start, start + len(fed), device=device).view(1, -1)
        if tree is not None:  # at least two nodes: no padding
            positions = torch.tensor([[start + d for d in tree.offsets]], device=device)
            views["tree_mask"] = tree.visible(device).unsqueeze(0)
        logits = (self.short_chunk if short else self.long_chunk)(
            self.model, torch.tensor([fed], device=device), positions,
            self.block_size, start + len(fed), start == 0, last, **views)[0]
        return logits[:T] if every else logits[T - 1 if short else -1]

    def step_width(self, rows: int) -> int:
        """The rows a step of `rows` runs with: at least min_rows; with pad_rows, a power of two."""
        width = max(self.min_rows, rows)
        return 1 << (width - 1).bit_length() if self.pad_rows else width

    def postprocess(self, plan: StepPlan, rides_out: Optional[Tensor], chunks_out: list):
        """How far each request fed, and the tokens of those whose feeding is done."""
        fed = collections.Counter(plan.requests)
        for req, (tokens, _, _, *_) in zip(plan.chunk_requests, plan.chunks):
            fed[req] += len(tokens)
        verified = self.verify(plan, rides_out, fed, chunks_out)
        ridden = [(req, j) for j, i in enumerate(plan.wants) if (req := plan.requests[i]) not in plan.verifies]
        if plan.sampling is not None:  # sampled in the step, which had no chunks: rides_out holds tokens
            sampled = {req: t for (req, _), (t,) in zip(ridden, rides_out.tolist())}  # (L, 1): no view, ~15 us
            return self.scheduler.postprocess(plan, fed, sampled, verified)
        ready = [(req, rides_out[j]) for req, j in ridden]
        for req, (tokens, start, _, *every), logits in zip(plan.chunk_requests, plan.chunks, chunks_out):
            if every and every[0] and req not in plan.verifies:  # a prompt scored for its logprobs: (T, V)
                score_prompt(req, start, len(tokens), logits)
                logits = logits[-1]
            if start + len(tokens) == req.length():
                ready.append((req, logits))
        sampled = {}
        if ready:
            try:
                ids = pick_tokens(torch.stack([logits for _, logits in ready]), [r for r, _ in ready])
                sampled = {req: token for (req, _), token in zip(ready, ids)}
            except Exception as e:
                for req, _ in ready:
                    self.scheduler.finish(req, "error", f"sampling failed: {type(e).__name__}: {e}")
        self.scheduler.postprocess(plan, fed, sampled, verified)

    def verify(self, plan: StepPlan, rides_out: Optional[Tensor], fed: collections.Counter, chunks_out: list) -> dict:
        """Each verify's new tokens (request -> its accepted proposals and the target's token after
        them; its rows', or its chunk's), its cache kept up to them (fed): rejected keys are overwritten later."""
        if not plan.verifies:
            return {}
        rows, out = collections.defaultdict(list), dict(zip(plan.chunk_requests, chunks_out))
        for j, i in enumerate(plan.wants):
            rows[plan.requests[i]].append(j)
        verified = {}
        for req, drafts in plan.verifies.items():
            try:
                verified[req] = self.speculation.accept(req, out[req] if req in out else rides_out[rows[req]], drafts)
                fed[req] = len(verified[req])  # its last token and the accepted proposals
            except Exception as e:
                self.scheduler.finish(req, "error", f"verifying failed: {type(e).__name__}: {e}")
        return verified

    def start(self, request: Request):
        """Admit request at once, on whatever the prefix cache holds of it, for a caller that feeds
        it itself (speculative decoding: feed() and keep())."""
        self.submit(request)
        self.scheduler.admit()
        if request not in self.scheduler.running and request.finish_reason is None:  # (a grammar may end it at once)
            raise UserError("the KV cache cannot hold this sequence beside the running ones")

    def feed(self, request: Request, tokens: list, every: bool = False, tree=None) -> Tensor:
        """tokens through the model after request's fed ones, as a step of one chunk: their keys and
        values go to its blocks (taken as needed), and the logits of the last token (V,), or of
        every token (T, V), come back. request.fed does not move: the caller keeps what it accepts.
        tree: a tree.Tree whose nodes are tokens (with every=True), each seeing its ancestors only, or
        lookahead.Branches, each token at its own position seeing what its mask names (run_chunk)."""
        if not self.scheduler.make_room(request, request.fed + len(tokens), StepPlan()):
            raise UserError("the KV cache cannot hold this sequence")
        plan = StepPlan(chunks=[(tokens, request.fed, request.tables(), every, tree)], chunk_requests=[request])
        with torch.inference_mode():
            return self.run(plan)[1][0]

    def keep(self, request: Request, n: int):
        """The first n tokens of the last feed() stay in the cache (full blocks sealed)."""
        request.fed += n
        self.scheduler.seal_full(request)
        self.scheduler.release_out_of_window(request)

    # ---- a batch of prompts, start to end (generate.py)

    @torch.inference_mode()
    def generate(self, prompts: list, max_new_tokens: int, sampling: Sampling, stop_ids=(),
                 on_tokens: Optional[Callable] = None, constraints: Optional[list] = None,
                 logprobs: Optional[int] = None, host: bool = False) -> tuple:
        """Generate for token-id prompts, each a request of its own, stepping until every one ends.
        on_tokens(list of per-row new ids, None for the other rows) is called as tokens arrive; it
        may return rows to end there (a stop string). constraints: per row a grammar.Constraint or
        None; logprobs: record each token's logprob and this many top ones; host: sample on the host.
        Returns (each row's new tokens, ending at and including its stop token, Stats)."""
        stop = frozenset(stop_ids)
        rows = [Request(list(p), max_new_tokens, sampling, stop_ids=stop, logprobs=logprobs,
                        constraint=constraints[b] if constraints else None) for b, p in enumerate(prompts)]
        if on_tokens is not None:
            for b, row in enumerate(rows):
                row.on_token = self.streamer(on_tokens, b, len(rows))
        start, times, first, eager = time.perf_counter(), [], None, self.eager_steps
        in_step, self.sample_in_step = self.sample_in_step, self.sample_in_step and not host
        try:
            for row in rows:
                self.submit(row)
            counts = []  # each row's tokens at the last time taken
            while any(r.finish_reason is None for r in rows):
                if not self.step() and any(r.finish_reason is None for r in rows):  # (a grammar may end one at once)
                    raise UserError("the KV cache cannot hold these prompts")
                now = [len(r.out) for r in rows]
                if first is None and all(now):
                    first, counts = time.perf_counter(), now
                # a time a round: each running row a token on (with decoding groups, a step of each group)
                elif first is not None and now != counts and all(n > c or r.finish_reason
                                                                 for n, c, r in zip(now, counts, rows)):
                    times.append(time.perf_counter())
                    counts = now
        finally:
            self.sample_in_step = in_step
            for row in rows:
                if row.finish_reason is None:
                    self.scheduler.finish(row, "cancelled")
        first = first or time.perf_counter()
        stats = Stats(prompt_tokens=sum(len(p) for p in prompts), new_tokens=sum(len(r.out) for r in rows),
                      ttft_s=first - start, decode_s=(times[-1] if times else first) - first,
                      token_times=[first] + times, batch_size=len(rows), finish_reasons=[r.finish_reason for r in rows],
                      logprobs=[r.token_logprobs for r in rows] if logprobs is not None else [],
                      cached_tokens=sum(r.cached_tokens for r in rows), eager_steps=self.eager_steps - eager)
        return [r.out for r in rows], stats

    @staticmethod
    def streamer(on_tokens: Callable, b: int, rows: int) -> Callable:
        """A request's on_token for row b of rows, through on_tokens(per-row ids): True (stop) when
        on_tokens says the row ends."""
        def on_token(req: Request, token: int) -> bool:
            ids = [None] * rows
            ids[b] = token
            return b in (on_tokens(ids) or ())
        return on_token

    def warm_up(self, prompts: Optional[list], sampling: Sampling, host: bool = False, constrained: bool = False,
                aside: bool = False) -> Optional[threading.Thread]:
        """Compile the graphs generate calls for these prompts (None: a chat's turns) will use, first
        or (aside) on a thread while the eager step runs (warmup.py); the thread, when aside."""
        if not self.compiled:
            return None
        plans = warmup.generate_plans(self, prompts, sampling, host, constrained)
        if aside:
            return warmup.compile_aside(self, plans)
        warmup.compile_now(self, plans)

    def metrics(self, stats: Stats) -> dict:
        return decode_metrics(stats, self.model, self.device)


class Chat:
    """A multi-turn conversation: each turn renders the whole conversation with the chat template;
    the previous turns' blocks are still in the prefix cache, so only what they lack is prefilled."""

    def __init__(self, engine, tokenizer, system: Optional[str] = None, reuse_cache: bool = True):
        self.engine, self.tokenizer, self.reuse_cache = engine, tokenizer, reuse_cache
        self.messages = [{"role": "system", "content": system}] if system else []
        self.last_prompt_tokens = self.last_prefill_tokens = 0

    def reply(self, text: str, max_new_tokens: int, sampling: Sampling, on_tokens=None, **options) -> tuple:
        """The assistant's next turn; options go to the engine's generate (constraints, logprobs)."""
        self.messages.append({"role": "user", "content": text})
        ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(self.messages), add_bos=False)
        room = self.engine.max_seq_length - len(ids)
        if room < 2:
            raise UserError(f"the conversation ({len(ids)} tokens) fills the KV cache; "
                            "start again with a larger --max_seq_length")
        if not self.reuse_cache:
            self.engine.forget_prefixes()
        (out,), stats = self.engine.generate([ids], min(max_new_tokens, room), sampling, self.tokenizer.eos_ids,
                                             on_tokens=on_tokens, **options)
        self.last_prompt_tokens, self.last_prefill_tokens = len(ids), len(ids) - stats.cached_tokens
        reply_ids = out[:-1] if out and out[-1] in self.tokenizer.eos_ids else out
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(reply_ids)})
        return out, stats
