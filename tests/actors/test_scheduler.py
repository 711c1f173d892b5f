"""The scheduler alone: plans and events from hand-built executor results, no model.

A small simulated executor (:class:`Sim`) answers each plan the way the real
one does -- chunks end where the shared rule puts them, decode steps feed
scripted tokens, published blocks are placeholders -- so the policy and the
request life cycle are checked without MLX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import pytest
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.actors.compute_config import SchedulingConfig
from mlxkv.actors.events import (
    ComputeFailed,
    Failed,
    Finished,
    ImagesEncoded,
    Prefilled,
    PromptPublished,
    Published,
    Token,
)
from mlxkv.actors.request import RequestSpec, blocks_out_at_start, next_chunk_end
from mlxkv.actors.plan import Blocks, ChunkDone, Emitted, Plan, RequestFailure, Result
from mlxkv.actors.scheduler import MAX_BURST_STEPS, Scheduler, RequestStatus, chunk_cost

BS = 4
CHUNK = 16
EOS = 99


def _spec(name: str, prompt: int = 10, *, max_tokens: int = 5, prefix_tokens: int = 0, **kw: Any) -> RequestSpec:
    prefix = tuple(_Payload(end) for end in range(BS, prefix_tokens + 1, BS))
    return RequestSpec(
        request_id=name,
        prompt=tuple(range(prompt)),
        prefix=prefix,
        max_tokens=max_tokens,
        block_size=BS,
        stop_tokens=frozenset({EOS}),
        **kw,
    )


class _Payload:
    """Stands for a block payload: only its ``end`` is read."""

    def __init__(self, end: int) -> None:
        self.end = end


def _scheduler(*, recurrent: bool = False, context_unit: int = 512, **kw: Any) -> Scheduler:
    options: dict[str, Any] = dict(
        prefill_chunk=CHUNK, prefill_budget=2 * CHUNK, prefill_batch=4, decode_burst=32, decode_wait=1
    )
    options.update(kw)
    return Scheduler(SchedulingConfig(**options), recurrent=recurrent, context_unit=context_unit)


class Sim:
    """Answers plans as the executor would; ``token(request_id, index)`` scripts tokens."""

    def __init__(self, scheduler: Scheduler, token: Optional[Callable[[str, int], int]] = None) -> None:
        self.scheduler = scheduler
        self.token = token or (lambda request_id, index: 10 + index)
        self.computed: dict[str, int] = {}
        self.fed: dict[str, int] = {}  # answer tokens fed (in the KV)
        self.rows: list[str] = []
        self.plans: list[Plan] = []
        self.events: dict[str, list[Any]] = {}
        self.closed: set[str] = set()
        self.fail: dict[tuple[str, str], Exception] = {}  # (stage, request) -> error
        self.batch_sizes: list[int] = []

    def result(self, plan: Plan) -> Result:
        published, chunks, emitted, steps, failures = [], [], [], [], []

        def failing(stage: str, request_id: str) -> bool:
            error = self.fail.pop((stage, request_id), None)
            if error is None:
                return False
            failures.append(RequestFailure(request_id, error, stage))
            self.computed.pop(request_id, None)
            if request_id in self.rows:
                self.rows.remove(request_id)
            return True

        for piece in plan.publish:
            if not failing("publish", piece.request_id):
                published.append(Blocks(piece.request_id, piece.start, tuple(range(piece.start, piece.stop))))
        for leave in plan.leave:
            if leave.request_id in self.rows:
                self.rows.remove(leave.request_id)
            held = self.computed.pop(leave.request_id, 0) + self.fed.pop(leave.request_id, 0)
            if failing("leave", leave.request_id):
                continue
            if leave.answer is not None:
                start, stop = leave.answer
                stop = min(stop, held // BS)
                if stop > start:
                    published.append(Blocks(leave.request_id, start, tuple(range(start, stop))))
        for request_id in plan.join:
            if request_id in self.computed and not failing("join", request_id):
                self.rows.append(request_id)
                self.fed[request_id] = 0
        for chunk in plan.prefill:
            request_id = chunk.request_id
            if failing("prefill", request_id):
                continue
            started = chunk.spec is not None
            spec = chunk.spec or self.spec(request_id)
            if started:
                self.computed[request_id] = spec.num_prefix_tokens
            end = next_chunk_end(self.computed[request_id], len(spec.prompt), CHUNK)  # as the executor cuts it
            self.computed[request_id] = end
            last = end == len(spec.prompt)
            if not last and chunk.published >= 0:
                start = blocks_out_at_start(spec, spec.num_prefix_tokens) if started else chunk.published
                if end // BS > start:
                    published.append(Blocks(request_id, start, tuple(range(start, end // BS))))
            chunks.append(
                ChunkDone(
                    request_id,
                    end,
                    started=started,
                    num_cached=spec.num_prefix_tokens if started else 0,
                    first_token=self.token(request_id, 0) if last else None,
                )
            )
        for _ in range(plan.steps):
            if not self.rows:
                break
            steps.append(len(self.rows))
            done = False
            for request_id in list(self.rows):
                if failing("decode", request_id):
                    done = True
                    continue
                index = self.fed[request_id]
                self.fed[request_id] += 1
                if index == 0:
                    continue  # the first token, fed now, was sent by the prefill
                token = self.token(request_id, index)
                emitted.append(Emitted(request_id, index, token))
                spec = self.spec(request_id)
                done |= token == EOS or index + 1 >= spec.max_tokens
            if done:
                break
        self.batch_sizes.extend(steps)
        return Result(
            published=tuple(published), chunks=tuple(chunks), emitted=tuple(emitted), steps=tuple(steps),
            failures=tuple(failures),
        )

    def spec(self, request_id: str) -> RequestSpec:
        return next(s.spec for s in self.scheduler.requests() if s.request_id == request_id)

    def take(self, outputs: list[Any]) -> None:
        for request_id, event in outputs:
            assert request_id not in self.closed, f"{request_id} got {event!r} after its end"
            if event is None:
                self.closed.add(request_id)
            else:
                self.events.setdefault(request_id, []).append(event)

    def step(self, **kw: Any) -> Plan:
        plan = self.scheduler.schedule(**kw)
        self.plans.append(plan)
        self.take(self.scheduler.update(plan, self.result(plan)))
        return plan

    def run(self, limit: int = 500) -> None:
        while self.scheduler.has_work():
            self.step()
            limit -= 1
            assert limit, "the scheduler never finished"

    def tokens(self, request_id: str) -> list[int]:
        return [t for e in self.events.get(request_id, []) if isinstance(e, Token) for t in e.tokens]

    def final(self, request_id: str) -> Any:
        return self.events[request_id][-1]


def _decoding(scheduler: Scheduler) -> Sim:
    """A simulation whose batch has a row decoding (a long request), so that
    the prefill budget binds the next prefill plan."""
    sim = Sim(scheduler)
    sim.scheduler.add(_spec("decoder", max_tokens=10_000))
    while not any(s.status is RequestStatus.DECODING for s in sim.scheduler.requests()):
        sim.step()
    return sim


class TestLifeCycle:
    def test_a_request_prefills_in_chunks_decodes_and_finishes(self):
        """Chunks end on the shared rule's multiples; the first token follows the
        last chunk; the answer's blocks and Finished come after the last token."""
        sim = Sim(_scheduler())
        sim.scheduler.add(_spec("a", prompt=40, max_tokens=6))
        sim.run()
        kinds = [type(e) for e in sim.events["a"]]
        assert kinds.index(Prefilled) < kinds.index(Token) < kinds.index(PromptPublished) < kinds.index(Finished)
        assert sim.tokens("a") == [10, 11, 12, 13, 14, 15]
        final = sim.final("a")
        assert isinstance(final, Finished) and final.reason == "length"
        published = [e for e in sim.events["a"] if isinstance(e, Published)]
        starts = [e.start for e in published]
        assert starts == sorted(starts) and sum(len(e.payloads) for e in published) == (40 + 6) // BS
        assert final.num_stored == (40 + 6) // BS * BS
        assert "a" in sim.closed and not sim.scheduler.has_work()

    def test_published_blocks_carry_their_tokens(self):
        """Each Published holds the tokens of its blocks: prompt, then answer."""
        sim = Sim(_scheduler())
        spec = _spec("a", prompt=14, max_tokens=6)
        sim.scheduler.add(spec)
        sim.run()
        answer = sim.tokens("a")
        whole = spec.prompt + tuple(answer)
        for event in sim.events["a"]:
            if isinstance(event, Published):
                assert event.tokens == whole[event.start * BS : (event.start + len(event.payloads)) * BS]

    def test_a_stop_token_ends_it_unsent(self):
        """A stop token is not sent, and the answer's blocks stop before it."""
        sim = Sim(_scheduler(), token=lambda r, i: EOS if i == 3 else 10 + i)
        sim.scheduler.add(_spec("a", max_tokens=10))
        sim.run()
        assert sim.tokens("a") == [10, 11, 12]
        assert isinstance(sim.final("a"), Finished) and sim.final("a").reason == "stop"

    def test_a_request_can_end_at_its_first_token(self):
        """max_tokens=1, or a stop token first: it never joins the batch; its
        blocks are published as it leaves."""
        for token in (10, EOS):
            sim = Sim(_scheduler(), token=lambda r, i, t=token: t)
            sim.scheduler.add(_spec("a", prompt=12, max_tokens=1))
            sim.run()
            assert not any(plan.join for plan in sim.plans)
            assert sim.tokens("a") == ([] if token == EOS else [10])
            assert isinstance(sim.final("a"), Finished)
            assert sum(len(e.payloads) for e in sim.events["a"] if isinstance(e, Published)) == 12 // BS

    def test_held_and_brought_blocks_are_not_published_again(self):
        """Blocks the request holds or brings as payloads are not published."""
        sim = Sim(_scheduler())
        sim.scheduler.add(_spec("a", prompt=30, prefix_tokens=12, held_blocks=5))
        sim.run()
        starts = [e.start for e in sim.events["a"] if isinstance(e, Published)]
        assert starts and min(starts) == 5

    def test_images_encoded_go_out_with_the_first_chunk(self):
        """The encoder's features are handed out once, as its first chunk ran."""
        scheduler = _scheduler()
        scheduler.add(_spec("a"))
        plan = scheduler.schedule()
        chunk = ChunkDone("a", 10, started=True, encoder_ran=True, features="F", first_token=10)
        out = scheduler.update(plan, Result(chunks=(chunk,)))
        encoded = [e for _, e in out if isinstance(e, ImagesEncoded)]
        assert len(encoded) == 1 and encoded[0].features == "F"
        assert scheduler.statistics().num_vision_encoder_runs == 1


