"""Where two greedy runs part, and whether at a tie (:mod:`mlxkv.divergence`),
and the benchmarks' summary of it (``scripts/divergence.py``), over real
tiny models."""

from __future__ import annotations

import attrs
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from mlxkv import divergence as core
from mlxkv.default_model import TINY_LLAMA, ensure_model

from script_modules import script_module

divergence = script_module("divergence")

PROMPT = [5 + (i * 7) % 90 for i in range(24)]


def _load(spec, model_dir):
    from mlx_lm import load

    model, _ = load(str(ensure_model(spec, model_dir)))
    return model


def _greedy(model, prompt, tokens: int = 8) -> list[int]:
    return [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=tokens)]


def _ranked(model, context) -> list[int]:
    """The vocabulary by the model's logits after ``context``, best first."""
    logits = model(mx.array(context)[None])[0, -1]
    return mx.argsort(-logits.astype(mx.float32)).tolist()


@pytest.fixture(scope="module")
def llama(model_dir):
    """A copy of the tiny Llama of its own (a test ties two of its tokens)."""
    return _load(TINY_LLAMA, model_dir)


class TestUlp:
    def test_units_in_the_last_place(self):
        """A bfloat16 logit near 0.57 is kept to 2**-8, a float32 one at 1.0
        to 2**-23, a float16 one at 3.0 to 2**-9."""
        assert core.ulp(0.5664, "bfloat16") == 2.0**-8
        assert core.ulp(1.0, "float32") == 2.0**-23
        assert core.ulp(-3.0, "float16") == 2.0**-9


class TestFirstDivergence:
    def test_equal_runs_and_a_shorter_count_do_not_part(self, llama):
        """Equal tokens, or one run given fewer tokens (no stop tokens to
        say it chose to stop), do not diverge."""
        reference = _greedy(llama, PROMPT)
        assert core.first_divergence(llama, PROMPT, reference, list(reference)) is None
        assert core.first_divergence(llama, PROMPT, reference, reference[:5]) is None

    def test_a_token_far_down_the_ranking_is_not_a_tie(self, llama):
        """A run that takes the model's worst token where greedy took its best
        parts there by far more than float noise."""
        reference = _greedy(llama, PROMPT)
        worst = _ranked(llama, PROMPT + reference[:3])[-1]
        other = reference[:3] + [worst] + reference[4:]
        found = core.first_divergence(llama, PROMPT, reference, other, row=5)
        assert (found.row, found.position, found.reference_token, found.other_token) == (5, 3, reference[3], worst)
        assert found.gap > 100 * max(found.noise, found.top_ulp)
        assert not found.tie

    def test_two_tokens_of_equal_logits_are_a_tie(self, llama):
        """Where two tokens' output weights are the same, their logits are
        equal, and a run that takes the other one parts at a tie."""
        reference = _greedy(llama, PROMPT)
        runner_up = _ranked(llama, PROMPT + reference[:2])[1]
        head = llama.lm_head.weight
        try:
            llama.lm_head.weight = head.at[runner_up].add(head[reference[2]] - head[runner_up])
            other = reference[:2] + [runner_up] + reference[3:]
            found = core.first_divergence(llama, PROMPT, reference, other)
        finally:
            llama.lm_head.weight = head
        assert found.position == 2 and found.gap == 0.0 and found.tie

    def test_a_stop_is_measured_against_the_best_stop_token(self, llama):
        """A run that stopped where the other went on is compared by its
        best stop token's logit."""
        reference = _greedy(llama, PROMPT)
        ranked = _ranked(llama, PROMPT + reference[:4])
        stop = ranked[-1]
        found = core.first_divergence(llama, PROMPT, reference, reference[:4], stop_tokens=[stop])
        assert (found.position, found.reference_token, found.other_token) == (4, reference[4], None)
        assert not found.tie

    def test_a_half_precision_model_has_noise_and_keeps_its_weights(self, model_dir):
        """In bfloat16 the noise counts what its rounding moved the logits
        by (above zero), the same with float32 weights made once beforehand,
        and the float32 pass leaves the weights as they were."""
        model = _load(attrs.evolve(TINY_LLAMA, name="tiny-llama-bf16", dtype="bfloat16"), model_dir)
        before = {name: (w.dtype, w) for name, w in tree_flatten(model.parameters())}
        reference = _greedy(model, PROMPT)
        worst = _ranked(model, PROMPT + reference[:1])[-1]
        found = core.first_divergence(model, PROMPT, reference, reference[:1] + [worst])
        top = model(mx.array(PROMPT + reference[:1])[None])[0, -1].max().item()
        assert found.noise > 0 and found.top_ulp == core.ulp(top, "bfloat16")
        wide = core.float32_weights(model)
        again = core.first_divergence(model, PROMPT, reference, reference[:1] + [worst], wide_weights=wide)
        assert again == found
        after = dict(tree_flatten(model.parameters()))
        assert all(after[name].dtype == dtype and after[name] is w for name, (dtype, w) in before.items())


class TestTokenComparison:
    def test_equal_runs_say_so_without_a_warning(self, llama):
        """Every method equal to the reference: one line, no warning."""
        seen = divergence.TokenComparison(llama, "batch_generate")
        reference = [_greedy(llama, PROMPT, 4)]
        seen.add("N=1", "mlxkv", [PROMPT], reference, [list(reference[0])])
        seen.add("N=1", "mlxkv, copies", [PROMPT], reference, [list(reference[0])])
        assert seen.measure() == [("greedy tokens: every method's equal to batch_generate's (2 runs)", False)]

    def test_a_run_apart_is_warned_of_by_its_row_and_token(self, llama, capsys):
        """A method whose row parts by more than noise warns, naming the row
        and the token; a later round of the same setting is not measured again."""
        seen = divergence.TokenComparison(llama, "stream_generate", most=1)
        prompts = [PROMPT, PROMPT[1:]]
        reference = [_greedy(llama, p, 4) for p in prompts]
        worst = _ranked(llama, prompts[1] + reference[1][:1])[-1]
        wrong = [list(reference[0]), reference[1][:1] + [worst] + reference[1][2:]]
        seen.add("8x4", "mlxkv", prompts, reference, wrong)
        seen.add("8x4", "mlxkv", prompts, reference, [list(r) for r in reference])
        lines = divergence.compare_tokens(seen)
        assert len(lines) == 1
        assert lines[0].startswith("mlxkv (8x4): tokens differ from stream_generate's in 1 of 2 rows, 1 apart")
        assert "row 1 at token 1" in lines[0]
        assert "warning: mlxkv (8x4)" in capsys.readouterr().err


def test_a_report_says_how_many_rows_were_measured():
    """More rows differing than measured: the line says both counts."""
    tie = core.Divergence(
        row=0, position=3, reference_token=1, other_token=2, gap=0.0, noise=0.01, top_ulp=0.004
    )
    line, warns = divergence.report("mlxkv", "batch_generate", 32, 12, [tie])
    assert line.startswith("mlxkv: tokens differ from batch_generate's in 12 of 32 rows; 1 measured, each first")
    assert not warns
