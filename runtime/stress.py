"""Stress test of a CacheRuntime: many clients, shared prefixes, faults, checks.

K clients issue random fetch / store / fork / release calls over a few shared
prompt prefixes, for N operations or T seconds, whichever ends first. Faults
can be switched on: random cancellations (a deadline that lands anywhere in a
call), injected errors (a :class:`InjectedFault` raised inside an actor's
handler before it acts) and a block pool so small that eviction runs all the
time. Clients run in rounds of ``check_every`` operations; after each round,
with no call in flight, every invariant is checked, including that block
references equal what request tables hold. At the end every request is
released and nothing may stay referenced.

With a model, clients also generate: prompts over a few shared prefixes,
so that requests arriving together wait for each other's prefix blocks in
flight and decode in one batch, with the same random cancellations and
injected failures (a failing ``Generate`` is a computing request that fails
while others wait for its blocks). After each round, with no call in flight,
no request may be live in the compute actor and no block claimed. At the
end, with faults off, finished generations (up to ``verify`` of them) are
computed again cold, under a cache salt of their own, and must give the
same tokens: the built-in models' greedy tokens depend on the KV they
attend to, so a wrong cached prefix, a mixed-up batch row or a stale kept
cache shows here. Two exact paths round differently (more so on a GPU,
whose float32 products MLX takes with TF32-like inputs), so a generation
whose cold run parts from it first where the two choices are at a tie
within float noise is counted apart, not a violation: measured once the
runtime has closed, with the model loaded by mlx-lm outside it
(:mod:`mlxkv.divergence`), so no cache under test can widen the noise.

Used by ``mlxkv stress``, ``scripts/stress.py`` and the test suite.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any, Optional

import anyio
import attrs

from mlxkv.actors.actor import Message
from mlxkv.actors.model_info import ModelInfo
from mlxkv.actors.model_source import check_model_source
from mlxkv.cache.errors import CacheError, InvalidInput, OutOfBlocks
from mlxkv.divergence import first_divergence
from mlxkv.errors import RuntimeClosed
from mlxkv.runtime import CacheRuntime

__all__ = ["InjectedFault", "OperationStatistics", "StressConfig", "StressReport", "run_stress"]

_KINDS = ("fetch", "store", "fork", "release", "generate")

#: Messages that take or hand over something: where an injected error must be
#: rolled back. Releasing messages (Close, Release, Discard) are never faulted:
#: a release that fails is a leak by definition, not a fault to survive.
_FAULTABLE = frozenset(
    {"Begin", "Acquire", "StoreBlocks", "Retain", "Snapshot", "Extend", "Record", "Adopt", "Generate"}
)


class InjectedFault(CacheError):
    """An error the stress test raised inside a handler, before it acted."""

    def __init__(self, actor: str, message: str) -> None:
        self.actor = actor
        self.message = message
        super().__init__(f"injected fault in {actor} handling {message}")


def _rate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidInput(attribute.name, value, "must be a number in [0, 1]")


def _at_least(minimum: float) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            raise InvalidInput(attribute.name, value, f"must be a number >= {minimum}")

    return check


@attrs.frozen(kw_only=True)
class StressConfig:
    """One stress run.

    Attributes:
        clients: concurrent clients.
        operations: the most operations in all.
        duration: the most seconds.
        check_every: operations per round; invariants are checked between.
        seed: seeds the workload (trio still shuffles the scheduling).
        block_size: tokens per block.
        max_blocks: usable blocks in the pool; small values make eviction constant.
        num_prefixes: shared prompt prefixes the clients draw from.
        prefix_blocks: full blocks in each shared prefix.
        max_held: requests a client holds at once.
        cancel_rate: probability that a call runs under a random deadline.
        error_rate: probability that a faultable message fails in its handler.
        backend: ``"asyncio"`` or ``"trio"``.
        model: a model directory: clients also generate (see the module
            docstring); None for the cache alone.
        generate_rate: with a model, the share of operations that are
            generations.
        verify: with a model, the most finished generations computed again
            cold at the end, whose tokens must match.
        kv_tiers: with a model, tiers below the pool (URLs, see
            ``RuntimeConfig.kv_tiers``): evicted prefixes come back from them.
    """

    clients: int = attrs.field(default=16, validator=_at_least(1))
    operations: int = attrs.field(default=20_000, validator=_at_least(1))
    duration: float = attrs.field(default=10.0, validator=_at_least(0.0))
    check_every: int = attrs.field(default=1_000, validator=_at_least(1))
    seed: int = 0
    block_size: int = attrs.field(default=4, validator=_at_least(1))
    max_blocks: int = attrs.field(default=512, validator=_at_least(1))
    num_prefixes: int = attrs.field(default=6, validator=_at_least(1))
    prefix_blocks: int = attrs.field(default=6, validator=_at_least(0))
    max_held: int = attrs.field(default=4, validator=_at_least(1))
    cancel_rate: float = attrs.field(default=0.0, validator=_rate)
    error_rate: float = attrs.field(default=0.0, validator=_rate)
    backend: str = attrs.field(default="asyncio")
    model: Optional[str] = None
    generate_rate: float = attrs.field(default=0.2, validator=_rate)
    verify: int = attrs.field(default=64, validator=_at_least(0))
    kv_tiers: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @backend.validator
    def _check_backend(self, attribute: attrs.Attribute, value: Any) -> None:
        if value not in ("asyncio", "trio"):
            raise InvalidInput("backend", value, "must be 'asyncio' or 'trio'")


@attrs.frozen(kw_only=True)
class OperationStatistics:
    """Latency of one kind of operation (completed, cancelled or failed).

    Attributes:
        kind: ``fetch``, ``store``, ``fork`` or ``release``.
        count: operations of this kind issued.
        completed: of those, operations that returned (not cancelled,
            refused or failed).
        p50_ms: median latency.
        p99_ms: 99th-percentile latency.
    """

    kind: str
    count: int
    completed: int
    p50_ms: float
    p99_ms: float


@attrs.frozen(kw_only=True)
class StressReport:
    """What a stress run did and found.

    Attributes:
        config: the run's configuration.
        operations: operations issued.
        seconds: wall time of the workload.
        per_kind: latency per operation kind.
        fetches: fetch calls that completed (the fetch row's ``completed``).
        hits: of those, fetches that got at least one cached block.
        hit_tokens: cached tokens those fetches got.
        evictions: cached blocks evicted by the allocator.
        cancellations: calls that ended cancelled.
        injected_errors: calls that failed with an injected fault.
        out_of_blocks: stores refused for lack of blocks.
        generations: generations that finished.
        generated_tokens: tokens they generated.
        shared_waits: generations that waited for a prefix in flight.
        token_checks: finished generations computed again cold whose tokens
            matched.
        token_ties: of the rest, those whose cold run parted from them first
            at a tie within float noise (any other mismatch is a violation).
        mean_batch_size: requests per decode model call, on average.
        checks: invariant checks passed.
        leaked_blocks: blocks still referenced after every request ended.
        open_tables: request tables left after every request ended.
        violations: everything that went wrong (empty on success).
        tier_blocks_loaded: blocks prompts continued from the tiers (0 without).
        tier_blocks_written: blocks written behind to the tiers (the most any
            one tier wrote).
    """

    config: StressConfig
    operations: int
    seconds: float
    per_kind: tuple[OperationStatistics, ...]
    fetches: int
    hits: int
    hit_tokens: int
    evictions: int
    cancellations: int
    injected_errors: int
    out_of_blocks: int
    generations: int
    generated_tokens: int
    shared_waits: int
    token_checks: int
    mean_batch_size: float
    checks: int
    leaked_blocks: int
    open_tables: int
    violations: tuple[str, ...]
    tier_blocks_loaded: int = 0
    tier_blocks_written: int = 0
    token_ties: int = 0

    @property
    def ok(self) -> bool:
        """Whether no violation was found."""
        return not self.violations

    def format(self) -> str:
        """The human-readable summary."""
        c = self.config
        rate = self.operations / self.seconds if self.seconds else 0.0
        lines = [
            f"mlxkv stress: {self.operations} operations in {self.seconds:.2f} s"
            f" ({rate:,.0f} ops/s), {c.clients} clients, backend {c.backend}",
            f"  pool {c.max_blocks} blocks of {c.block_size} tokens;"
            f" faults: cancel {c.cancel_rate:.0%}, errors {c.error_rate:.0%}",
            f"  {'operation':<10}{'issued':>8}{'completed':>11}{'p50 ms':>10}{'p99 ms':>10}",
        ]
        for row in self.per_kind:
            lines.append(
                f"  {row.kind:<10}{row.count:>8}{row.completed:>11}{row.p50_ms:>10.3f}{row.p99_ms:>10.3f}"
            )
        share = self.hits / self.fetches if self.fetches else 0.0
        lines += [
            f"  hits: {self.hits} of {self.fetches} completed fetches ({share:.1%}),"
            f" {self.hit_tokens} cached tokens",
            f"  evictions: {self.evictions}  cancellations: {self.cancellations}"
            f"  injected errors: {self.injected_errors}  out of blocks: {self.out_of_blocks}",
            *(
                [
                    f"  generations: {self.generations} finished, {self.generated_tokens} tokens,"
                    f" {self.shared_waits} waited for a prefix in flight,"
                    f" mean decode batch {self.mean_batch_size:.1f}",
                    f"  token checks: {self.token_checks} generations matched a cold run"
                    + (f", {self.token_ties} parted from it at a tie within float noise" if self.token_ties else ""),
                ]
                if c.model
                else []
            ),
            *(
                [
                    f"  tiers ({', '.join(c.kv_tiers)}): {self.tier_blocks_loaded} blocks loaded,"
                    f" {self.tier_blocks_written} written"
                ]
                if c.kv_tiers
                else []
            ),
            f"  invariant checks passed: {self.checks}  leaked blocks: {self.leaked_blocks}"
            f"  open tables: {self.open_tables}",
            "  violations: " + ("none" if self.ok else f"{len(self.violations)}"),
        ]
        lines += [f"    - {violation}" for violation in self.violations[:20]]
        return "\n".join(lines)


@attrs.define
class _Held:
    tokens: tuple[int, ...]
    num_blocks: int


@attrs.define
class _Tally:
    latencies: dict[str, list[float]] = attrs.field(factory=lambda: {k: [] for k in _KINDS})
    completed: dict[str, int] = attrs.field(factory=lambda: {k: 0 for k in _KINDS})
    fetches: int = 0
    hits: int = 0
    hit_tokens: int = 0
    cancellations: int = 0
    injected_errors: int = 0
    out_of_blocks: int = 0
    generations: int = 0
    generated_tokens: int = 0
    #: (prompt, max_tokens) -> (tokens, finish reason) of finished generations
    finished: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], str]] = attrs.field(factory=dict)
    #: (prompt, the generation's tokens, its cold run's) where they differ, to weigh
    partings: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = attrs.field(factory=list)
    violations: list[str] = attrs.field(factory=list)


class _Client:
    """One simulated scheduler: holds up to ``max_held`` requests at a time."""

    def __init__(
        self,
        number: int,
        rt: CacheRuntime,
        config: StressConfig,
        prefixes: Sequence[tuple[int, ...]],
        tally: _Tally,
        text_prefixes: Sequence[tuple[int, ...]] = (),
    ) -> None:
        self._rng = random.Random(config.seed * 1_000_003 + number)
        self._rt = rt
        self._config = config
        self._prefixes = prefixes
        self._text_prefixes = text_prefixes
        self._tally = tally
        self._name = f"c{number}"
        self._serial = 0
        self.held: dict[str, _Held] = {}

    async def run(self, quota: int, deadline: float) -> int:
        done = 0
        while done < quota and anyio.current_time() < deadline:
            await self._step()
            done += 1
        return done

    def _new_id(self) -> str:
        self._serial += 1
        return f"{self._name}-{self._serial}"

    def _tokens(self, num_tokens: int) -> tuple[int, ...]:
        rng = self._rng
        return tuple(rng.randrange(1, 50_000) for _ in range(num_tokens))

    async def _step(self) -> None:
        rng = self._rng
        held = self.held
        roll = rng.random()
        if self._text_prefixes and rng.random() < self._config.generate_rate:
            kind = "generate"
        elif not held or (len(held) < self._config.max_held and roll < 0.35):
            kind = "fetch"
        elif len(held) >= self._config.max_held or roll < 0.55:
            kind = "release"
        elif roll < 0.85:
            kind = "store"
        else:
            kind = "fork"
        with anyio.CancelScope() as scope:
            if rng.random() < self._config.cancel_rate:
                # Typical calls take tens to hundreds of microseconds (a
                # generation tens of milliseconds): the deadline lands
                # anywhere from before the first await to after the last.
                scale = 20e-3 if kind == "generate" else 150e-6
                scope.deadline = anyio.current_time() + rng.expovariate(1 / scale)
            started = time.perf_counter()
            try:
                await getattr(self, "_" + kind)()
                self._tally.completed[kind] += 1
            except InjectedFault:
                self._tally.injected_errors += 1
            except OutOfBlocks:
                self._tally.out_of_blocks += 1
            except RuntimeClosed:
                raise
            except Exception as error:  # anything else is a bug in mlxkv
                self._tally.violations.append(f"{kind}: unexpected {type(error).__name__}: {error}")
            finally:
                self._tally.latencies[kind].append(time.perf_counter() - started)
        if scope.cancelled_caught:
            self._tally.cancellations += 1

    async def _fetch(self) -> None:
        rng = self._rng
        prompt = rng.choice(self._prefixes) + self._tokens(rng.randrange(0, 3 * self._config.block_size))
        request_id = self._new_id()
        result = await self._rt.fetch(request_id, prompt)
        size = self._config.block_size
        self.held[request_id] = _Held(prompt, result.num_cached_tokens // size)
        self._tally.fetches += 1
        if result.num_cached_tokens:
            self._tally.hits += 1
            self._tally.hit_tokens += result.num_cached_tokens

    async def _store(self) -> None:
        request_id = self._rng.choice(list(self.held))
        request = self.held[request_id]
        size = self._config.block_size
        tokens = request.tokens + self._tokens(self._rng.randrange(0, 2 * size))
        payloads = [(request_id, i) for i in range(request.num_blocks, len(tokens) // size)]
        result = await self._rt.store(request_id, tokens, payloads)
        self.held[request_id] = _Held(tokens, result.num_held_blocks)

    async def _fork(self) -> None:
        source_id = self._rng.choice(list(self.held))
        request_id = self._new_id()
        await self._rt.fork(source_id, request_id)
        self.held[request_id] = attrs.evolve(self.held[source_id])

    async def _generate(self) -> None:
        from mlxkv.generation import GenerationReport

        rng = self._rng
        prompt = list(rng.choice(self._text_prefixes)) + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 24))]
        max_tokens = rng.randrange(1, 9)
        async with self._rt.generate(prompt, max_tokens=max_tokens, request_id=self._new_id()) as stream:
            async for record in stream:
                if isinstance(record, GenerationReport):
                    self._tally.generations += 1
                    self._tally.generated_tokens += record.generated_tokens
                    if len(self._tally.finished) < self._config.verify:
                        key = (tuple(prompt), max_tokens)
                        self._tally.finished[key] = (record.tokens, record.finish_reason)

    async def _release(self) -> None:
        request_id = self._rng.choice(list(self.held))
        # Shielded inside: it completes even when the deadline passes.
        await self._rt.release(request_id)
        del self.held[request_id]


class _Faults:
    """The runtime's intercept: raises :class:`InjectedFault` in a share of the
    faultable messages while :attr:`enabled`."""

    def __init__(self, rate: float, seed: int) -> None:
        self._rate = rate
        self._rng = random.Random(seed ^ 0x5EED)
        self.enabled = rate > 0

    def __call__(self, actor: str, message: Message) -> None:
        kind = type(message).__name__
        if self.enabled and kind in _FAULTABLE and self._rng.random() < self._rate:
            raise InjectedFault(actor, kind)


async def _verify(rt: CacheRuntime, tally: _Tally) -> int:
    """Compute every recorded generation again, cold and alone; count matches
    and keep every mismatch to weigh (:func:`_weigh_partings`)."""
    matched = 0
    for number, ((prompt, max_tokens), (tokens, reason)) in enumerate(tally.finished.items()):
        salt = f"stress-verify-{number}"
        async with rt.generate(list(prompt), max_tokens=max_tokens, cache_salt=salt) as stream:
            async for _ in stream:
                pass
        cold = stream.report
        assert cold is not None, "a generation that ran to its end has a report"
        if (cold.tokens, cold.finish_reason) == (tokens, reason):
            matched += 1
        else:
            tally.partings.append((prompt, tokens, cold.tokens))
    return matched


def _weigh_partings(
    path: str, info: ModelInfo, partings: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
) -> tuple[int, list[str]]:
    """Where each generation first parts from its cold run, measured with the
    model at ``path`` loaded here by mlx-lm (the runtime closed: this thread
    is the only one using MLX): how many part at a tie within float noise,
    and a violation for each of the rest (a vision model's are all
    violations: its generations are not measured). Both runs were given as
    many tokens, so the shorter one chose a stop token there."""
    model = None
    if not info.takes_images:
        from mlx_lm import load

        model = load(path)[0]
    ties, violations = 0, []
    for prompt, tokens, cold in partings:
        found = None
        if model is not None:
            found = first_divergence(model, prompt, tokens, cold, stop_tokens=sorted(info.eos_token_ids))
        if found is not None and found.tie:
            ties += 1
            continue
        if found is None:
            at = next((i for i, (a, b) in enumerate(zip(tokens, cold)) if a != b), min(len(tokens), len(cold)))
            measured = ""
        else:
            at, measured = found.position, f"; {found.gap:.3g} apart there, a tie within {found.margin:.3g}"
        violations.append(
            f"a generation of a {len(prompt)}-token prompt gave other tokens than a cold run"
            f" from token {at} on ({len(tokens)} against {len(cold)}{measured})"
        )
    return ties, violations


def _quantile(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def _check(rt: CacheRuntime, violations: list[str], when: str) -> int:
    try:
        exact = await rt.check_invariants()
    except AssertionError as error:
        violations.append(f"{when}: {error}")
        return 0
    if not exact:
        violations.append(f"{when}: references could not be cross-checked (calls in flight)")
        return 0
    stats = await rt.stats()
    if stats.compute is not None and stats.compute.num_live:
        violations.append(f"{when}: {stats.compute.num_live} requests still live in the compute actor")
        return 0
    if stats.index.num_in_flight:
        violations.append(f"{when}: {stats.index.num_in_flight} block claims left with no request computing")
        return 0
    return 1


async def run_stress(config: StressConfig) -> StressReport:
    """Run one stress test on the current event loop.

    Args:
        config: what to run (``config.backend`` is for callers that start
            the loop; see :func:`mlxkv.cli.main`).

    Returns:
        The report; ``report.ok`` is False if anything went wrong.
    """
    rng = random.Random(config.seed)
    prefixes = [
        tuple(rng.randrange(1, 50_000) for _ in range(config.prefix_blocks * config.block_size))
        for _ in range(config.num_prefixes)
    ]
    text_prefixes = [
        tuple(rng.randrange(1, 250) for _ in range(rng.randrange(2, 12) * config.block_size))
        for _ in range(3 if config.model else 0)
    ]
    tally = _Tally()
    checks = 0
    operations = 0
    faults = _Faults(config.error_rate, config.seed)
    async with CacheRuntime(
        block_size=config.block_size,
        max_blocks=config.max_blocks,
        intercept=faults if faults.enabled else None,
        model=config.model,
        kv_tiers=config.kv_tiers,
    ) as rt:
        clients = [_Client(i, rt, config, prefixes, tally, text_prefixes) for i in range(config.clients)]
        started = time.perf_counter()
        deadline = anyio.current_time() + config.duration
        while operations < config.operations and anyio.current_time() < deadline:
            budget = min(config.check_every, config.operations - operations)
            quotas = [budget // len(clients) + (i < budget % len(clients)) for i in range(len(clients))]
            done = [0] * len(clients)

            async def drive(i: int) -> None:
                done[i] = await clients[i].run(quotas[i], deadline)

            async with anyio.create_task_group() as tg:
                for i in range(len(clients)):
                    tg.start_soon(drive, i)
            operations += sum(done)
            checks += await _check(rt, tally.violations, f"after {operations} operations")
        seconds = time.perf_counter() - started
        for client in clients:
            for request_id in list(client.held):
                await rt.release(request_id)
            client.held.clear()
        checks += await _check(rt, tally.violations, "after releasing every request")
        workload = await rt.stats()
        faults.enabled = False
        token_checks = await _verify(rt, tally)
        checks += await _check(rt, tally.violations, "after the token checks")
        await rt.flush_tiers()
        stats = await rt.stats()
        info = rt.model_info
    token_ties = 0
    if tally.partings:
        assert config.model is not None and info is not None, "only a model's generations are checked"
        path = check_model_source(config.model).path
        token_ties, unexplained = await anyio.to_thread.run_sync(_weigh_partings, path, info, tally.partings)
        tally.violations += unexplained
    leaked = stats.allocator.num_referenced
    open_tables = stats.index.num_active_requests
    if leaked:
        tally.violations.append(f"{leaked} blocks still referenced after every request ended")
    if open_tables:
        tally.violations.append(f"{open_tables} request tables left after every request ended")
    return StressReport(
        config=config,
        operations=operations,
        seconds=seconds,
        per_kind=tuple(
            OperationStatistics(
                kind=kind,
                count=len(samples),
                completed=tally.completed[kind],
                p50_ms=_quantile(samples, 0.5) * 1e3,
                p99_ms=_quantile(samples, 0.99) * 1e3,
            )
            for kind, samples in tally.latencies.items()
        ),
        fetches=tally.fetches,
        hits=tally.hits,
        hit_tokens=tally.hit_tokens,
        evictions=workload.allocator.num_evictions,
        cancellations=tally.cancellations,
        injected_errors=tally.injected_errors,
        out_of_blocks=tally.out_of_blocks,
        generations=tally.generations,
        generated_tokens=tally.generated_tokens,
        shared_waits=workload.index.num_waits,
        token_checks=token_checks,
        token_ties=token_ties,
        tier_blocks_loaded=0 if stats.tiers is None else stats.tiers.num_blocks_found,
        tier_blocks_written=0 if stats.tiers is None else stats.tiers.num_blocks_written,
        mean_batch_size=0.0 if workload.compute is None else round(workload.compute.mean_batch_size, 2),
        checks=checks,
        leaked_blocks=leaked,
        open_tables=open_tables,
        violations=tuple(tally.violations),
    )