class TestBatching:
    def test_requests_join_and_leave_between_steps(self):
        """Rows join the batch while others decode and leave as they finish;
        every request gets exactly its own tokens."""
        sim = Sim(_scheduler(), token=lambda r, i: ord(r) * 100 + i)
        sim.scheduler.add(_spec("a", max_tokens=12))
        for _ in range(3):
            sim.step()
        sim.scheduler.add(_spec("b", max_tokens=4))
        sim.run()
        assert sim.tokens("a") == [ord("a") * 100 + i for i in range(12)]
        assert sim.tokens("b") == [ord("b") * 100 + i for i in range(4)]
        sizes = sim.batch_sizes
        assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1  # a alone, both, a alone again

    def test_a_prefill_plan_serves_several_requests_within_the_budget(self):
        """Requests arriving while others decode prefill in one plan: in arrival
        order, up to the batch size, while their chunks fit the budget (the
        oldest always)."""
        sim = _decoding(_scheduler(prefill_budget=25, prefill_batch=3))
        for name, length in [("a", 10), ("b", 10), ("c", 10), ("d", 10)]:
            sim.scheduler.add(_spec(name, prompt=length))
        plan = sim.scheduler.schedule()
        assert [c.request_id for c in plan.prefill] == ["a", "b"]  # 10 + 10 <= 25 < 30
        big = _decoding(_scheduler(prefill_budget=5))
        big.scheduler.add(_spec("x", prompt=40))
        assert [c.request_id for c in big.scheduler.schedule().prefill] == ["x"]  # the oldest fits anyway

    def test_with_nothing_decoding_the_budget_does_not_bind(self):
        """No decode step waits behind a prefill plan while nothing decodes, so
        requests arriving together then prefill up to the batch size at once
        (as mlx-lm's BatchGenerator prefills a wave): the four requests above
        take the batch size, three, in one plan."""
        sim = Sim(_scheduler(prefill_budget=25, prefill_batch=3))
        for name, length in [("a", 10), ("b", 10), ("c", 10), ("d", 10)]:
            sim.scheduler.add(_spec(name, prompt=length))
        plan = sim.step()
        assert [c.request_id for c in plan.prefill] == ["a", "b", "c"]
        joined = sim.step()  # fewer wait (d) than would decode (a, b, c): they decode first
        assert joined.join == ("a", "b", "c") and joined.steps and not joined.prefill
        assert [c.request_id for c in sim.step().prefill] == ["d"]

    def test_a_refill_shares_the_budgets_of_the_plans_it_may_run_in_a_row(self):
        """While more requests wait than decode, a decode step may wait behind
        ``decode_wait`` prefill plans: their budgets are one, which a plan takes
        as far as its chunks need (batched, not a chunk a plan while the batch
        fills a row at a time); once it is spent the batch decodes."""
        sim = _decoding(_scheduler(prefill_budget=11, prefill_batch=8, decode_wait=3))
        for name in "abcde":
            sim.scheduler.add(_spec(name, prompt=10))  # each chunk costs 10.1
        assert [c.request_id for c in sim.step().prefill] == ["a", "b", "c"]  # 30.3 of 3 x 11
        spent = sim.step()
        assert spent.steps and not spent.prefill  # d would make it 40.4
        assert [c.request_id for c in sim.step().prefill] == ["d"]  # 4 rows, 2 wait: one plan's budget

    def test_a_refill_after_a_wave_has_the_whole_shared_budget(self):
        """The rows a refill's plans ran beside are gone (cancelled) by the time
        a wave prefills: the next refill does not count what they waited behind."""
        sim = _decoding(_scheduler(prefill_budget=11, prefill_batch=8, decode_wait=3))
        for name in "abcde":
            sim.scheduler.add(_spec(name, prompt=10))
        assert [c.request_id for c in sim.step().prefill] == ["a", "b", "c"]  # 30.3 of 33 spent
        for name in ("decoder", "a", "b", "c"):
            sim.scheduler.cancel(name)
        assert [c.request_id for c in sim.step().prefill] == ["d", "e"]  # a wave: nothing decodes
        for name in "fghij":
            sim.scheduler.add(_spec(name, prompt=10))
        assert [c.request_id for c in sim.step().prefill] == ["f", "g", "h"]  # 2 rows, 5 wait: all 33 again

    def test_a_one_token_request_keeps_the_budget_in_a_wave(self):
        """A request that will not decode (one token) ends a wave: its chunk,
        and those after it, fit the budget (its first token is its answer;
        batching it with the others' chunks would only delay it)."""
        sim = Sim(_scheduler(prefill_budget=25, prefill_batch=4))
        for name, tokens in [("a", 5), ("b", 5), ("one", 1), ("c", 5)]:
            sim.scheduler.add(_spec(name, prompt=10, max_tokens=tokens))
        assert [c.request_id for c in sim.step().prefill] == ["a", "b"]  # 20 + 10 > 25 at "one"
        alone = Sim(_scheduler(prefill_budget=25, prefill_batch=4))
        for name in ("x", "y", "z"):
            alone.scheduler.add(_spec(name, prompt=10, max_tokens=1))
        assert [c.request_id for c in alone.step().prefill] == ["x", "y"]  # the budget, as while rows decode

    def test_a_chunk_after_a_long_context_takes_more_of_the_budget(self):
        """The budget counts cost (chunk_cost): the same 9 new tokens after 32
        cached ones cost 29.5 with a context unit of 16, after none 11.5: a
        budget of 60 takes five fresh requests' chunks but only two late ones."""
        assert chunk_cost(0, 9, 16) == 11.53125 and chunk_cost(32, 41, 16) == 29.53125
        fresh = _decoding(_scheduler(prefill_budget=60, prefill_batch=8, context_unit=16))
        late = _decoding(_scheduler(prefill_budget=60, prefill_batch=8, context_unit=16))
        for k in range(6):
            fresh.scheduler.add(_spec(f"f{k}", prompt=9))
            late.scheduler.add(_spec(f"l{k}", prompt=41, prefix_tokens=32))
        assert [c.budgeted_end for c in fresh.scheduler.schedule().prefill] == [9] * 5  # 5 x 11.5 <= 60 < 6 x 11.5
        assert [c.budgeted_end for c in late.scheduler.schedule().prefill] == [41, 41]  # 2 x 29.5 <= 60 < 3 x 29.5

    def test_the_first_chunk_starts_from_the_prefix(self):
        """A request's first chunk carries its spec and ends past its cached prefix."""
        scheduler = _scheduler()
        scheduler.add(_spec("a", prompt=40, prefix_tokens=20))
        (chunk,) = scheduler.schedule().prefill
        assert chunk.spec is not None and chunk.budgeted_end == next_chunk_end(20, 40, CHUNK)


