"""The stress tool: short runs as tests, with and without faults."""

from __future__ import annotations

import json

import pytest

from mlxkv import CacheRuntime
from mlxkv.cli import main
from mlxkv.stress import StressConfig, run_stress


class TestStress:
    async def test_faults_break_no_invariant(self, anyio_backend):
        """3,000 operations with cancellations, injected errors and a tiny pool leave every
        invariant intact (how long they take does not matter)."""
        config = StressConfig(
            clients=8,
            operations=3_000,
            duration=120.0,
            check_every=500,
            max_blocks=40,
            cancel_rate=0.15,
            error_rate=0.05,
            backend=anyio_backend,
        )
        report = await run_stress(config)
        assert report.ok, report.format()
        assert report.operations == 3_000 and report.checks >= 6
        assert report.cancellations > 0 and report.injected_errors > 0
        assert report.evictions > 0 and report.out_of_blocks > 0
        assert (report.leaked_blocks, report.open_tables) == (0, 0)

    async def test_generation_under_faults(self, anyio_backend, model_dir):
        """Generating clients over shared prefixes, with cancellations and failing
        computing requests while others wait for their blocks, leave nothing live,
        claimed or leaked."""
        from mlxkv.default_model import TINY_LLAMA, ensure_model

        config = StressConfig(
            clients=8,
            operations=400,
            duration=120.0,
            check_every=100,
            max_blocks=200,
            cancel_rate=0.15,
            error_rate=0.05,
            generate_rate=0.4,
            model=str(ensure_model(TINY_LLAMA, model_dir)),
            backend=anyio_backend,
        )
        report = await run_stress(config)
        assert report.ok, report.format()
        assert report.generations > 0 and report.generated_tokens > 0
        assert report.shared_waits > 0 and report.mean_batch_size > 1
        assert report.cancellations > 0 and report.injected_errors > 0
        assert (report.leaked_blocks, report.open_tables) == (0, 0)
        assert report.token_checks > 0 and report.token_checks + report.token_ties == min(64, report.generations)

    async def test_generation_under_faults_over_both_tiers(self, anyio_backend, model_dir, tmp_path, redis_server):
        """The same over a small pool with a disk and a Redis tier below it:
        evicted prefixes come back from the tiers while requests are cancelled
        and fail, and every checked generation still matches a cold run."""
        from mlxkv.default_model import TINY_LLAMA, ensure_model

        config = StressConfig(
            clients=8,
            operations=400,
            duration=120.0,
            check_every=100,
            max_blocks=48,
            cancel_rate=0.1,
            error_rate=0.02,
            generate_rate=0.4,
            model=str(ensure_model(TINY_LLAMA, model_dir)),
            kv_tiers=(f"file://{tmp_path / 'kv'}", redis_server.url),
            backend=anyio_backend,
        )
        report = await run_stress(config)
        assert report.ok, report.format()
        assert report.tier_blocks_written > 0 and report.tier_blocks_loaded > 0
        assert (report.leaked_blocks, report.open_tables) == (0, 0)
        assert report.token_checks > 0 and report.token_checks + report.token_ties == min(64, report.generations)

    async def test_a_wrong_prefix_fails_the_token_checks(self, anyio_backend, model_dir, monkeypatch):
        """With every prefix rebuilt from blocks made wrong (block 0's KV
        replaced by block 1's), finished generations no longer match their
        cold runs, and the report says so."""
        from mlxkv.default_model import TINY_LLAMA, ensure_model

        from parity import break_prefix_rebuild

        break_prefix_rebuild(monkeypatch, 4)
        config = StressConfig(
            clients=4,
            operations=200,
            duration=120.0,
            check_every=100,
            generate_rate=0.5,
            verify=16,
            model=str(ensure_model(TINY_LLAMA, model_dir)),
            backend=anyio_backend,
        )
        report = await run_stress(config)
        assert not report.ok
        assert any("other tokens than a cold run" in v for v in report.violations)
        assert report.token_checks < 16

    async def test_shared_prefixes_hit(self, anyio_backend):
        """Without faults, most fetches reuse blocks and every kind of call is measured."""
        report = await run_stress(
            StressConfig(clients=8, operations=1_000, duration=4.0, check_every=500, backend=anyio_backend)
        )
        assert report.ok, report.format()
        assert report.hits > report.fetches // 2
        assert {row.kind for row in report.per_kind if row.count} == {"fetch", "store", "fork", "release"}
        assert "violations: none" in report.format()


