"""What each step computes: the requests, their place in the KV cache's blocks, and the plan of
one step (no torch: the engine runs the plan, and hands the sampled tokens back here).

A request's tokens are its prompt and its output so far; `fed` of them have their keys and values
in the cache, in the blocks of its block table. Every step feeds each running request the tokens
it has not fed yet: one (its last sampled token: decoding), or many (a prompt, a resumed request,
the tokens a grammar forced). A token rides in the step's one forward as a row of its own (every
decoding request, and prompt tokens beside them, `rides`), or a prompt goes in a chunk of its own
(`chunks`). When its last pending token has been fed, its logits give the request its next token.
A decoding request with proposals (serve.py --speculative, speculation.py) feeds its last token and
them, a ride each whose logits are wanted (a verify): it keeps what the target accepts, and the
keys of the rejected ones, past `fed`, are written over by later feeds and never sealed. A
lookahead round goes as a chunk instead (`plan_round`), verified the same way.

Blocks: a request starts on the cached blocks that hold the longest beginning of its tokens
(blocks.BlockManager.match), and takes fresh ones as it grows; a full block is sealed under its
content key for later requests. When a step needs a block and none is free, the most recently
admitted running request is preempted: its blocks go back (cached ones stay cached), and it waits
at the head of the queue to be fed again, through whatever of its prefix is still cached.

Sliding-window layers need only their window's keys: a block of theirs that falls out of the
window goes back (its table entry becomes -1). In a model with only sliding layers those are the
request's blocks; in one that mixes them with full attention, the sliding layers have blocks of
their own (`window_blocks`, from the `window` BlockManager).

Decoding groups (pipeline.py): the engine leaves a step of one-token rows in flight while it plans
the next, so with `group_rows` a plan takes a group's share of the decoding requests, and its
requests are in flight until the step is post-processed: no later plan takes them, nor preempts
them, and the next plan takes the others, groups whose steps run at once.
"""
import collections
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from blocks import ROOT, BlockManager
from errors import UserError

# the prompt rows a step takes beside decoding ones, in units of one row's products: the step reads
# the weights once (as long as STEP_ROWS rows' products on a CPU) and a row attends over its
# positions (one unit per ROW_POSITIONS); at least MIN_PROMPT_ROWS (docs/design.md, "Serving many requests")
STEP_ROWS, ROW_POSITIONS, MIN_PROMPT_ROWS = 32, 100, 8