class TestFairness:
    def test_decode_and_prefill_plans_alternate(self):
        """Between two decode plans runs at most one prefill plan, and between two
        prefill plans at most one decode plan, while both have work."""
        sim = Sim(_scheduler(prefill_budget=CHUNK, prefill_batch=1))
        sim.scheduler.add(_spec("decoder", max_tokens=200))
        while not any(s.status is RequestStatus.DECODING for s in sim.scheduler.requests()):
            sim.step()
        for k in range(4):
            sim.scheduler.add(_spec(f"long{k}", prompt=6 * CHUNK))
        kinds = ""
        while any(s.request_id.startswith("long") and s.status is not RequestStatus.DECODING for s in sim.scheduler.requests()):
            plan = sim.step()
            assert len(kinds) < 200
            assert not (plan.steps and plan.prefill), "a plan decodes or prefills"
            kinds += "d" if plan.steps else "p" if plan.prefill else ""
        assert kinds.count("p") == 4 * 6  # every chunk of the four long prompts ran
        assert "pp" not in kinds
        assert "dd" not in kinds[: kinds.rfind("p")]

    @pytest.mark.parametrize(("wait", "kinds"), [(1, "pdpdpd"), (2, "ppdpdp"), (8, "pppdpd")])
    def test_a_wave_of_arrivals_prefills_first(self, wait, kinds):
        """Six requests at once, one prefilled a plan: a prefill plan follows a
        prefill plan while more requests wait than decode (5 > 1, 4 > 2, not
        3 > 3), at most ``decode_wait`` in a row; then they alternate."""
        sim = Sim(_scheduler(prefill_batch=1, decode_wait=wait))
        for k in range(6):
            sim.scheduler.add(_spec(f"r{k}", max_tokens=20))
        plans = [sim.step() for _ in range(len(kinds))]
        assert "".join("d" if p.steps else "p" for p in plans) == kinds

    def test_as_many_decoding_as_waiting_alternate(self):
        """One long prompt beside one decoding request: they alternate whatever
        ``decode_wait`` (a decode step serves as many as it holds up)."""
        sim = Sim(_scheduler(prefill_budget=CHUNK, prefill_batch=1, decode_wait=8))
        sim.scheduler.add(_spec("decoder", max_tokens=200))
        while not any(s.status is RequestStatus.DECODING for s in sim.scheduler.requests()):
            sim.step()
        sim.scheduler.add(_spec("long", prompt=6 * CHUNK))
        kinds = ""
        while sim.scheduler.requests() and any(s.request_id == "long" and s.status is not RequestStatus.DECODING for s in sim.scheduler.requests()):
            plan = sim.step()
            kinds += "d" if plan.steps else "p" if plan.prefill else ""
        assert kinds.count("p") == 6 and "pp" not in kinds

    @settings(max_examples=examples(60), deadline=None)
    @given(
        st.lists(st.tuples(st.integers(1, 80), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=8),
        st.integers(1, 64),
        st.integers(1, 4),
        st.sampled_from([8, 64, 512]),
        st.integers(1, 4),
    )
    def test_the_bound_holds_for_any_mix(self, requests, budget, batch, unit, wait):
        """For any requests (prompt, max tokens, arrival plan): every prefill plan
        serves at most ``batch`` requests; while a row decodes, one where no more
        requests wait than decode costs at most max(budget, its oldest chunk's
        cost) and so runs at most max(budget, chunk + 1) new tokens; a decode
        step waits behind at most ``decode_wait`` prefill plans (a second in a
        row only while more requests wait than decode) of cost at most
        max(decode_wait x budget, the first one's oldest chunk's) together; and
        every request finishes with its tokens."""
        sim = Sim(_scheduler(prefill_budget=budget, prefill_batch=batch, context_unit=unit, decode_wait=wait))
        pending = sorted(((arrive, k, p, m) for k, (p, m, arrive) in enumerate(requests)), reverse=True)
        plans = 0
        since_decode = 0
        waited = [0.0, 0]  # cost and new tokens a decode step waits behind, since the last
        while pending or sim.scheduler.has_work():
            while pending and pending[-1][0] <= plans:
                _, k, p, m = pending.pop()
                sim.scheduler.add(_spec(f"r{k}", prompt=p, max_tokens=m))
            if not sim.scheduler.has_work():
                plans += 1
                continue
            statuses = [s.status for s in sim.scheduler.requests()]
            rows = sum(s in (RequestStatus.DECODING, RequestStatus.JOINING) for s in statuses)
            waiting = sum(s in (RequestStatus.WAITING, RequestStatus.PREFILLING) for s in statuses)
            decoding = rows > 0
            before = dict(sim.computed)
            plan = sim.step()
            plans += 1
            assert plans < 2000
            new = sum(sim.computed.get(c.request_id, 0) - before.get(c.request_id, 0) for c in plan.prefill)
            if plan.prefill:
                costs = [chunk_cost(before.get(c.request_id, 0), sim.computed[c.request_id], unit) for c in plan.prefill if c.request_id in sim.computed]
                assert len(plan.prefill) <= batch
                assert new <= len(plan.prefill) * (CHUNK + 1)
                if decoding:  # with nothing decoding, no step waits: the budget does not bind
                    if not since_decode:
                        first = costs[0] if costs else 0.0
                    waited[0] += sum(costs)
                    waited[1] += new
                    assert waited[0] <= max(wait * budget, first) + 1e-9
                    assert waited[1] <= max(wait * budget, CHUNK + 1)
                    if waiting <= rows:  # not a refill: one plan's budget
                        assert new <= max(budget, CHUNK + 1)
                        assert sum(costs) <= max(budget, costs[0]) + 1e-9
                else:  # ... but for requests that will decode
                    wave = 0
                    while wave < len(plan.prefill) and sim.spec(plan.prefill[wave].request_id).max_tokens > 1:
                        wave += 1
                    assert wave == len(plan.prefill) or sum(costs) <= max(budget, costs[0]) + 1e-9
            if plan.steps:
                waited = [0.0, 0]
            if decoding:
                since_decode = 0 if plan.steps else since_decode + bool(plan.prefill)
                assert since_decode <= wait
                assert since_decode <= 1 or waiting > rows
        for k, (_, m, _) in enumerate(requests):
            assert len(sim.tokens(f"r{k}")) == m
            assert isinstance(sim.final(f"r{k}"), Finished)

    def test_a_burst_only_while_nothing_else_waits(self):
        """Alone, a batch decodes a burst; with messages waiting, prefill pending
        or blocks to publish (someone may wait for them), one step."""
        sim = Sim(_scheduler(decode_burst=32))
        sim.scheduler.add(_spec("a", max_tokens=100))
        while not any(s.status is RequestStatus.DECODING for s in sim.scheduler.requests()):
            sim.step()
        assert sim.step().steps == MAX_BURST_STEPS
        assert sim.step(messages_waiting=True).steps == 1
        sim.scheduler.add(_spec("b", prompt=3 * CHUNK))
        plans = [sim.step() for _ in range(4)]
        assert all(p.steps in (0, 1) for p in plans)


class TestPublishing:
    def test_the_last_chunk_publishes_in_a_short_plan(self):
        """The last chunk's blocks go out in the very next plan, which decodes at
        most one step: requests waiting for them are not held back by a burst."""
        sim = Sim(_scheduler())
        sim.scheduler.add(_spec("a", prompt=12))
        first = sim.step()
        assert first.prefill and sim.tokens("a") == [10]
        second = sim.step()
        assert [p.request_id for p in second.publish] == ["a"] and second.join == ("a",)
        assert second.steps == 1
        assert any(isinstance(e, PromptPublished) for e in sim.events["a"])

    def test_unsliceable_kv_stops_publishing(self):
        """Blocks that cannot be sliced exactly are never asked for again
        (later chunks publish nothing, the last chunk's blocks are not sliced);
        the request still finishes."""
        scheduler = _scheduler()
        scheduler.add(_spec("a", prompt=40, max_tokens=2))
        plan = scheduler.schedule()
        (chunk,) = plan.prefill
        done = ChunkDone("a", chunk.budgeted_end, started=True)
        out = scheduler.update(plan, Result(chunks=(done,), published=(Blocks("a", 0, (), exact=False),)))
        assert not any(isinstance(e, Published) for _, e in out)
        assert scheduler.statistics().num_unpublishable == 1
        sim = Sim(scheduler)
        sim.computed["a"] = done.computed  # its first chunk ran outside the simulation
        while scheduler.has_work():
            plan = sim.step()
            assert not plan.publish and all(c.published < 0 for c in plan.prefill)
            assert all(leave.answer is None for leave in plan.leave)
        assert not any(isinstance(e, Published) for e in sim.events["a"])
        assert isinstance(sim.final("a"), Finished)

    def test_a_chunk_publishes_its_blocks_in_its_own_plan(self):
        """A chunk that is not the prompt's last is told which blocks are out,
        so its executor slices the rest it completed right after it."""
        scheduler = _scheduler()
        scheduler.add(_spec("a", prompt=40, prefix_tokens=8))
        first = scheduler.schedule().prefill[0]
        assert first.spec is not None
        sim = Sim(scheduler)
        sim.step()
        (second,) = sim.step().prefill
        assert second.spec is None and second.published == 16 // BS


def _cancel_when(status: RequestStatus, sim: Sim, name: str) -> None:
    for _ in range(50):
        state = next((s for s in sim.scheduler.requests() if s.request_id == name), None)
        if state is not None and state.status is status:
            sim.take(sim.scheduler.cancel(name))
            return
        sim.step()
    raise AssertionError(f"{name} never reached {status}")


class TestCancellation:
    @pytest.mark.parametrize(
        "status", [RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.JOINING, RequestStatus.DECODING]
    )
    def test_in_every_status(self, status):
        """A cancelled request gets nothing more, its streams end at once, the
        executor lets go of it in the next plan, and the others finish."""
        sim = Sim(_scheduler())
        sim.scheduler.add(_spec("other", max_tokens=8))
        sim.scheduler.add(_spec("victim", prompt=3 * CHUNK, max_tokens=8))
        _cancel_when(status, sim, "victim")
        seen = len(sim.events.get("victim", []))
        assert "victim" in sim.closed
        sim.run()
        assert len(sim.events.get("victim", [])) == seen
        assert not any(isinstance(e, (Finished, Failed)) for e in sim.events.get("victim", []))
        assert "victim" not in sim.computed and "victim" not in sim.rows
        assert len(sim.tokens("other")) == 8
        assert sim.scheduler.statistics().num_cancelled == 1

    def test_unknown_and_finished_are_ignored(self):
        """Cancelling what is not live changes nothing."""
        sim = Sim(_scheduler())
        sim.scheduler.add(_spec("a"))
        sim.run()
        assert sim.scheduler.cancel("a") == [] and sim.scheduler.cancel("nobody") == []
        assert sim.scheduler.statistics().num_cancelled == 0


class TestFailures:
    @pytest.mark.parametrize("stage", ["prefill", "publish", "join", "decode", "leave"])
    def test_in_every_stage(self, stage):
        """A failure the executor reports for one request fails it (Failed with a
        ComputeFailed and the cause, then the end of its streams); tokens it was
        sent stand; the others finish."""
        sim = Sim(_scheduler(), token=lambda r, i: 10 + i)
        sim.scheduler.add(_spec("other", max_tokens=6))
        sim.scheduler.add(_spec("victim", prompt=20, max_tokens=6))
        cause = RuntimeError("injected")
        sim.fail[(stage, "victim")] = cause
        sim.run()
        final = sim.final("victim")
        assert isinstance(final, Failed) and isinstance(final.error, ComputeFailed)
        assert final.error.cause is cause and "victim" in sim.closed
        assert (stage, "victim") not in sim.fail, "the failure was injected"
        assert len(sim.tokens("other")) == 6 and isinstance(sim.final("other"), Finished)
        assert sim.tokens("victim") == [10 + i for i in range(len(sim.tokens("victim")))]
        assert not sim.scheduler.has_work()

    def test_a_decode_failure_keeps_the_tokens_before_it(self):
        """Tokens a row emitted in the plan whose later step failed still reach it,
        before its Failed."""
        scheduler = _scheduler()
        scheduler.add(_spec("a", max_tokens=10))
        sim = Sim(scheduler)
        while not any(s.status is RequestStatus.DECODING for s in scheduler.requests()):
            sim.step()
        plan = scheduler.schedule()
        result = Result(
            emitted=(Emitted("a", 1, 11), Emitted("a", 2, 12)),
            steps=(1, 1, 1),
            failures=(RequestFailure("a", RuntimeError("sampler"), "decode"),),
        )
        sim.take(scheduler.update(plan, result))
        assert sim.tokens("a") == [10, 11, 12]
        assert isinstance(sim.final("a"), Failed)

    def test_a_failure_after_the_last_token_is_no_failure_of_the_request(self):
        """A row that emitted its last token in the plan finishes; a failure the
        executor reported with it does not fail the request that has every token."""
        scheduler = _scheduler()
        scheduler.add(_spec("a", max_tokens=3))
        sim = Sim(scheduler)
        while not any(s.status is RequestStatus.DECODING for s in scheduler.requests()):
            sim.step()
        plan = scheduler.schedule()
        result = Result(
            emitted=(Emitted("a", 1, 11), Emitted("a", 2, 12)),
            steps=(1, 1, 1),
        )
        sim.take(scheduler.update(plan, result))
        sim.run()
        assert sim.tokens("a") == [10, 11, 12] and isinstance(sim.final("a"), Finished)


class TestStatistics:
    def test_counts_follow_the_work(self):
        """Chunks, tokens, steps and rows are counted as the results report them."""
        sim = Sim(_scheduler())
        sim.scheduler.add(_spec("a", prompt=40, max_tokens=4))
        sim.scheduler.add(_spec("b", prompt=8, max_tokens=4, prefix_tokens=4))
        sim.run()
        stats = sim.scheduler.statistics()
        assert stats.num_live == stats.num_prefilling == stats.num_decoding == 0
        assert stats.num_prefill_tokens == 40 + 4
        assert stats.num_cached_tokens == 4
        assert stats.num_decode_rows >= stats.num_decode_steps > 0