class TestWeighingPartings:
    def test_a_tie_is_counted_and_anything_else_is_a_violation(self, model_dir, tmp_path):
        """A cold run that takes the twin of the generation's first token (a
        tie of gap 0) is counted; one that takes the token the model ranks
        last is a violation naming where and by how much they part; a vision
        model's partings are violations, not measured."""
        import mlx.core as mx
        from mlx_lm import load

        from mlxkv.default_model import TINY_LLAMA, ensure_model
        from mlxkv.stress import _weigh_partings

        from model_weights import with_twin_tokens

        prompt = tuple(5 + (i * 7) % 90 for i in range(24))
        path = tmp_path / "twins"
        first, twin = with_twin_tokens(ensure_model(TINY_LLAMA, model_dir), path, list(prompt))
        model = load(str(path))[0]
        chosen = int(mx.argmax(model(mx.array([prompt]))[0, -1]).item())
        assert chosen in (first, twin)
        other = twin if chosen == first else first
        worst = int(mx.argmin(model(mx.array([prompt]))[0, -1]).item())
        info = _info(eos_token_ids=frozenset({0}))
        partings = [(prompt, (chosen, 7), (other, 7)), (prompt, (chosen, 7), (worst, 7))]
        ties, violations = _weigh_partings(str(path), info, partings)
        assert ties == 1 and len(violations) == 1
        assert "from token 0 on" in violations[0] and "apart there, a tie within" in violations[0]
        ties, violations = _weigh_partings(str(path), _info(takes_images=True), partings[:1])
        assert ties == 0 and len(violations) == 1 and "apart" not in violations[0]


class TestCommandLine:
    def test_stress_succeeds(self, capsys):
        """``mlxkv stress`` prints the summary and exits 0."""
        assert main(["stress", "--operations", "300", "--clients", "4", "--faults", "--backend", "trio"]) == 0
        out = capsys.readouterr().out
        assert "ops/s" in out and "p99 ms" in out and "violations: none" in out

    def test_stress_json(self, capsys, tmp_path):
        """``--json FILE`` writes the report as JSON beside the summary, as ``run`` does;
        ``--json -`` prints only the JSON."""
        target = tmp_path / "stress.json"
        assert main(["stress", "--operations", "200", "--clients", "2", "--json", str(target)]) == 0
        assert "ops/s" in capsys.readouterr().out
        report = json.loads(target.read_text())
        assert report["operations"] == 200 and report["violations"] == []
        assert main(["stress", "--operations", "200", "--clients", "2", "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)["operations"] == 200

    def test_fetch_counts_agree(self, capsys):
        """The fetch row's completed count is the hit line's denominator."""
        assert main(["stress", "--operations", "400", "--clients", "4", "--faults", "--json", "-"]) == 0
        report = json.loads(capsys.readouterr().out)
        fetch = next(row for row in report["per_kind"] if row["kind"] == "fetch")
        assert fetch["completed"] == report["fetches"] <= fetch["count"]

    def test_violation_exits_non_zero(self, capsys, monkeypatch):
        """A violated invariant makes the command exit 1 and name it."""

        async def broken(self):
            raise AssertionError("planted violation")

        monkeypatch.setattr(CacheRuntime, "check_invariants", broken)
        assert main(["stress", "--operations", "100", "--clients", "2"]) == 1
        assert "planted violation" in capsys.readouterr().out

    def test_bad_usage(self, capsys):
        """An out-of-range option exits 2 with a message."""
        assert main(["stress", "--cancel-rate", "2"]) == 2
        assert "cancel_rate" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(["stress", "--backend", "curio"])


def _info(**fields):
    """A ModelInfo with only what weighing reads set."""
    from mlxkv.actors.model_info import ModelInfo

    base = dict(vocab_size=None, eos_token_ids=frozenset(), cache_layers=(), has_recurrent=False)
    return ModelInfo(**{**base, **fields})