@dataclass(eq=False)
class Request:
    """One sequence: what it asks for, and its state. The callbacks run on the thread that steps."""
    prompt: list
    max_new_tokens: int
    sampling: Optional[object] = None  # a sampling.Sampling; None: greedy
    seed: Optional[int] = None  # its own random stream: the same tokens whatever runs beside it
    stop_ids: frozenset = frozenset()
    on_token: Optional[Callable] = None  # (request, token id) -> True to stop after this token
    on_finish: Optional[Callable] = None  # (request), once finish_reason is set
    constraint: Optional[object] = None  # a grammar.Constraint: the output must match it
    logprobs: Optional[int] = None  # record each token's logprob and this many top ones
    prompt_logprobs: Optional[int] = None  # ... of the prompt's tokens too (fed afresh, not from the prefix cache)
    speculative: bool = True  # with a scheduler's speculation: propose tokens for it (False: it opts out)
    out: list = field(default_factory=list)  # the new token ids
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled" | "error"
    error: Optional[str] = None
    cached_tokens: int = 0  # leading tokens found in the prefix cache instead of computed
    admitted: int = 0  # its place in the order the requests were admitted
    fed: int = 0  # tokens of prompt + out with their keys and values in the cache
    blocks: list = field(default_factory=list)  # the block table: its blocks in position order (-1: released)
    window_blocks: list = field(default_factory=list)  # the sliding layers' own blocks, where they have them
    keys: list = field(default_factory=list)  # the content key of each sealed (full) block
    cancelled: bool = False  # set from any thread: the request ends at the next step
    preemptions: int = 0
    generator: Optional[object] = None  # the engine's random stream for a seeded request
    token_logprobs: list = field(default_factory=list)
    prompt_token_logprobs: list = field(default_factory=list)  # of prompt tokens 1.. (the first has no context)

    def known(self) -> list:
        return self.prompt + self.out

    def length(self) -> int:  # len(known()) without building it: every step asks, for every request
        return len(self.prompt) + len(self.out)

    def last(self) -> int:
        return self.out[-1] if self.out else self.prompt[-1]

    def scoring(self) -> bool:
        """Whether its prompt's logprobs are still to be computed: every prompt token's logits are wanted."""
        return self.prompt_logprobs is not None and len(self.prompt_token_logprobs) < len(self.prompt) - 1

    def tables(self) -> tuple:
        """The block tables a forward reads: (blocks, window blocks), copied."""
        return list(self.blocks), list(self.window_blocks)

    def take(self, token: Optional[int], jump: bool = True) -> list:
        """The tokens the request gains from sampling `token`: it, then (jump) the ones its grammar
        forces after it, within max_new_tokens. Sets `error` if the grammar rejects the token.
        token None: only what the grammar forces at the start (leaving room for one sampled token)."""
        c = self.constraint
        if c is None:
            return [token]
        if token is not None and not c.accept(token):
            self.error = c.error() or f"the grammar rejects token {token}"
            return [token]
        new = [] if token is None else [token]
        room = self.max_new_tokens - len(self.out) - len(new) - (token is None)
        # forced tokens skip the logits; with logprobs asked for, the mask forces them one step at a time
        jump = jump and self.logprobs is None and not c.done()
        forced = c.forced()[:max(room, 0)] if jump else []
        if forced and not c.accept_all(forced):
            self.error = c.error() or "the grammar rejects its own forced tokens"
            return new
        return new + forced

    def end_reason(self, last: bool = True) -> Optional[str]:
        """Why the request ends after its newest token, if it does: "error" (its grammar rejected a
        token), "stop" (a stop token; or, after the last of the tokens it just gained, a complete
        grammar), "length" (max_new_tokens reached); else None."""
        if self.error:
            return "error"
        if self.out[-1] in self.stop_ids or (last and self.constraint is not None and self.constraint.done()):
            return "stop"
        return "length" if len(self.out) >= self.max_new_tokens else None


@dataclass
class StepPlan:
    """One step: rides (token, position, block table), one token a row, all in one forward, and
    chunks (tokens, start position, block table), each a forward of its own; `wants` the rides
    whose logits are wanted. Plain lists: a tensor-parallel rank 0 sends them to the others
    (`wire`); `requests` and `chunk_requests` stay on its side."""
    rides: list = field(default_factory=list)
    wants: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    requests: list = field(default_factory=list)  # the request of each ride
    chunk_requests: list = field(default_factory=list)
    verifies: dict = field(default_factory=dict)  # request -> its proposals after its last token (rides, or a chunk)
    sampling: Optional[object] = None  # the rides' wanted rows sample inside the step, all alike
    mask: Optional[object] = None  # ... masked by their grammars (bits, grammar.token_masks)

    def wire(self) -> "StepPlan":
        return StepPlan(self.rides, self.wants, self.chunks, sampling=self.sampling)

    def empty(self) -> bool:
        return not self.rides and not self.chunks


