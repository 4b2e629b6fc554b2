"""The split-half check of whether a fit sample supports its curvature."""
import pytest
import torch

from prism_select.curvature.support import (DAMPING_LADDER, MIN_AGREEMENT, split_half, split_halves,
                                            supported_damping_factor, walk_ladder)
from prism_select.metrics import spearman

#: a rank correlation of identical orders, up to float64 rounding of its sums
RANK_TOL = 1e-12


def test_halves_are_disjoint_cover_everything_and_depend_on_the_seed():
    a, b = split_halves(61, seed=3)
    assert sorted(a + b) == list(range(61)) and not set(a) & set(b) and (len(a), len(b)) == (30, 31)
    assert split_halves(61, seed=3) == (a, b) and split_halves(61, seed=4) != (a, b)


def test_spearman_against_its_definition():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, generator=g, dtype=torch.float64), torch.randn(40, generator=g, dtype=torch.float64)
    rx, ry = x.argsort().argsort().double(), y.argsort().argsort().double()
    d2 = float(((rx - ry) ** 2).sum())
    assert abs(spearman(x, y) - (1 - 6 * d2 / (40 * (40 ** 2 - 1)))) < 1e-12  # no ties: the textbook formula
    assert spearman(x, 3 * x + 1) == pytest.approx(1.0, abs=RANK_TOL)
    assert spearman(x, -x) == pytest.approx(-1.0, abs=RANK_TOL)
    assert spearman(x, x.exp()) == pytest.approx(1.0, abs=RANK_TOL)  # ranks only


def test_the_least_damping_whose_halves_agree_is_chosen():
    below, above = MIN_AGREEMENT - 0.01, MIN_AGREEMENT
    assert supported_damping_factor({0.1: above, 1.0: above}) == 0.1
    assert supported_damping_factor({0.1: below, 1.0: below, 10.0: above, 100.0: above}) == 10.0
    assert supported_damping_factor({100.0: above, 0.1: below}) == 100.0  # whatever the order given
    assert supported_damping_factor(dict.fromkeys(DAMPING_LADDER, below)) is None
    # the least factor from which on every larger one agrees too
    assert supported_damping_factor({0.1: above, 1.0: below, 10.0: above, 100.0: above}) == 10.0


def test_the_ladder_is_walked_down_until_the_halves_disagree():
    asked = []

    def agreement_at(factor, values={100.0: 0.95, 10.0: 0.92, 1.0: 0.5, 0.1: 0.99}):
        asked.append(factor)
        return values[factor]

    walked = walk_ladder(agreement_at)
    assert asked == [100.0, 10.0, 1.0] and walked == {100.0: 0.95, 10.0: 0.92, 1.0: 0.5}
    res = split_half(30, walked)
    assert res.factor == 10.0 and list(res.agreement) == [1.0, 10.0, 100.0]
    assert res.to_json()["supported"] and res.to_json()["agreement"] == {"1": 0.5, "10": 0.92, "100": 0.95}
    asked.clear()
    assert walk_ladder(lambda f: asked.append(f) or 0.2) == {max(DAMPING_LADDER): 0.2} and len(asked) == 1
    assert split_half(30, {max(DAMPING_LADDER): 0.2}).factor is None


def test_agreement_sample_bounds_the_scored_examples():
    from prism_select.curvature.support import AGREEMENT_EXAMPLES, agreement_sample
    assert agreement_sample(AGREEMENT_EXAMPLES, 0) == list(range(AGREEMENT_EXAMPLES))
    a = agreement_sample(3 * AGREEMENT_EXAMPLES, 0)
    assert len(a) == len(set(a)) == AGREEMENT_EXAMPLES and a == sorted(a) and max(a) < 3 * AGREEMENT_EXAMPLES
    assert a == agreement_sample(3 * AGREEMENT_EXAMPLES, 0) != agreement_sample(3 * AGREEMENT_EXAMPLES, 1)


def _brute_spearman(a: list, b: list) -> float:
    """Spearman's rho in float64 from its definition: the Pearson correlation of average
    ranks (each tie the mean of the 1-based positions it spans), sums over Python floats."""
    def ranks(x):
        out = [0.0] * len(x)
        for i, v in enumerate(x):
            below, same = sum(1 for w in x if w < v), sum(1 for w in x if w == v)
            out[i] = below + (same + 1) / 2
        return out
    ra, rb = ranks([float(v) for v in a]), ranks([float(v) for v in b])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def test_spearman_ties_take_average_ranks_as_the_float64_definition():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float64, torch.bfloat16):  # bf16: many ties after rounding
        x = torch.randint(0, 5, (60,), generator=g).to(dtype)
        y = (x.double() + torch.randn(60, generator=g, dtype=torch.float64)).round().to(dtype)
        assert spearman(x, y) == pytest.approx(_brute_spearman(x.tolist(), y.tolist()), abs=RANK_TOL)
        assert spearman(x.tolist(), y.tolist()) == spearman(x, y)  # lists and tensors alike
    # the order of tied records does not matter: reversing the input changes nothing
    a, b = [1, 1, 2, 2, 3], [5, 4, 4, 3, 3]
    assert spearman(a, b) == pytest.approx(spearman(a[::-1], b[::-1]), abs=RANK_TOL)
    assert spearman(a, b) == pytest.approx(_brute_spearman(a, b), abs=RANK_TOL)
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0, abs=RANK_TOL)


def test_spearman_of_a_constant_input_is_nan():
    """No ranking is defined when every score is equal: NaN, on either side, and with
    fewer than two scores."""
    import math
    assert math.isnan(spearman([0.5] * 6, [1, 2, 3, 4, 5, 6]))
    assert math.isnan(spearman(torch.arange(6.0), torch.zeros(6)))
    assert math.isnan(spearman([1.0], [2.0])) and math.isnan(spearman([], []))
    with pytest.raises(ValueError, match="different lengths"):
        spearman([1, 2, 3], [1, 2])


def test_a_constant_agreement_does_not_stop_the_ladder():
    """A constant score list (NaN agreement) is no disagreement: the walk goes on."""
    nan = float("nan")
    assert supported_damping_factor({f: nan for f in DAMPING_LADDER}) == min(DAMPING_LADDER)