class Scheduler:
    """Admits requests, plans each step within max_rows running requests and the cache's blocks,
    preempts when blocks run out, and hands sampled tokens to their requests (postprocess)."""

    def __init__(self, blocks: BlockManager, max_rows: int, fused_rows: int = 0, prefill_chunk: int = 256,
                 max_waiting: int = 64, recompute_at: Optional[int] = None, window: Optional[int] = None,
                 window_blocks: Optional[BlockManager] = None):
        self.blocks, self.max_rows, self.fused_rows = blocks, max_rows, fused_rows
        self.window, self.window_blocks = window, window_blocks  # a sliding window: its length, its own blocks
        self.prefill_chunk, self.max_waiting = prefill_chunk, max_waiting
        self.recompute_at = recompute_at  # a LongRoPE model's switch (rope.recompute_position)
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.lock = threading.Lock()  # submit and cancel come from other threads
        self.admissions = 0
        self.jump_forward = True  # feed the tokens a grammar forces as one chunk (False: one step each)
        self.speculation = None  # proposals for decoding requests (speculation.Speculation), where served
        self.in_flight: set = set()  # with group_rows: the requests of plans not post-processed yet
        self.group_rows: Optional[Callable] = None  # (running requests) -> the decoding rows a plan takes
        self.counters = collections.Counter(prompt_tokens=0, prefilled_tokens=0, cached_tokens=0,
                                            generated_tokens=0, requests_finished=0, preemptions=0,
                                            prefix_queries=0, prefix_hits=0)

    # ---- from any thread

    def add(self, request: Request, queue_first: bool = False):
        """Queue a request; UserError if it could never fit the cache, QueueFull if too many wait."""
        need = self.blocks.blocks_for(len(request.prompt) + request.max_new_tokens)
        if need > self.blocks.num_blocks:
            raise UserError(f"the prompt ({len(request.prompt)} tokens) and max_tokens ({request.max_new_tokens}) "
                            f"need {need} KV cache blocks of {self.blocks.block_size} tokens; the cache has "
                            f"{self.blocks.num_blocks} in all")
        with self.lock:
            free = self.max_rows - len(self.running)  # requests that the next step admits
            if len(self.waiting) >= self.max_waiting + max(free, 0):
                raise QueueFull(f"{len(self.running)} requests are running and {len(self.waiting)} waiting")
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    # ---- the stepping thread

    def schedule(self) -> StepPlan:
        """Finish the cancelled, admit what fits, and plan the step."""
        self.drop_cancelled()
        self.admit()
        plan = StepPlan()
        for req in self.running:
            self.recompute_if_crossing(req)
        decoding = [r for r in self.running if r.length() - r.fed == 1 and r not in self.in_flight]
        if self.group_rows is not None:
            decoding = self.group(decoding)
        for req in list(decoding):
            if req in self.running and not self.make_room(req, req.fed + 1, plan):
                decoding.remove(req)
        decoding = [r for r in decoding if r in self.running]
        proposals = self.speculation.propose(decoding) if self.speculation is not None else {}
        for req in decoding:
            proposal = proposals.get(req, [])
            if not isinstance(proposal, list) and self.plan_round(req, proposal, plan):
                continue
            drafts = self.fit_proposals(req, proposal if isinstance(proposal, list) else [])
            if drafts:
                plan.verifies[req] = drafts
            for j, token in enumerate([req.last()] + drafts):  # a verify: every row's logits
                plan.rides.append((token, req.fed + j, req.tables()))
                plan.wants.append(len(plan.rides) - 1)
                plan.requests.append(req)
        self.plan_prompts(plan)
        if self.group_rows is not None:
            self.in_flight.update(plan.requests + plan.chunk_requests)
        return plan

    def group(self, decoding: list) -> list:
        """A group's step of the decoding requests not in flight: the group_rows that waited longest,
        which go to the back of `running`; none while one alone waits beside steps in flight, to join
        them (a lone row's products take another path than beside others')."""
        if len(decoding) < 2 and self.in_flight:
            return []
        decoding = decoding[:self.group_rows(len(self.running))]
        for req in decoding:
            self.running.remove(req)
            self.running.append(req)
        return decoding

    def fit_proposals(self, req: Request, drafts: list) -> list:
        """As many of req's proposals as its blocks and the free blocks that no running request
        is promised hold (a proposal never preempts), and before a LongRoPE model's switch."""
        m = len(drafts)
        if self.recompute_at is not None:
            m = min(m, self.recompute_at - req.fed - 1)
        groups = [(self.blocks, req.blocks, self.promised())]
        if self.window_blocks:
            groups.append((self.window_blocks, req.window_blocks, 0))

        def short(m: int) -> bool:  # m proposals need blocks that are not spare
            return any(0 < manager.blocks_for(req.fed + 1 + m) - len(table) > manager.free_count() - promised
                       for manager, table, promised in groups)
        while m > 0 and short(m):
            m -= 1
        if m > 0:
            self.make_room(req, req.fed + 1 + m, StepPlan())  # free blocks enough: nobody is preempted
        return drafts[:max(m, 0)]

    def plan_round(self, req: Request, branches, plan: StepPlan) -> bool:
        """A lookahead round (speculation.LookaheadRounds: lookahead.Branches after req's last
        token) as a chunk of its own, every token's logits wanted, verified: if the blocks that
        no running request is promised hold it (it never preempts)."""
        n = len(branches.tokens) - 1  # past the last token
        if len(self.fit_proposals(req, [0] * n)) < n:
            return False
        plan.chunks.append((branches.tokens, req.fed, req.tables(), True, branches))
        plan.chunk_requests.append(req)
        plan.verifies[req] = branches
        return True

    def recompute_if_crossing(self, req: Request):
        """A LongRoPE model's request whose next forward takes it past the switch, with keys rotated
        the short way in its cache, feeds everything again from position 0 (as transformers does)."""
        switch = self.recompute_at
        if switch is not None and 0 < req.fed <= switch < req.length() and req not in self.in_flight:
            self.release(req)

    def drop_cancelled(self):
        with self.lock:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                self.finish(req, "cancelled")
        for req in [r for r in self.running if r.cancelled]:
            self.finish(req, "cancelled")

    def admit(self):
        """Waiting requests join while rows and blocks allow, each on the cached blocks that hold its
        beginning (always leaving one token to feed, whose logits give the next token). It joins
        only if the free blocks cover the rest of its tokens so far, beside what the running ones
        still have to feed; it takes them as it feeds (make_room), so that blocks another request
        is computing right now (a shared system prompt) are never taken twice."""
        with self.lock:
            while self.waiting and len(self.running) < self.max_rows:
                req = self.waiting[0]
                known = req.known()
                cached = [] if req.scoring() else self.blocks.match(known[:len(known) - 1])[0]
                need = self.blocks.blocks_for(len(known)) - len(cached)
                if need + self.promised() > self.blocks.free_count() - sum(self.blocks.refs[b] == 0 for b in cached):
                    break  # it waits for blocks; first come, first served
                self.waiting.popleft()
                self.blocks.acquire(cached)
                req.blocks, req.keys = list(cached), [self.blocks.key[b] for b in cached]
                req.fed = req.cached_tokens = len(cached) * self.blocks.block_size
                self.admissions += 1
                req.admitted = self.admissions
                self.running.append(req)
                self.counters.update(prompt_tokens=len(req.prompt) if not req.preemptions else 0,
                                     cached_tokens=req.fed, prefix_queries=len(known), prefix_hits=req.fed)
                if req.constraint is not None and self.jump_forward and not req.out:
                    lead = req.take(None)  # what the grammar forces first is prefilled with the prompt
                    if lead:
                        self.hand_out(req, lead)

    def promised(self) -> int:
        """Blocks the running requests need for the tokens they know and have no block for yet."""
        return sum(max(0, self.blocks.blocks_for(r.length()) - len(r.blocks)) for r in self.running)

    def make_room(self, req: Request, end: int, plan: StepPlan) -> bool:
        """Blocks for req's positions up to end, preempting the most recently admitted other running
        requests that the plan does not hold yet; False (req itself preempted) when none is left."""
        groups = [(self.blocks, req.blocks)] + ([(self.window_blocks, req.window_blocks)] if self.window_blocks else [])
        for manager, table in groups:
            while (need := manager.blocks_for(end) - len(table)) > 0:
                got = manager.allocate(need)
                if got is not None:
                    table.extend(got)
                    break
                victims = [r for r in self.running if r is not req and r not in plan.requests
                           and r not in plan.chunk_requests and r not in self.in_flight]
                self.preempt(max(victims, key=lambda r: r.admitted) if victims else req)
                if not victims:
                    return False
        return True

    def release(self, req: Request, forget: bool = True):
        """Every block of req goes back; it has fed nothing (forget), or (a finished request) its
        tables stay as the record of where its keys were."""
        self.blocks.release([b for b in req.blocks if b >= 0])
        if self.window_blocks:
            self.window_blocks.release([b for b in req.window_blocks if b >= 0])
        if forget:
            req.blocks, req.window_blocks, req.keys, req.fed = [], [], [], 0

    def release_out_of_window(self, req: Request):
        """The sliding layers' blocks that no later query can see go back: every position of theirs
        is before the window of the next token fed (at req.fed)."""
        if self.window is None:
            return
        manager, table = (self.window_blocks, req.window_blocks) if self.window_blocks else (self.blocks, req.blocks)
        gone = max(0, req.fed - self.window + 1) // manager.block_size  # blocks wholly before the window
        out = [b for b in table[:gone] if b >= 0]
        if out:
            manager.release(out)
            table[:gone] = [-1] * min(gone, len(table))

    def preempt(self, req: Request):
        """Give req's blocks back and queue it first again; it resumes from whatever stays cached."""
        self.running.remove(req)
        self.release(req)
        req.preemptions += 1
        self.counters["preemptions"] += 1
        with self.lock:
            self.waiting.appendleft(req)

    def plan_prompts(self, plan: StepPlan):
        """Prompt tokens (pending past the first) as rides beside decoding rows, up to fused_rows
        rows in all, while their attention costs less than the decoding rows' whole step (or 8
        rows); with no row decoding (or no room), chunks of prefill_chunk tokens of their own."""
        D = len(plan.rides)
        room = self.fused_rows - D if D else 0
        spend = STEP_ROWS + sum(1 + pos / ROW_POSITIONS for _, pos, _ in plan.rides)
        floor, budget, fused = MIN_PROMPT_ROWS, self.prefill_chunk, False
        prefilling = sorted((r for r in self.running if r.length() - r.fed > 1 and r not in self.in_flight),
                            key=lambda r: r.admitted)
        for k, req in enumerate(prefilling):
            scoring = req.scoring()
            if req not in self.running or not scoring and self.waits_for_others(req, prefilling[:k]):
                continue
            if not scoring:
                self.extend_from_cache(req)
            start, known = req.fed, req.known()
            pending = known[start:]
            if not scoring and room > 0 and room >= min(len(pending), MIN_PROMPT_ROWS):
                n = 0
                while n < min(room, len(pending)) and (n < floor or spend > 0):
                    spend -= (start + n) / ROW_POSITIONS
                    n += 1
                if not self.make_room(req, start + n, plan):
                    continue
                for j in range(n):
                    plan.rides.append((pending[j], start + j, req.tables()))
                    plan.requests.append(req)
                if n == len(pending):
                    plan.wants.append(len(plan.rides) - 1)
                floor -= n
                room = room - n if spend > 0 or floor > 0 else 0
                fused = True
                continue
            if fused:  # prompts ride in the step, or go in chunks of their own: not both
                break
            n = min(self.prefill_chunk, len(pending))
            if (n > budget and plan.chunks) or not self.make_room(req, start + n, plan):
                break
            plan.chunks.append((pending[:n], start, req.tables()) + ((True,) if scoring else ()))
            plan.chunk_requests.append(req)
            budget -= n

    def waits_for_others(self, req: Request, ahead: list) -> bool:
        """Whether a request ahead is computing the block req would compute next, with the same
        tokens before it: req waits, and finds that block cached when it is done."""
        bs, start = self.blocks.block_size, req.fed
        if not self.blocks.prefix_caching or start % bs or req.length() - start <= bs:
            return False
        mine = req.known()[:start + bs]
        return any(other.fed < start + bs and other.known()[:start + bs] == mine for other in ahead)

    def extend_from_cache(self, req: Request):
        """A request that has fed whole blocks takes the cached blocks that continue its tokens, in
        place of the fresh ones it holds there."""
        bs, fed = self.blocks.block_size, req.fed
        if not self.blocks.prefix_caching or fed % bs:
            return
        known = req.known()
        cached, _ = self.blocks.match(known[:len(known) - 1])
        more = cached[fed // bs:]
        if not more or cached[:fed // bs] != req.blocks[:fed // bs]:
            return
        self.blocks.acquire(more)
        self.blocks.release(req.blocks[fed // bs:len(cached)])
        req.blocks[fed // bs:len(cached)] = more
        req.keys.extend(self.blocks.key[b] for b in more)
        req.fed += len(more) * bs
        req.cached_tokens += len(more) * bs
        self.counters.update(cached_tokens=len(more) * bs, prefix_hits=len(more) * bs)

    def postprocess(self, plan: StepPlan, fed: dict, sampled: dict, verified: Optional[dict] = None):
        """After the step ran: fed (request -> tokens its keys were written for and kept) advance
        and seal what is full; sampled (request -> token id) go to their requests, and verified
        (request -> a verify's accepted proposals and the target's token after them)."""
        self.in_flight.difference_update(plan.requests + plan.chunk_requests)
        for req, n in fed.items():
            if req.finish_reason is None and req in self.running:
                prompt_part = max(0, min(n, len(req.prompt) - req.fed))
                self.counters["prefilled_tokens"] += prompt_part
                req.fed += n
                self.seal_full(req)
                self.release_out_of_window(req)
        for req, token in sampled.items():
            if req.finish_reason is None and req in self.running and not req.max_new_tokens:
                self.finish(req, "length")  # no new tokens asked for (an echoed prompt alone), its prompt fed
            elif req.finish_reason is None and req in self.running:
                self.hand_out(req, req.take(token, jump=self.jump_forward and token not in req.stop_ids))
        for req, tokens in (verified or {}).items():
            if req.finish_reason is None and req in self.running:
                self.hand_out(req, tokens)

    def seal_full(self, req: Request):
        if not self.blocks.prefix_caching:
            return
        bs = self.blocks.block_size
        full = min(min(req.fed, req.length()) // bs, len(req.blocks))
        if len(req.keys) >= full:
            return  # nothing newly full (most steps): prompt + out is not built
        known = req.known()
        while len(req.keys) < full:
            i = len(req.keys)
            parent = req.keys[-1] if req.keys else ROOT
            # the prompt's blocks go to the store too (a restart meets the same prompts)
            req.keys.append(self.blocks.seal(req.blocks[i], parent, known[i * bs:(i + 1) * bs],
                                             persist=(i + 1) * bs <= len(req.prompt)))

    def hand_out(self, req: Request, tokens: list):
        """A request's new tokens (a sampled one and any its grammar forced after it): to its
        output and its on_token callback, until one ends it."""
        for i, token in enumerate(tokens):
            req.out.append(token)
            self.counters["generated_tokens"] += 1
            try:
                stop = bool(req.on_token(req, token)) if req.on_token else False
            except Exception as e:  # a fault in one request's handling ends that request only
                self.finish(req, "error", f"{type(e).__name__}: {e}")
                return
            reason = "stop" if stop and not req.error else req.end_reason(last=i == len(tokens) - 1)
            if reason is not None:
                self.finish(req, reason, req.error)
                return

    def finish(self, req: Request, reason: str, error: Optional[str] = None):
        """The request ends (its blocks go back, cached ones stay cached), if it has not already."""
        self.in_flight.discard(req)
        if req in self.running:  # (one whose output ended it outside a step still holds its blocks)
            self.running.remove(req)
            self.release(req, forget=False)
        if req.finish_reason is not None:
            return
        req.finish_reason, req.error = reason, error
        self.counters["requests_finished"] += 1
        if self.speculation is not None:
            self.speculation.finish(req)
        if req.on_finish:
            try:
                req.on_finish(req)
            except Exception as e:
                print(f"engine: on_finish failed ({type(e).__name__}: {e})")


class QueueFull(UserError):
    """Every row is busy and the waiting queue is full: try again later."""
